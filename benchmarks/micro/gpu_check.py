"""The GPU check: kernel correctness, attention bandwidth, end-to-end decode against the memory roofline,
transformers in the same run, and the seed workload static vs continuous. Run by ``benchmarks/micro/gpu_check.sh``.

Every section is timed, guarded and reported on its own, so one failure still leaves the others'
numbers; the summary table is printed last and written to ``--json``. Without CUDA it stops at once.

Model: Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim 128, MLP 14336,
vocab 128256) with random bf16 weights (``load_format="dummy"``), so no download is needed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.common.engine import build_engine, drain
from benchmarks.common.report import write_json

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)


# -- helpers -----------------------------------------------------------------------------------------
def cuda_time_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn`` on the GPU, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy: bytes read + bytes written per second (the ceiling a read-bound kernel aims at)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * num_bytes / (ms / 1e3)


def write_model_dir(root: Path, num_layers: int) -> Path:
    """config.json for the Llama-3-8B shape and a word-level tokenizer covering its whole vocabulary."""
    from tokenizers import Tokenizer, models

    path = root / f"llama3-8b-shape-l{num_layers}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": num_layers}))
    vocab = {f"w{i}": i for i in range(LLAMA3_8B["vocab_size"])}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0")).save(str(path / "tokenizer.json"))
    return path


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, 32000, size=(num, length)).tolist()


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# -- 1. kernel correctness ---------------------------------------------------------------------------------
def check_kernels(args) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", "-x"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.kernel_test_timeout)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], file=sys.stderr)
    return {"passed": proc.returncode == 0, "summary": tail}


# -- 2. decode attention bandwidth ------------------------------------------------------------------------
def attention_bandwidth(args, copy_bw: float) -> dict[str, Any]:
    from inflight.kernels import BatchLayout
    from inflight.kernels.torch_ref import TorchPagedAttention
    from inflight.kernels.triton_backend import TritonPagedAttention

    batch, context, head_dim, kv_heads, heads, bs = 64, 2048, 128, 8, 32, 16
    blocks_per_row = context // bs
    num_blocks = batch * blocks_per_row
    order = torch.randperm(num_blocks, device="cuda")  # scattered blocks, as in a long-running server
    tables = order.view(batch, blocks_per_row)
    result: dict[str, Any] = {"batch": batch, "context": context, "head_dim": head_dim, "kv_heads": kv_heads}
    triton_backend = TritonPagedAttention()
    tuned = triton_backend.tune_decode(heads, kv_heads, head_dim, bs, torch.bfloat16)
    result["triton_config"] = str(tuned)
    for backend in (triton_backend, TorchPagedAttention()):
        shape = backend.kv_cache_shape(num_blocks + 1, bs, kv_heads, head_dim)
        k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        layout = BatchLayout(query_lens=[1] * batch, seq_lens=[context] * batch, block_tables=tables,
                             slot_mapping=tables[:, -1] * bs + bs - 1, block_size=bs)
        meta = backend.prepare(layout)
        query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        ms = cuda_time_ms(lambda: backend.forward(query, None, None, k_cache, v_cache, meta, head_dim ** -0.5))
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        result[backend.name] = {"ms": ms, "kv_bytes_per_s": kv_bytes / (ms / 1e3),
                                "fraction_of_copy": kv_bytes / (ms / 1e3) / copy_bw}
        del k_cache, v_cache
        free_cuda()
    return result


# -- 3. end-to-end decode ------------------------------------------------------------------------------
class StepGaps:
    """CUDA events around each step's device work, on the runner: the GPU's idle time between the end of one
    step (its ``ready`` event: tokens sampled and on their way to the host) and the start of the next one's
    forward (graph replay or eager model). What lies between is host work the GPU waits for: with the
    synchronous loop, the tokens' way back, output processing, scheduling and input preparation; with async
    scheduling, only what the host could not do while the GPU ran the step before."""

    def __init__(self, runner) -> None:
        from inflight.engine.model_runner import recorded_event

        self.gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (a step's end, the next one's start)
        self._last_end: torch.cuda.Event | None = None
        launch = runner.launch
        forward = runner.graphs.run if runner.graphs is not None else runner.model.forward

        def timed_forward(*a, **k):
            if self._last_end is not None:
                self.gaps.append((self._last_end, recorded_event()))
            return forward(*a, **k)

        def timed_launch(*a, **k):
            step = launch(*a, **k)
            self._last_end = step.ready
            return step

        runner.launch = timed_launch  # both run on the thread that computes steps, in step order
        if runner.graphs is not None:
            runner.graphs.run = timed_forward
        else:
            runner.model.forward = timed_forward

    def reset(self) -> None:
        self.gaps = []

    def median_us(self) -> float | None:
        torch.cuda.synchronize()
        gaps = [end.elapsed_time(start) * 1e3 for end, start in list(self.gaps)]
        return float(np.median(gaps)) if gaps else None


def engine_decode(model_dir: Path, batch: int, prompt_len: int, timed_steps: int, args,
                  enforce_eager: bool = False, async_scheduling: bool | None = None,
                  quantization: str = "auto") -> dict[str, Any]:
    """Tokens/s of pure decode steps with ``batch`` requests running, after all prompts are in, and the GPU's
    idle gap between two steps (``StepGaps``). ``async_scheduling`` None is the engine's default (on, on CUDA);
    ``quantization="fp8"``: the layers' weights in float8 e4m3 (``kernels.triton_fp8``)."""
    from inflight.engine import SamplingParams

    engine = build_engine(str(model_dir), load_format="dummy", dtype=args.dtype, max_num_seqs=max(batch, 8),
                          enforce_eager=enforce_eager, async_scheduling=async_scheduling,
                          max_num_batched_tokens=max(8192, batch), attention_backend=args.attention_backend,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=prompt_len + 512,
                          quantization=quantization)
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    # Long enough that nobody finishes before the timed steps end (the first rows decode while others prefill).
    params = SamplingParams(max_tokens=timed_steps + prefill_steps + 16, temperature=0.0, ignore_eos=True)
    try:
        for i, prompt in enumerate(random_prompts(batch, prompt_len, seed=batch)):
            engine.add_request(f"r{i}", prompt, params)
        started = set()
        while len(started) < batch:  # prefill everything (and compile every kernel)
            started.update(o.request_id for o in engine.step())
        for _ in range(3):
            engine.step()
        gaps = StepGaps(engine.runner)
        engine.step()
        torch.cuda.synchronize()
        gaps.reset()
        t0 = time.perf_counter()
        for _ in range(timed_steps):
            outputs = engine.step()
            assert len(outputs) == batch, "a request left the batch during the timed decode"
        seconds = time.perf_counter() - t0
        info = {"backend": engine.runner.backend.name, "block_size": engine.config.block_size,
                "quantization": quantization,
                "async_scheduling": engine.async_scheduling, "gpu_gap_us": gaps.median_us(),
                "kv_blocks": engine.runner.num_kv_blocks, "cuda_graphs": engine.runner.graphs is not None,
                "decode_config": str(getattr(engine.runner.backend, "_decode_config", lambda *a: None)(
                    4, 128, engine.config.block_size, torch.bfloat16))}
        graphs = engine.runner.graphs
        if graphs is not None:  # the GPU's share of a step: the captured forward alone (no lm_head, sampling, host)
            size = next(s for s in graphs.sizes if s >= batch)
            info["graph_replay_ms"] = cuda_time_ms(graphs.graphs[size].replay, repeats=10)
    finally:
        del engine
        free_cuda()
    step_ms = seconds / timed_steps * 1e3
    return {"batch": batch, "step_ms": step_ms, "tokens_per_s": batch * timed_steps / seconds, **info}


