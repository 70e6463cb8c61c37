"""Offline throughput and latency: our engine (continuous and static batching) against transformers.

What is measured: the "seed" workload (default 64 requests, prompts of 50-800 random tokens, each
asking for its own 20-200 output tokens, greedy, eos ignored) is submitted all at once at t=0 to
each system in turn, on the CPU, in one process:

* ``continuous``: our ``LLMEngine`` with ``batching="continuous"``;
* ``static``:     our ``LLMEngine`` with ``batching="static"`` (a batch runs to its longest member);
* ``hf-static``:  transformers' ``model.generate``, left padding, batches of 8 in arrival order,
                  ``max_new_tokens`` = the longest request of the batch;
* ``hf-cb``:      transformers' continuous batching manager (``model.init_continuous_batching``),
                  one ``add_request`` per request with its own ``max_new_tokens``.

Every system gets the same KV budget, 8 x 1,000 = 8,000 tokens (ours: 500 blocks of 16; hf-cb:
500 pages of 16; hf-static: 8 sequences of at most 800 + 200). Each system is warmed up with a
couple of tiny requests before its timed run.

Reported per system: useful output tokens/s (the sum of each request's own requested output
length, divided by the wall time from submission to the last completion: tokens a static batch
computes past a member's end are not counted), and mean/p50/p90 end-to-end latency, where a
request's latency runs from t=0 (everyone arrives then) to its completion. Then the ratios of
tokens/s against their targets.

    python -m benchmarks.engine_vs_hf [--num-requests 64] [--systems continuous,static,hf-static,hf-cb]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from benchmarks.workloads import (
    BLOCK_SIZE, PAD_ID, BenchRequest, add_common_args,
    build_checkpoint, describe_workload, format_table, kv_blocks, load_average, make_engine, sampling_params,
    seed_workload, summarize, warmup_workload, write_json,
)

SYSTEMS = ("continuous", "static", "hf-static", "hf-cb")
# (numerator, denominator, target): tokens/s of the numerator must be >= target x the denominator's.
TARGETS = (
    ("continuous", "static", 2.0),
    ("continuous", "hf-static", 2.5),
    ("continuous", "hf-cb", 3.0),
    ("static", "hf-static", 0.8),
)


@dataclass
class SystemResult:
    system: str
    wall_s: float
    useful_tokens: int
    latencies_s: list[float]  # per request, in workload order
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"system": self.system, "tokens_per_s": self.tokens_per_s, "wall_s": self.wall_s,
                "useful_tokens": self.useful_tokens, "latency_s": summarize(self.latencies_s), **self.extra}


# -- our engine ---------------------------------------------------------------------------------------
def run_ours(model_path: str, requests: Sequence[BenchRequest], batching: str, args) -> SystemResult:
    engine = make_engine(model_path, batching, args)
    steps_before = engine.num_steps
    finished: dict[str, Any] = {}
    t0 = time.time()
    for i, request in enumerate(requests):
        engine.add_request(str(i), request.prompt_token_ids, sampling_params(request.max_tokens), arrival_time=t0)
    with tqdm(total=len(requests), desc=batching, unit="req", file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
    wall = time.time() - t0
    outputs = [finished[str(i)] for i in range(len(requests))]
    _check_lengths(batching, requests, [len(o.outputs[0].token_ids) for o in outputs])
    stats = engine.stats()
    return SystemResult(batching, wall, sum(r.max_tokens for r in requests),
                        [o.metrics.finished_time - t0 for o in outputs],
                        {"num_steps": engine.num_steps - steps_before, "num_preemptions": stats["num_preemptions"]})


# -- transformers, static batches -----------------------------------------------------------------------
def load_hf_model(model_path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_generate_batch(model, batch: Sequence[BenchRequest]) -> list[int]:
    """One left-padded static batch, greedy, eos disabled, run to the longest member; returns output lengths."""
    import transformers

    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len:] = 1
    max_new = max(r.max_tokens for r in batch)
    config = transformers.GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                           eos_token_id=None, pad_token_id=PAD_ID)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return [out.shape[1] - width] * len(batch)


def run_hf_static(model_path: str, requests: Sequence[BenchRequest], args) -> SystemResult:
    model = load_hf_model(model_path)
    hf_generate_batch(model, warmup_workload())
    batches = [requests[i:i + args.static_batch_size] for i in range(0, len(requests), args.static_batch_size)]
    latencies: list[float] = []
    computed = 0
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="hf-static", unit="batch", file=sys.stderr, leave=False):
        lengths = hf_generate_batch(model, batch)
        done = time.perf_counter() - t0
        latencies.extend([done] * len(batch))
        computed += sum(lengths)
        if any(n < r.max_tokens for n, r in zip(lengths, batch)):
            raise RuntimeError("hf-static: a request got fewer tokens than it asked for")
    wall = time.perf_counter() - t0
    return SystemResult("hf-static", wall, sum(r.max_tokens for r in requests), latencies,
                        {"batch_size": args.static_batch_size, "computed_output_tokens": computed})


# -- transformers, continuous batching --------------------------------------------------------------------
def hf_cb_config(args):
    """The same budget as ours: 500 pages of 16 tokens, the same tokens per step and slots."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=kv_blocks(args), max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,  # random prompts share no prefix: prefix hashing would only cost time
        seed=args.seed,
    )


