"""vLLM's CPU build as a baseline: the same workload through ``vllm.LLM``, in a separate virtualenv.

vLLM is never imported here nor a dependency of ours: ``run_vllm`` writes a job (the checkpoint, the
prompts as token ids, the output lengths, engine sizes) to a JSON file and runs
``benchmarks/peers/vllm_offline.py`` under the peer virtualenv's Python (``make peer-venv``), which
writes back each request's completion time from t=0 and its output length. Every run is a fresh
process: it loads and compiles the model (a minute or two) before its warm-up and the timed run.

vLLM gets what ours gets: the same KV budget in tokens (in blocks of 32, a multiple of 32 being required
on CPU, sized exactly by ``num_gpu_blocks_override`` and ``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE``
is cleared, whole GiB being too coarse), the same batch slots and tokens per step, greedy sampling with
EOS ignored (but by the requests that stop at end of sequence, the chat workload's), every request at t=0, and by
default every core of ``--threads`` for its compute (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's own default, ``auto``,
binds it to one core of the two here). The checkpoint is a Hugging Face directory (``BenchModel.hf_dir``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from benchmarks.common.workloads import MODEL_SHAPE, TOY_TOKEN_RANGE, BenchRequest, warmup_workload
from benchmarks.peers.hf_baselines import BaselineRun
from benchmarks.peers.kv_budget import BLOCK_SIZE, DTYPE_BYTES, checkpoint_kv_shape, kv_cache_sizes, threads_bind
from benchmarks.peers.preload import with_peer_preload

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "vllm_offline.py"
PEER_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
PEER_PYTHON_ENV = "INFLIGHT_VLLM_PYTHON"
MAX_MODEL_LEN = MODEL_SHAPE["max_position_embeddings"]
STDERR_TAIL_LINES = 40


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM runs: the peer's Python, the model's (and so the KV cache's) dtype, the CPUs its compute
    threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``: a list like ``0-1``, or ``auto``), and whether
    ``torch.compile`` is off (``enforce_eager``)."""

    python: str
    dtype: str = "float32"
    threads_bind: str = "0-1"
    enforce_eager: bool = False


# -- the peer's Python -------------------------------------------------------------------------------------
def resolve_peer_python(flag: str | None, environ: Mapping[str, str] | None = None,
                        default: Path | None = None) -> str:
    """``--vllm-python``, else ``$INFLIGHT_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` if it is there."""
    environ = os.environ if environ is None else environ
    default = PEER_VENV_PYTHON if default is None else default
    if flag:
        return _executable(flag, "--vllm-python")
    if environ.get(PEER_PYTHON_ENV):
        return _executable(environ[PEER_PYTHON_ENV], f"${PEER_PYTHON_ENV}")
    if default.exists():
        return str(default)
    raise ValueError(f"--baselines vllm: no Python with vLLM: run `make peer-venv` (it creates {default.parent.parent}) "
                     f"or pass --vllm-python PATH (or set {PEER_PYTHON_ENV})")


def _executable(path: str, source: str) -> str:
    """``path``, absolute: the worker runs in a directory of its own, where a relative path would find nothing."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"{source}: {path} is not an executable file (a Python with vllm-cpu installed; "
                         f"`make peer-venv` makes one)")
    return os.path.abspath(path)


# -- flags -------------------------------------------------------------------------------------------------
def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", metavar="PATH",
                        help=f"Python of the virtualenv holding vllm-cpu (default: ${PEER_PYTHON_ENV}, "
                             f"else .venv-vllm/bin/python from `make peer-venv`)")
    parser.add_argument("--vllm-dtype", choices=list(DTYPE_BYTES), default=None,
                        help="vLLM's model and KV dtype (default: ours, --dtype)")
    parser.add_argument("--vllm-threads-bind", type=threads_bind, metavar="CPUS",
                        help="CPUs for vLLM's compute threads, VLLM_CPU_OMP_THREADS_BIND (default: 0-{threads-1}, "
                             "every core of --threads; auto: vLLM's own default, which binds one core of two)")
    parser.add_argument("--vllm-eager", action="store_true", help="turn vLLM's torch.compile off (enforce_eager)")


def settings_from_args(args) -> VllmSettings:
    """The settings of ``add_vllm_args``' flags; ``ValueError`` when there is no peer Python."""
    bind = args.vllm_threads_bind or ("0" if args.threads == 1 else f"0-{args.threads - 1}")
    dtype = args.vllm_dtype or getattr(args, "dtype", None) or "float32"  # ours, unless told otherwise
    return VllmSettings(resolve_peer_python(args.vllm_python), dtype, bind, args.vllm_eager)