def roofline(batch: int, context: float, num_layers: int, read_bw: float, itemsize: int = 2) -> dict[str, float]:
    cfg = LLAMA3_8B
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (h + 2 * kv_dim) + h * h + 3 * h * inter  # qkv, o, gate/up/down
    weight_bytes = itemsize * (num_layers * per_layer + 2 * vocab * h)  # + embedding row reads (tiny) and lm_head
    kv_bytes = itemsize * batch * context * num_layers * 2 * kv_dim
    step_s = (weight_bytes + kv_bytes) / read_bw
    return {"weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes, "roofline_step_ms": step_s * 1e3,
            "roofline_tokens_per_s": batch / step_s}


# -- 4. transformers on the same workload ----------------------------------------------------------------
def same_workload_ours(model_dir: Path, prompts, new_tokens: int, args) -> float:
    engine = build_engine(str(model_dir), load_format="dummy", dtype=args.dtype, max_num_seqs=len(prompts),
                          max_num_batched_tokens=8192, attention_backend=args.attention_backend,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048)
    outputs, seconds = timed_greedy_run(engine, prompts, new_tokens)
    produced = sum(map(len, outputs))
    assert produced == len(prompts) * new_tokens, produced
    del engine
    free_cuda()
    return len(prompts) * new_tokens / seconds