def _hf_cb_submit_and_wait(manager, requests: Sequence[BenchRequest], t0: float,
                           bar: Callable[[], None] | None = None) -> dict[str, Any]:
    ids = [manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                               eos_token_id=-1) for i, r in enumerate(requests)]
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("hf-cb: the generation thread stopped before every request finished")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
            results[result.request_id] = (result, time.perf_counter() - t0)
            if bar:
                bar()
    return {rid: results[rid] for rid in ids}


def run_hf_cb(model_path: str, requests: Sequence[BenchRequest], args) -> SystemResult:
    import transformers

    model = load_hf_model(model_path)
    generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID,
                                                      max_new_tokens=max(r.max_tokens for r in requests))
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=hf_cb_config(args))
    manager.warmup()
    manager.start()
    try:
        _hf_cb_submit_and_wait(manager, warmup_workload(), time.perf_counter())
        resolved = manager.continuous_batching_config
        with tqdm(total=len(requests), desc="hf-cb", unit="req", file=sys.stderr, leave=False) as bar:
            t0 = time.perf_counter()
            results = _hf_cb_submit_and_wait(manager, requests, t0, lambda: bar.update(1))
            wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        manager.destroy()
    outputs = list(results.values())
    _check_lengths("hf-cb", requests, [len(result.generated_tokens) for result, _ in outputs])
    # lifespan[1] is perf_counter() when the request finished inside the generation thread.
    latencies = [(result.lifespan[1] - t0) if result.lifespan[1] > 0 else received for result, received in outputs]
    return SystemResult("hf-cb", wall, sum(r.max_tokens for r in requests), latencies,
                        {"attn_implementation": model.config._attn_implementation,
                         "num_blocks": resolved.num_blocks, "page_size": resolved.page_size,
                         "max_batch_tokens": resolved.max_batch_tokens,
                         "max_requests_per_batch": resolved.max_requests_per_batch})


def _check_lengths(system: str, requests: Sequence[BenchRequest], lengths: Sequence[int]) -> None:
    wrong = [(i, n, r.max_tokens) for i, (n, r) in enumerate(zip(lengths, requests)) if n != r.max_tokens]
    if wrong:
        i, got, wanted = wrong[0]
        raise RuntimeError(f"{system}: {len(wrong)} request(s) got the wrong number of tokens "
                           f"(request {i}: {got}, asked for {wanted})")


# -- report ---------------------------------------------------------------------------------------------
def ratios(results: dict[str, SystemResult]) -> list[dict[str, Any]]:
    rows = []
    for num, den, target in TARGETS:
        if num in results and den in results:
            value = results[num].tokens_per_s / results[den].tokens_per_s
            rows.append({"ratio": f"{num}/{den}", "value": value, "target": target, "met": value >= target})
    return rows


def print_report(results: dict[str, SystemResult], ratio_rows: list[dict[str, Any]], workload: dict,
                 loads: tuple[float | None, float | None], args) -> None:
    print(f"\nseed workload: {workload['num_requests']} requests, {workload['prompt_tokens']} prompt tokens, "
          f"{workload['output_tokens']} useful output tokens; KV budget {args.kv_budget_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}; load average {_load(loads[0])} at start, "
          f"{_load(loads[1])} at end")
    rows = []
    for name, r in results.items():
        lat = summarize(r.latencies_s)
        rows.append([name, r.tokens_per_s, lat["mean"], lat["p50"], lat["p90"], r.wall_s])
    print(format_table(["system", "tok/s", "lat mean s", "lat p50 s", "lat p90 s", "wall s"], rows))
    if ratio_rows:
        print()
        print(format_table(["ratio (tok/s)", "value", "target", "result"],
                           [[r["ratio"], r["value"], f">= {r['target']}", "met" if r["met"] else "MISSED"]
                            for r in ratio_rows]))


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def quiet_transformers() -> None:
    """transformers' warnings are noise here; so is the CB manager's psutil notice (CPU memory sizing only
    matters when num_blocks is not given, and we give it)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").addFilter(lambda record: "psutil" not in record.getMessage())


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_vs_hf",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    model_path = str(build_checkpoint(args.cache_dir))
    requests = seed_workload(args.num_requests, args.seed, args.prompt_lens, args.output_lens)
    workload = describe_workload(requests)
    runners = {
        "continuous": lambda: run_ours(model_path, requests, "continuous", args),
        "static": lambda: run_ours(model_path, requests, "static", args),
        "hf-static": lambda: run_hf_static(model_path, requests, args),
        "hf-cb": lambda: run_hf_cb(model_path, requests, args),
    }
    results: dict[str, SystemResult] = {}
    load_start = load_average()
    for system in args.systems:
        print(f"running {system} ...", file=sys.stderr, flush=True)
        results[system] = runners[system]()
        print(f"{system}: {results[system].tokens_per_s:.1f} tok/s in {results[system].wall_s:.1f} s",
              file=sys.stderr, flush=True)
    ratio_rows = ratios(results)
    loads = (load_start, load_average())
    print_report(results, ratio_rows, workload, loads, args)
    write_json(args.json, {
        "benchmark": "engine_vs_hf",
        "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model_path,
                   "kv_budget_tokens": args.kv_budget_tokens, "static_batch_size": args.static_batch_size,
                   "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "load_average_start": loads[0], "load_average_end": loads[1]},
        "workload": workload,
        "results": {name: r.summary() for name, r in results.items()},
        "latencies_s": {name: r.latencies_s for name, r in results.items()},
        "ratios": ratio_rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
