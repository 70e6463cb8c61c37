"""One prompt at a time: how long a lone prompt's prefill takes (its first token), ours against vLLM's CPU build.

A serving system's first token at one stream is this time plus its path (HTTP, hops); ``benchmarks.peers.serve_vs_vllm``
measures the sum, this measures the engine's part alone, so the two can be told apart. Each system runs the
benchmark checkpoint with the offline benchmark's sizes (8,000 tokens of KV, 64 slots, 2,048 tokens per step),
``--threads`` compute threads (one by default, as the serving comparison gives each engine), and times
``LLM.generate`` of one random prompt with ``max_tokens`` 1, ``--repeats`` prompts of each length in
``--lens`` after two warm-up prompts of that length; reported is the median. Ours runs in this process, pinned
to ``--cpus``; vLLM in a worker process under its own virtualenv (``benchmarks/peers/vllm_one_prompt.py``, its
compute bound to the same CPUs through ``VLLM_CPU_OMP_THREADS_BIND``). With ``--rounds`` above 1 the systems
alternate (ours, vLLM, ours, ...): this machine's speed drifts by 10-15% within minutes, and only
neighbouring runs compare.

    python -m benchmarks.offline.one_prompt --baselines vllm --rounds 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common.engine import engine_args
from benchmarks.common.flags import positive_int
from benchmarks.common.report import print_table, write_json
from benchmarks.common.workloads import MODEL_SHAPE, build_checkpoint
from benchmarks.peers.vllm_baseline import VllmSettings, add_vllm_args, build_job, resolve_peer_python, run_worker
from inflight.engine.cpu_list import parse_cpu_list

WORKER = Path(__file__).resolve().parents[1] / "peers" / "vllm_one_prompt.py"
WARMUP_PROMPTS = 2
DEFAULT_LENS = (50, 200, 425, 800)


def prompts_by_length(lens: Sequence[int], repeats: int, seed: int = 0) -> dict[int, list[list[int]]]:
    """``WARMUP_PROMPTS + repeats`` random prompts of each length (token ids of the benchmark vocabulary past its
    special tokens), the same for every system."""
    rng = random.Random(seed)
    vocab = MODEL_SHAPE["vocab_size"]
    return {n: [[rng.randrange(10, vocab) for _ in range(n)] for _ in range(WARMUP_PROMPTS + repeats)] for n in lens}


def median_ms(times_s: Sequence[float]) -> float:
    """The median of the timed prompts, the warm-up ones left out."""
    return 1000 * statistics.median(times_s[WARMUP_PROMPTS:])


def run_ours(model_path: str, prompts: dict[int, list[list[int]]], threads: int) -> dict[int, float]:
    from inflight.engine import LLM, SamplingParams

    llm = LLM(model_path, **engine_args("continuous", threads=threads))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    result = {}
    for n, group in prompts.items():
        times = []
        for prompt in group:
            started = time.perf_counter()
            llm.generate([prompt], params)
            times.append(time.perf_counter() - started)
        result[n] = median_ms(times)
    return result


def run_vllm(model_path: str, prompts: dict[int, list[list[int]]], settings: VllmSettings,
             worker: Path = WORKER) -> dict[int, float]:
    """The same prompts through vLLM's ``LLM`` in a fresh worker process (``worker``: another script taking the
    same job, for tests)."""
    ours = engine_args("continuous")  # vLLM gets our sizes, taken from the same place
    job = build_job(model_path, [], settings, ours["num_kv_blocks"] * ours["block_size"], ours["max_num_seqs"],
                    ours["max_num_batched_tokens"])
    job["prompts_by_length"] = {str(n): group for n, group in prompts.items()}
    times = run_worker(worker, job, settings)["times_s"]
    return {n: median_ms(times[str(n)]) for n in prompts}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline.one_prompt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", type=positive_int, nargs="+", default=list(DEFAULT_LENS), metavar="TOKENS",
                        help="prompt lengths (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed prompts of each length")
    parser.add_argument("--threads", type=positive_int, default=1, help="compute threads of each engine")
    parser.add_argument("--cpus", default=None, metavar="LIST",
                        help="CPUs both engines compute on, as 0-1 or 0,2 (default: the first --threads CPUs)")
    parser.add_argument("--baselines", choices=["none", "vllm"], default="none", help="vllm: also run vLLM's CPU build")
    parser.add_argument("--rounds", type=positive_int, default=1, help="runs of each system, alternating")
    parser.add_argument("--json", metavar="PATH", help="write every run's medians here")
    add_vllm_args(parser)
    args = parser.parse_args(argv)
    max_len = MODEL_SHAPE["max_position_embeddings"] - 1
    if max(args.lens) > max_len:
        parser.error(f"--lens: at most {max_len} tokens (the checkpoint's context), got {max(args.lens)}")
    try:
        args.cpu_set = parse_cpu_list(args.cpus) if args.cpus else set(range(args.threads))
    except ValueError:
        parser.error(f"--cpus: {args.cpus!r} is not a CPU list like 0-1 or 0,2")
    if len(args.cpu_set) < args.threads:
        parser.error(f"--cpus: {len(args.cpu_set)} CPUs for {args.threads} threads")
    if not args.cpu_set <= os.sched_getaffinity(0):
        parser.error(f"--cpus: this process may run on CPUs {sorted(os.sched_getaffinity(0))} only")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = str(build_checkpoint())
    prompts = prompts_by_length(args.lens, args.repeats)
    settings = None
    if args.baselines == "vllm":
        try:
            python = resolve_peer_python(args.vllm_python)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        bind = args.vllm_threads_bind or ",".join(str(c) for c in sorted(args.cpu_set)[:args.threads])
        settings = VllmSettings(python, args.vllm_dtype or "float32", bind, args.vllm_eager)
    systems = ["ours"] + (["vllm"] if settings else [])
    runs: list[dict[str, Any]] = []
    affinity = os.sched_getaffinity(0)
    for round_ in range(args.rounds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:
            print(f"round {round_} {system} ...", flush=True)
            if system == "ours":
                os.sched_setaffinity(0, args.cpu_set)
                try:
                    medians = run_ours(model_path, prompts, args.threads)
                finally:
                    os.sched_setaffinity(0, affinity)
            else:
                medians = run_vllm(model_path, prompts, settings)
            runs.append({"system": system, "round": round_, "median_ms": medians})
    rows = [[r["system"], r["round"], *(f"{r['median_ms'][n]:.2f}" for n in args.lens)] for r in runs]
    print_table("one prompt alone, median ms to its first token (LLM.generate, max_tokens 1)",
                ["system", "round", *(f"{n} tokens" for n in args.lens)], rows)
    if settings:
        ours = {n: statistics.mean(r["median_ms"][n] for r in runs if r["system"] == "ours") for n in args.lens}
        theirs = {n: statistics.mean(r["median_ms"][n] for r in runs if r["system"] == "vllm") for n in args.lens}
        print("ours / vllm (means of the rounds): "
              + ", ".join(f"{n} tokens {ours[n] / theirs[n]:.2f}" for n in args.lens))
    if args.json:
        write_json(args.json, {"benchmark": "one_prompt", "lens": args.lens, "repeats": args.repeats,
                               "threads": args.threads, "cpus": sorted(args.cpu_set), "runs": runs,
                               "vllm_threads_bind": settings.threads_bind if settings else None})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