def timed_greedy_run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """After one short warm-up request, all ``prompts`` at once, greedy, ``new_tokens`` each: every request's tokens
    (in order) and the seconds from submission to the last one."""
    from inflight.engine import SamplingParams

    engine.add_request("warm", prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    drain(engine)
    torch.cuda.synchronize()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[int(output.request_id[1:])] = output.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    return [tokens[i] for i in range(len(prompts))], seconds


def hf_model(model_dir: Path, dtype: str = "bfloat16"):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


@torch.inference_mode()
def hf_generate(model, prompts, new_tokens: int) -> float:
    import transformers

    ids = torch.tensor(prompts, device="cuda")
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    model.generate(input_ids=ids[:2, :16], attention_mask=torch.ones_like(ids[:2, :16]),
                   generation_config=transformers.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens / seconds


def hf_continuous_batching(model, prompts, new_tokens: int, deadline_s: float = 90.0) -> float:
    """Through transformers' continuous-batching manager, with a deadline: if it is too slow to finish,
    the rate over the requests that did finish is reported (and says so).

    Not under inference_mode: the manager's generation thread updates tensors it made outside it."""
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        manager.add_request(prompts[0][:16], request_id="warm", max_new_tokens=2)
        while (result := manager.get_result(timeout=60)) is not None and result.request_id != "warm":
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new_tokens)
        produced, finished = 0, 0
        while finished < len(prompts) and time.perf_counter() - t0 < deadline_s:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                produced += len(result.generated_tokens)
                finished += 1
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=False)
    if finished < len(prompts):
        print(f"transformers continuous batching: only {finished}/{len(prompts)} requests in {deadline_s} s",
              file=sys.stderr)
    if produced == 0:
        raise RuntimeError("transformers' continuous batching finished no request")
    return produced / seconds


# -- 5. the seed workload, static vs continuous -------------------------------------------------------------
def seed_workload_run(model_dir: Path, batching: str, args, async_scheduling: bool | None = None) -> dict[str, Any]:
    """The seed workload (all at t=0): useful tok/s, mean latency, and each request's greedy tokens."""
    from benchmarks.common.workloads import seed_workload
    from inflight.engine import SamplingParams

    requests = seed_workload(args.seed_requests, seed=0)
    engine = build_engine(str(model_dir), load_format="dummy", dtype=args.dtype, batching=batching, block_size=16,
                          async_scheduling=async_scheduling,
                          num_kv_blocks=500, max_num_seqs=8 if batching == "static" else 64,
                          max_num_batched_tokens=2048, attention_backend=args.attention_backend, max_model_len=1024)
    engine.add_request("warm", requests[0].prompt_token_ids, SamplingParams(max_tokens=4, temperature=0.0))
    drain(engine)
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                       ignore_eos=True))
    latencies, tokens = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                latencies.append(time.perf_counter() - t0)
                tokens[o.request_id] = o.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    info = {"async_scheduling": engine.async_scheduling, "preemptions": engine.stats().get("num_preemptions")}
    del engine
    free_cuda()
    useful = sum(r.max_tokens for r in requests)
    return {"tokens_per_s": useful / seconds, "mean_latency_s": float(np.mean(latencies)), "seconds": seconds,
            **info, "_tokens": [tokens[f"r{i}"] for i in range(len(requests))]}