# -- the job -----------------------------------------------------------------------------------------------
def build_job(model_path: str | Path, requests: Sequence[BenchRequest], settings: VllmSettings,
              kv_budget_tokens: int, max_num_seqs: int, max_num_batched_tokens: int,
              token_range: Sequence[int] = TOY_TOKEN_RANGE, max_model_len: int = MAX_MODEL_LEN) -> dict[str, Any]:
    """What the worker reads: the checkpoint (a Hugging Face directory), the engine's sizes, the warm-up (prompts of
    the model's ordinary ``token_range``) and the timed requests."""
    num_blocks, kv_bytes = kv_cache_sizes(kv_budget_tokens, BLOCK_SIZE, *checkpoint_kv_shape(model_path),
                                          DTYPE_BYTES[settings.dtype])
    warmup = warmup_workload(token_range)
    return {
        "model": str(model_path), "dtype": settings.dtype, "block_size": BLOCK_SIZE,
        "kv_budget_tokens": kv_budget_tokens, "num_gpu_blocks_override": num_blocks, "kv_cache_memory_bytes": kv_bytes,
        "max_num_seqs": max_num_seqs,
        # as ours: at least a token per slot
        "max_num_batched_tokens": max(max_num_batched_tokens, max_num_seqs),
        "max_model_len": max_model_len, "enforce_eager": settings.enforce_eager,
        "prompts": [r.prompt_token_ids for r in requests], "output_lens": [r.max_tokens for r in requests],
        "sampling": [(r.temperature, r.top_p) for r in requests],
        "ignore_eos": [r.ignore_eos for r in requests],
        "warmup": {"prompts": [r.prompt_token_ids for r in warmup], "output_lens": [r.max_tokens for r in warmup]},
    }


def worker_env(settings: VllmSettings, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    env = with_peer_preload(settings.python, environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = settings.threads_bind
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB: it would override the exact size in the job
    return env


# -- a run -------------------------------------------------------------------------------------------------
def run_vllm(model_path: str | Path, requests: Sequence[BenchRequest], settings: VllmSettings, kv_budget_tokens: int,
             max_num_seqs: int, max_num_batched_tokens: int, worker: Path | None = None,
             token_range: Sequence[int] = TOY_TOKEN_RANGE, max_model_len: int = MAX_MODEL_LEN) -> BaselineRun:
    """One run of ``requests`` (all at t=0) through vLLM in a fresh worker process (``worker``: another
    script taking the same job, for tests). Each request must get exactly its ``max_tokens`` (at most, when it
    stops at end of sequence)."""
    job = build_job(model_path, requests, settings, kv_budget_tokens, max_num_seqs, max_num_batched_tokens,
                    token_range, max_model_len)
    result = run_worker(WORKER if worker is None else worker, job, settings)
    return baseline_run(result, requests, job, settings)


def run_worker(worker: Path, job: dict[str, Any], settings: VllmSettings) -> dict[str, Any]:
    """Run a peer script (``worker JOB.json RESULT.json``) under the peer's Python with vLLM's thread binding;
    returns the result it wrote. ``RuntimeError`` with the end of its stderr if it fails or writes nothing."""
    with tempfile.TemporaryDirectory(prefix="inflight-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        done = subprocess.run([settings.python, str(worker), str(job_path), str(result_path)], cwd=tmp,
                              env=worker_env(settings), capture_output=True, text=True)
        if done.returncode != 0 or not result_path.exists():
            tail = "\n".join((done.stderr or done.stdout).splitlines()[-STDERR_TAIL_LINES:])
            raise RuntimeError(f"vllm: the worker ({settings.python} {worker}) exited with {done.returncode}"
                               f"{'' if result_path.exists() else ' and wrote no result'}; its stderr ends:\n{tail}")
        return json.loads(result_path.read_text())


def baseline_run(result: dict[str, Any], requests: Sequence[BenchRequest], job: dict[str, Any],
                 settings: VllmSettings) -> BaselineRun:
    """The worker's result as a ``BaselineRun``, once every request is checked to have its ``max_tokens``."""
    from benchmarks.common.engine_run import check_output_lens

    if len(result["num_tokens"]) != len(requests) or len(result["done_s"]) != len(requests):
        raise RuntimeError(f"vllm: the worker reported {len(result['num_tokens'])} requests, not {len(requests)}")
    check_output_lens(result["num_tokens"], requests, "vllm")
    done_s = [float(t) for t in result["done_s"]]
    extra = {"vllm_version": result.get("vllm_version"), **asdict(settings), "block_size": job["block_size"],
             "num_gpu_blocks_override": job["num_gpu_blocks_override"],
             "kv_cache_memory_bytes": job["kv_cache_memory_bytes"], "max_num_seqs": job["max_num_seqs"],
             "max_num_batched_tokens": job["max_num_batched_tokens"], "max_model_len": job["max_model_len"],
             "num_gpu_blocks": result.get("num_gpu_blocks"), "kv_cache_size_tokens": result.get("kv_cache_size_tokens"),
             "env": result.get("env", {})}
    return BaselineRun("vllm", max(done_s), done_s, None, extra, [int(n) for n in result["num_tokens"]])


def describe_settings(extra: Mapping[str, Any]) -> str:
    """One line for the report: what vLLM ran with."""
    blocks = extra.get("num_gpu_blocks") or extra["num_gpu_blocks_override"]
    logged = extra.get("kv_cache_size_tokens")
    return (f"vllm {extra.get('vllm_version')}: dtype {extra['dtype']}, "
            f"VLLM_CPU_OMP_THREADS_BIND={extra['threads_bind']}, "
            f"torch.compile {'off (eager)' if extra['enforce_eager'] else 'on'}, KV {blocks} blocks of "
            f"{extra['block_size']} ({(blocks - 1) * extra['block_size']} tokens usable, one block held back"
            f"{'' if logged is None else f'; vLLM logs {logged:,} tokens'}), max_num_seqs {extra['max_num_seqs']}, "
            f"max_num_batched_tokens {extra['max_num_batched_tokens']}, max_model_len {extra['max_model_len']}")
