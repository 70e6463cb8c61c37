"""Start vLLM's OpenAI-compatible server (its CPU build) on a checkpoint, with the KV budget ours gets.

``--model`` is a Hugging Face checkpoint directory: by default the random benchmark checkpoint (``bench-random``);
``benchmarks.peers.serve_vs_vllm`` passes its ``--model``'s (a GGUF file's export, ``benchmarks.common.models``) and the served
name ours has.

This file is executed by the Python of the separate virtualenv that holds vLLM (``make peer-venv``), never
imported by ours: the standard library at module level, vLLM only inside ``main``. It serves what
``configs/bench-vs-vllm.yaml`` serves, for loading both with ``benchmarks.serving.serving`` (issue 12):

    PEER_PYTHON benchmarks/peers/vllm_serve.py [--threads-bind auto|0-1] [--port 8001] [-- more `vllm serve` flags]
    .venv/bin/python -m benchmarks.serving.serving --base-url http://127.0.0.1:8001 --vocab-range 4 4096 ...

It runs ``vllm serve`` in this process, as the ``vllm`` command would (through ``vllm_cli.py``: that command
itself dies with ``PackageNotFoundError: vllm``). The same sizes as ``benchmarks.peers.vllm_baseline``'s
offline job: the KV budget in tokens (8,000) in blocks of 32 (a multiple of 32 on CPU), one more block
than that needs (vLLM holds one back) given as ``--num-gpu-blocks-override`` and sized exactly by
``--kv-cache-memory-bytes`` (``VLLM_CPU_KVCACHE_SPACE``, whole GiB, is removed from the environment), 64
batch slots, 2,048 tokens per step, ``max_model_len`` 2,048, float32. ``--threads-bind`` is
``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` (vLLM's default, one compute core of the two here) or a CPU list
such as ``0-1``. The server listens on 127.0.0.1:8001 (ours on :8000) under the same model name as ours;
stop it by killing its process group (its engine runs in a spawned child process).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from kv_budget import BLOCK_SIZE, DTYPE_BYTES, checkpoint_kv_shape, kv_cache_sizes, threads_bind  # beside this file
from vllm_cli import run_vllm

# benchmarks.common.workloads' checkpoint (MODEL_NAME, build_checkpoint's default cache directory) and KV budget
# (BLOCK_SIZE x NUM_KV_BLOCKS); that module needs numpy, so they are repeated here rather than imported.
MODEL_NAME = "bench-llama-h256-l4-v4096"
KV_BUDGET_TOKENS = 16 * 500


def default_checkpoint() -> Path:
    root = os.environ.get("INFLIGHT_BENCH_CACHE") or Path.home() / ".cache" / "inflight" / "benchmarks"
    return Path(root) / f"{MODEL_NAME}-seed0"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vllm_serve.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_checkpoint()),
                        help="checkpoint directory (default: the benchmark checkpoint, %(default)s)")
    parser.add_argument("--served-model-name", default=MODEL_NAME, help="the name /v1/models gives (as ours)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads-bind", type=threads_bind, default="auto", metavar="CPUS",
                        help="VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's default: one core of two here) or a CPU "
                             "list such as 0-1")
    parser.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32", help="model and KV dtype")
    parser.add_argument("--kv-budget-tokens", type=int, default=KV_BUDGET_TOKENS)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true", help="turn vLLM's torch.compile off")
    parser.add_argument("--dry-run", action="store_true", help="print the environment and command, start nothing")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="after --: more `vllm serve` flags, passed through as they are")
    args = parser.parse_args(argv)
    if args.vllm_args[:1] == ["--"]:
        args.vllm_args = args.vllm_args[1:]
    return args


def serve_argv(args: argparse.Namespace) -> list[str]:
    """`vllm serve ...`'s arguments (after "serve") for ``args``."""
    num_blocks, kv_bytes = kv_cache_sizes(args.kv_budget_tokens, BLOCK_SIZE, *checkpoint_kv_shape(args.model),
                                          DTYPE_BYTES[args.dtype])
    argv = [args.model, "--served-model-name", args.served_model_name, "--host", args.host, "--port", str(args.port),
            "--dtype", args.dtype, "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(num_blocks), "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-num-seqs", str(args.max_num_seqs),
            # as ours: at least a token per slot
            "--max-num-batched-tokens", str(max(args.max_num_batched_tokens, args.max_num_seqs)),
            "--max-model-len", str(args.max_model_len), "--seed", "0",
            "--disable-uvicorn-access-log"]  # a log line per request: ours has its access logs off too
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(args.vllm_args)


def server_env(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """The environment changes: the compute threads' CPUs, no whole-GiB KV size, nothing sent out."""
    env = dict(environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB: it would override --kv-cache-memory-bytes
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: no hub look-ups at start
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    vllm_argv = ["vllm", "serve", *serve_argv(args)]
    env = server_env(args, dict(os.environ))
    changed = {k: env[k] for k in sorted(env) if os.environ.get(k) != env[k]}
    removed = sorted(set(os.environ) - set(env))
    print(f"vllm_serve: env {changed}{f', removed {removed}' if removed else ''}", file=sys.stderr)
    print(f"vllm_serve: {' '.join(vllm_argv)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    os.environ.clear()
    os.environ.update(env)  # before vLLM is imported; its spawned engine process inherits it
    return run_vllm(vllm_argv[1:])


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again: guard the entry point
    sys.exit(main())