def speculative_runs(model_dir: Path, args, num_requests: int = 4, prompt_len: int = 512,
                     new_tokens: int = 128) -> dict[str, Any]:
    """Speculative decoding at concurrency 1 (issue 18): the same greedy requests one at a time without
    speculation, with the oracle (the plain run's outputs: the mechanism's ceiling) and with n-gram lookup.
    Tokens per second and the acceptance of each; every run must emit the plain run's tokens."""
    prompts = random_prompts(num_requests, prompt_len, seed=2)
    out: dict[str, Any] = {}
    plain: list[list[int]] | None = None
    for method in ("none", "oracle", "ngram"):
        spec = None if method == "none" else {"method": method}
        if method == "oracle":
            spec["oracle_outputs"] = {tuple(p): tuple(o) for p, o in zip(prompts, plain)}
        engine = build_engine(str(model_dir), load_format="dummy", dtype=args.dtype, max_num_seqs=1,
                              max_num_batched_tokens=2048, attention_backend=args.attention_backend,
                              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048,
                              speculative_config=spec)
        outputs, seconds = timed_greedy_run(engine, prompts, new_tokens)
        stats = engine.stats()
        out[method] = {"tokens_per_s": num_requests * new_tokens / seconds,
                       "same_tokens_as_plain": plain is None or outputs == plain,
                       "acceptance_rate": stats.get("spec_acceptance_rate"),
                       "proposed": stats.get("spec_num_proposed_tokens")}
        plain = plain or outputs
        del engine
        free_cuda()
    return out


# -- driver ------------------------------------------------------------------------------------------
def gpu_profile(model_dir: Path, args) -> dict[str, Any]:
    """What a step costs on this GPU by its shape (``inflight profile --quick``: serve_app/sim/profile.py), for
    sizing a fleet with ``inflight simulate``; the JSON ``inflight profile --from-gpu-check`` takes."""
    from inflight.serve_app.sim.profile import measure

    try:
        return measure(str(model_dir), dict(load_format="dummy", dtype=args.dtype, max_num_seqs=256,
                                            max_num_batched_tokens=8192, max_model_len=4096,
                                            attention_backend=args.attention_backend,
                                            gpu_memory_utilization=args.gpu_memory_utilization), quick=True).to_json()
    finally:
        free_cuda()


def run_section(results: dict, name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    if t0 > results["_deadline"]:
        results[name] = {"error": "skipped: the check's time budget (--budget-s) is spent"}
        return
    print(f"== {name} ...", file=sys.stderr, flush=True)
    try:
        results[name] = fn()
    except Exception as error:  # a section's failure is a result too; the others still run
        traceback.print_exc()
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
    shown = {k: v for k, v in results[name].items() if not k.startswith("_")} if isinstance(results[name], dict) \
        else results[name]
    print(f"== {name}: {shown} ({results['section_seconds'][name]} s)", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few layers and small batches: a smoke run")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "flash_attn", "triton", "torch"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the model's dtype in every engine section. float32 makes token comparisons (speculative, "
                             "the seed workload's two loops) exact: in bfloat16 a random-weight model's near-tied logits "
                             "follow each kernel's rounding")
    parser.add_argument("--kernel-test-timeout", type=int, default=200)
    parser.add_argument("--sections", default="kernels,bandwidth,decode,speculative,transformers,seed,profile",
                        help="comma-separated subset of kernels,bandwidth,decode,speculative,transformers,seed,"
                             "profile")
    parser.add_argument("--seed-requests", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="sections that would start after this many seconds are skipped (the script must "
                             "finish in 8 minutes)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; this check needs a GPU (see docs/benchmarks.md)",
              file=sys.stderr)
        return 2
    sections = set(args.sections.split(","))
    num_layers = 4 if args.quick else LLAMA3_8B["num_hidden_layers"]
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "quick": args.quick, "dtype": args.dtype,
        "num_layers": num_layers, "date": time.strftime("%Y-%m-%d"),
        "_deadline": time.perf_counter() + args.budget_s,
    }
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    copy_bw = copy_bandwidth()
    # The ceiling for weights + KV read per step: the copy's rate counting reads and writes, which a
    # read-only stream matches or beats on HBM; using it makes the roofline a slightly generous target.
    read_bw = copy_bw
    results["copy_bytes_per_s"] = copy_bw
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="inflight-gpu-")), num_layers)

    if "kernels" in sections:
        run_section(results, "kernels", lambda: check_kernels(args))
    if "bandwidth" in sections:
        run_section(results, "bandwidth", lambda: attention_bandwidth(args, copy_bw))
    if "decode" in sections:
        prompt_len, steps = 512, (8 if args.quick else 32)
        batches = (1, 8) if args.quick else (1, 64, 256)
        # the largest batch once more with the synchronous loop: what async scheduling hides of the host's work;
        # then FP8 weights (quantization="fp8", issue 48) at one row and 64
        runs = [*((b, None, "auto") for b in batches), (batches[-1], False, "auto"),
                *((b, None, "fp8") for b in ((1,) if args.quick else (1, 64)))]
        for batch, loop, quantization in runs:
            def decode(batch=batch, loop=loop, quantization=quantization):
                try:
                    measured = engine_decode(model_dir, batch, prompt_len, steps, args, async_scheduling=loop,
                                             quantization=quantization)
                except Exception as error:  # keep a number: fall back to eager steps, and say why
                    traceback.print_exc()
                    free_cuda()
                    measured = engine_decode(model_dir, batch, prompt_len, steps, args, enforce_eager=True,
                                             async_scheduling=loop, quantization=quantization)
                    measured["graphs_error"] = f"{type(error).__name__}: {error}"
                bound = roofline(batch, prompt_len + 3 + steps / 2, num_layers, read_bw,  # mean context while timed
                                 getattr(torch, args.dtype).itemsize)
                return {**measured, **bound, "fraction_of_roofline": measured["tokens_per_s"] / bound["roofline_tokens_per_s"]}
            run_section(results, f"decode_b{batch}" + ("_sync" if loop is False else "") +
                        ("_fp8" if quantization == "fp8" else ""), decode)
    if "speculative" in sections:
        run_section(results, "speculative", lambda: speculative_runs(model_dir, args, new_tokens=32 if args.quick
                                                                       else 128))
    if "seed" in sections:
        seed_runs = (("static", "static", None), ("continuous", "continuous", None),
                     ("continuous_sync", "continuous", False))
        for name, batching, loop in seed_runs:
            run_section(results, f"seed_{name}",
                        lambda batching=batching, loop=loop: seed_workload_run(model_dir, batching, args, loop))
        # each run's greedy tokens, out of the results: the two loops (async and synchronous) and static batching,
        # request by request
        static, cont, cont_sync = (results.get(f"seed_{name}", {}).pop("_tokens", None) for name, _, _ in seed_runs)
        if static and cont and cont_sync:
            results["seed_same_tokens"] = {
                "async_vs_sync": sum(a == b for a, b in zip(cont, cont_sync)),
                "continuous_vs_static": sum(a == b for a, b in zip(cont, static)), "requests": len(static)}
    if "profile" in sections:  # `inflight profile --quick` of this model here: `inflight profile --from-gpu-check`
        run_section(results, "profile", lambda: gpu_profile(model_dir, args))
    if "transformers" in sections:  # last: the slowest and least predictable
        num, new = (8, 16) if args.quick else (64, 64)
        prompts = random_prompts(num, 512, seed=1)
        run_section(results, "same_workload_ours", lambda: same_workload_ours(model_dir, prompts, new, args))

        def hf():
            model = hf_model(model_dir, args.dtype)
            out = {}
            for name, fn in (("generate", hf_generate), ("continuous_batching", hf_continuous_batching)):
                try:
                    out[name] = fn(model, prompts, new)
                except Exception as error:
                    traceback.print_exc()
                    out[name] = f"{type(error).__name__}: {error}"
            del model
            free_cuda()
            return out
        run_section(results, "transformers", hf)

    results.pop("_deadline")
    print_summary(results)
    if args.json:
        write_json(args.json, results)
    return 0


def print_summary(results: dict[str, Any]) -> None:  # noqa: C901 (one row per measurement)
    def num(value, scale=1.0, fmt="{:,.1f}"):
        return fmt.format(value / scale) if isinstance(value, (int, float)) else str(value)

    rows = [("device", results["device"]), ("torch / triton", f"{results['torch']} / {results['triton']}"),
            ("layers, dtype", f"{results['num_layers']}, {results.get('dtype', 'bfloat16')}"), ("copy bandwidth (GB/s, read+write)", num(results["copy_bytes_per_s"], 1e9))]
    kernels = results.get("kernels")
    if kernels:
        rows.append(("kernel tests", kernels.get("summary", kernels)))
    bw = results.get("bandwidth", {})
    for name in ("triton", "torch"):
        if isinstance(bw.get(name), dict):
            rows.append((f"decode attention {name} (GB/s of KV, % of copy)",
                         f"{num(bw[name]['kv_bytes_per_s'], 1e9)} ({bw[name]['fraction_of_copy']:.0%})"))
    for key in sorted(k for k in results if k.startswith("decode_b")):
        r = results[key]
        if "error" in r:
            rows.append((key, r["error"]))
        else:
            loop = "async" if r.get("async_scheduling") else "sync"
            fp8 = ", fp8 weights" if r.get("quantization") == "fp8" else ""
            rows.append((f"decode batch {r['batch']} ({r['backend']}, {loop}{fp8}): tok/s, step ms, forward ms, "
                         "% roofline, GPU gap us",
                         f"{num(r['tokens_per_s'])}, {r['step_ms']:.2f}, {num(r.get('graph_replay_ms'), fmt='{:.2f}')}, "
                         f"{r['fraction_of_roofline']:.0%}, {num(r.get('gpu_gap_us'), fmt='{:.0f}')}"))
    ours, hf = results.get("same_workload_ours"), results.get("transformers")
    if ours is not None:
        rows.append(("same workload: ours tok/s", num(ours)))
    if isinstance(hf, dict):
        for name, value in hf.items():
            ratio = f" (ours x{ours / value:.2f})" if isinstance(value, float) and value > 0 and isinstance(ours, float) else ""
            rows.append((f"same workload: transformers {name} tok/s", num(value) + ratio))
    static, cont = results.get("seed_static"), results.get("seed_continuous")
    for name, r in (("static", static), ("continuous", cont), ("continuous, sync loop", results.get("seed_continuous_sync"))):
        if isinstance(r, dict) and "error" not in r:
            rows.append((f"seed {name}: tok/s, mean latency s", f"{num(r['tokens_per_s'])}, {r['mean_latency_s']:.2f}"))
        elif r is not None:
            rows.append((f"seed {name}", r))
    if all(isinstance(r, dict) and "error" not in r for r in (static, cont)) and static and cont:
        rows.append(("seed continuous/static: throughput x, latency x",
                     f"{cont['tokens_per_s'] / static['tokens_per_s']:.2f}, "
                     f"{cont['mean_latency_s'] / static['mean_latency_s']:.2f}"))
    same = results.get("seed_same_tokens")
    if same:
        rows.append(("seed greedy tokens equal: async vs sync loop, continuous vs static (requests)",
                     f"{same['async_vs_sync']}/{same['requests']}, {same['continuous_vs_static']}/{same['requests']}"))
    spec = results.get("speculative")
    if isinstance(spec, dict) and "error" not in spec:
        base = spec["none"]["tokens_per_s"]
        for method, r in spec.items():
            rate = r["acceptance_rate"]
            rows.append((f"speculative {method}, concurrency 1: tok/s (x none), acceptance, same tokens",
                         f"{num(r['tokens_per_s'])} (x{r['tokens_per_s'] / base:.2f}), "
                         f"{'-' if rate is None else f'{rate:.0%}'}, {r['same_tokens_as_plain']}"))
    elif spec is not None:
        rows.append(("speculative", spec))
    width = max(len(str(k)) for k, _ in rows)
    print("\n" + "\n".join(f"{str(k):<{width}}  {v}" for k, v in rows))


if __name__ == "__main__":
    sys.exit(main())
