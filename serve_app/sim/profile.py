"""A machine's profile for the simulator: what an engine step costs there (``cost_model.py``), the engine's facts
(KV blocks, block size, context), and the serving path's own costs, in one JSON file.

Three sources:
  * ``measure``: the real engine on this machine runs a planned set of batches (decode at growing batch sizes and
    contexts, prompts of growing lengths, chunked ones) and every step's shape and wall time are recorded, then
    fitted. ``LLMEngine.step`` is timed whole (scheduling, forward, sampling, the front end's text), so the host's
    work is in the figures as the engine's loop pays it.
  * ``measure_serving``: a running server (``inflight serve``, ``make run``) is asked single requests to find the
    serving path's fixed cost per request (HTTP, tokenizing, the router's hop), its cost per streamed token, and
    the cores its processes take from the engines (``serving_costs.py``).
  * ``from_gpu_check``: a ``benchmarks/micro/gpu_check.sh`` result (no GPU needed to read one): its decode steps at
    1, 64 and 256 rows and its prompt-heavy run.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from inflight.serve_app.sim.cost_model import StepCostModel, decode_curve, fit, step_features
from inflight.serve_app.sim.serving_costs import ServingCosts
from inflight.serve_app.sim.trace import synthetic_tokens

PROFILE_FORMAT = 1
# the engine's facts a simulation needs, recorded from the profiled engine
ENGINE_FACTS = ("num_kv_blocks", "block_size", "max_model_len", "kv_bytes_per_block", "kv_window", "device", "dtype",
                "attention_backend", "async_scheduling", "num_threads", "quantization", "tensor_parallel_size",
                "vocab_size")


@dataclass
class Profile:
    model: str
    engine_args: dict[str, Any]  # what the profiled engine was given
    engine: dict[str, Any]  # ENGINE_FACTS, as that engine had them
    cost_model: StepCostModel
    serving: ServingCosts = field(default_factory=ServingCosts)
    machine: dict[str, Any] = field(default_factory=dict)
    source: str = "measured"
    notes: list[str] = field(default_factory=list)
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "model": self.model, "source": self.source, "created": self.created,
                "machine": self.machine, "engine_args": self.engine_args, "engine": self.engine,
                "cost_model": self.cost_model.to_json(), "serving": asdict(self.serving), "notes": self.notes}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, flag: str = "--profile") -> "Profile":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{flag}: no such file: {path}")
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path}: not JSON ({e.msg})") from None
        return cls.from_json(record, f"{flag} {path}")

    @classmethod
    def from_json(cls, record: Any, where: str) -> "Profile":
        """A profile from its JSON (``to_json``'s); ``ValueError`` starting with ``where`` otherwise."""
        if not isinstance(record, dict) or record.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{where}: not an inflight profile (format {PROFILE_FORMAT}); "
                             "write one with `inflight profile MODEL --out FILE`")
        try:
            engine = record["engine"]
            missing = [name for name in ENGINE_FACTS if name not in engine]
            if missing:
                raise ValueError(f"its engine facts lack {missing}")
            serving = record.get("serving") or {}
            return cls(model=str(record["model"]), engine_args=dict(record.get("engine_args") or {}), engine=engine,
                       cost_model=StepCostModel.from_json(record["cost_model"]),
                       serving=ServingCosts(float(serving.get("request_s", 0.0)), float(serving.get("message_s", 0.0)),
                                            float(serving.get("serving_cores", 0.0))),
                       machine=dict(record.get("machine") or {}), source=str(record.get("source", "")),
                       notes=list(record.get("notes") or []), created=str(record.get("created", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def describe(self) -> str:
        facts = self.engine
        where = self.machine.get("gpu") or self.machine.get("cpu") or "?"
        return (f"{self.model} on {where} ({facts['device']}, {facts['dtype']}), {self.source}"
                + (f", {self.created}" if self.created else ""))


def describe_machine() -> dict[str, Any]:
    import torch

    machine = {"cpu": _cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "python": sys.version.split()[0], "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    try:
        from importlib.metadata import version

        machine["inflight"] = version("inflight")
    except Exception:  # a checkout that was never installed
        machine["inflight"] = "checkout"
    return machine


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- measuring this machine ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """One planned run: prompts of these lengths at once, each with its ``max_tokens``."""

    prompt_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]

    @classmethod
    def alike(cls, prompt_len: int, num_requests: int, max_tokens: int) -> "Batch":
        return cls((prompt_len,) * num_requests, (max_tokens,) * num_requests)


def decode_sizes(max_num_seqs: int, quick: bool = False) -> list[int]:
    """The decode batch sizes a profile measures (1, 2, 4, ... and ``max_num_seqs``): the decode curve's knots."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 4 if quick else 2
    return sizes + [max_num_seqs]


def plan(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, kv_tokens: int,
         quick: bool = False) -> list[Batch]:
    """The batches a profile runs, none needing more KV than there is (nothing is preempted while measured):
    decodes at 1, 2, 4, ... rows up to ``max_num_seqs`` over a short context and the longest the KV holds for
    them (the decode terms), and
    decodes that end one a step (each step's batch formed anew, as under traffic); 1, 4 and 16 prompts of 32
    tokens to a few chunks (the prompt terms); and a burst of prompts of mixed lengths, whose chunks share steps
    with decodes as traffic's do."""
    sizes = decode_sizes(max_num_seqs, quick)
    decode_tokens = 6 if quick else 16
    long_context = max(64, min(1024, max_model_len // 2))
    batches = [Batch.alike(16, n, decode_tokens) for n in sizes]
    for n in sizes:  # each batch size again with as long a context as the KV holds for all of its rows (to 1024)
        context = min(long_context, kv_tokens // n - decode_tokens - 16)
        if context >= 64:
            batches.append(Batch.alike(context, n, decode_tokens))
    batches += [Batch((64,) * n, tuple(range(2, n + 2))) for n in sizes[1::2] if n * (64 + n + 2) <= kv_tokens]
    longest = min(max_model_len - 2, 4 * max_num_batched_tokens, kv_tokens - 2)
    prompt_len = 32
    while prompt_len <= longest:
        batches += [Batch.alike(prompt_len, n, 2) for n in ((1, 4) if quick else (1, 4, 16))
                    if n <= max_num_seqs and n * (prompt_len + 2) <= kv_tokens]
        prompt_len *= 8 if quick else 4
    burst = max_num_seqs if not quick else min(8, max_num_seqs)
    top = max(32, min(1024, longest, kv_tokens // burst - 8))
    lengths = tuple(int(32 * (top / 32) ** (i / max(1, burst - 1))) for i in range(burst))
    batches.append(Batch(lengths, (8,) * burst))
    return batches


def measure(model: str, engine_args: dict[str, Any], quick: bool = False,
            progress: Callable[[Sequence[Batch]], Any] | None = None) -> Profile:
    """Profile ``model`` with ``engine_args`` on this machine (``progress``: wraps the planned batches, e.g. tqdm)."""
    from inflight.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, **engine_args)
    try:
        config, runner = engine.config, engine.runner
        kv_tokens = runner.num_kv_blocks * config.block_size
        batches = plan(config.max_num_seqs, engine.max_model_len, config.max_num_batched_tokens, kv_tokens, quick)
        prompts = _PromptMaker(engine.model_config.vocab_size)
        _run(engine, Batch.alike(16, 2, 4), prompts)  # warm-up: first-call costs (allocation, compilation) are not steps
        features, seconds = [], []
        for batch in (progress(batches) if progress is not None else batches):
            for shape, duration in _run(engine, batch, prompts):
                features.append(shape)
                seconds.append(duration)
        costs = fit(features, seconds, decode_sizes(config.max_num_seqs, quick))
        facts = {"num_kv_blocks": runner.num_kv_blocks, "block_size": config.block_size,
                 "max_model_len": engine.max_model_len, "kv_bytes_per_block": runner.kv_bytes_per_block,
                 "kv_window": list(runner.kv_window) if runner.kv_window else None,
                 "device": runner.device.type, "dtype": str(runner.dtype).removeprefix("torch."),
                 "attention_backend": runner.backend.name, "async_scheduling": engine.async_scheduling,
                 "num_threads": config.num_threads, "quantization": config.quantization,
                 "tensor_parallel_size": config.tensor_parallel_size, "vocab_size": engine.model_config.vocab_size}
    finally:
        engine.close()
    return Profile(model, dict(engine_args), facts, costs, machine=describe_machine(),
                   source=f"measured: {len(batches)} batches, {len(seconds)} steps" + (" (quick)" if quick else ""),
                   created=_now())


class _PromptMaker:
    """Distinct prompts of ordinary tokens, so no profiled prompt hits the prefix cache."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.count = 0

    def __call__(self, length: int) -> list[int]:
        self.count += 1
        return synthetic_tokens(f"profile:{self.count}", length, self.vocab_size)


def _run(engine, batch: Batch, prompts: _PromptMaker) -> list[tuple[tuple, float]]:
    """Run one batch to the end; each step's shape (``step_features``) and wall time. With async scheduling a
    step's call returns when the device has finished the step launched before it, so that step's shape goes with
    the time."""
    from inflight.engine.sampling_params import SamplingParams

    records: list = []
    engine.step_listener = records.append
    for prompt_len, max_tokens in zip(batch.prompt_lens, batch.max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"profile-{prompts.count}", prompts(prompt_len), params)
    durations, kept = [], []  # per call: its time, and whether the step it applied came from the persistent batch
    try:
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            durations.append(time.perf_counter() - started)
            kept.append(engine.scheduler.kept.last_update_kept)
    finally:
        engine.step_listener = None
    skip = 1 if engine.async_scheduling else 0  # async: call k collects step k-1
    steps = []
    for record, seconds, from_kept in zip(records, durations[skip:], kept[skip:]):
        shape = step_features(record.batch.query_lens, record.batch.start_positions, record.batch.sample,
                              not from_kept)
        if shape[1] or shape[4]:  # no tokens: not a step
            steps.append((shape, seconds))
    return steps


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- a GPU check's results --------------------------------------------------------------------------------------
def from_gpu_check(path: str | Path, flag: str = "--from-gpu-check") -> Profile:
    """A profile from ``benchmarks/micro/gpu_check.sh``'s JSON: the profile its ``profile`` section measured (checks
    since 2026-12-07), else one derived from its other sections: the decode steps (1, 64, 256 rows, prompts of
    512, async scheduling) give the fixed cost of a step (their line's, at no rows) and the decode curve's points;
    the prompt-heavy run (64 prompts of 512 tokens, 64 tokens each, ``same_workload_ours``) less those decode steps
    gives the cost of a prompt token. The context terms are not separable there (every decode point is at ~530
    tokens of context): they are folded into the decode curve and said so in the profile's notes."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e})") from None
    if isinstance(results, dict) and isinstance(results.get("profile"), dict) and "cost_model" in results["profile"]:
        measured = Profile.from_json(results["profile"], f"{flag} {path}, its profile section")
        measured.source = f"gpu_check {path.name}: {measured.source}"
        return measured
    points = [(value["batch"], value["step_ms"] / 1e3) for key, value in results.items()
              if isinstance(value, dict) and key.startswith("decode_b") and key.count("_") == 1
              and "step_ms" in value and value.get("quantization", "auto") == "auto"]
    if len(points) < 2 or "same_workload_ours" not in results:
        raise ValueError(f"{flag} {path}: needs decode steps at two batch sizes and same_workload_ours "
                         "(a full gpu_check run, not --quick)")
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points))
    step_s = max(0.0, mean_t - slope * mean_b)  # a prompt step's fixed cost: the decode line's, at no rows
    decode_rows_s = {b: max(0.0, t - step_s) for b, t in sorted(points)}  # each measured step, as measured
    # same_workload_ours: 64 prompts of 512 at once, 64 tokens each (max_num_batched_tokens 8192: 4 prompt steps)
    prompts, prompt_len, new_tokens, chunk = 64, 512, 64, 8192
    total_s = prompts * new_tokens / float(results["same_workload_ours"])
    decode_s = (new_tokens - 1) * (step_s + decode_curve(prompts, list(decode_rows_s), list(decode_rows_s.values())))
    prompt_steps = math.ceil(prompts * prompt_len / chunk)
    token_s = max(0.0, (total_s - decode_s - prompt_steps * step_s) / (prompts * prompt_len))
    costs = StepCostModel({"step_s": step_s, "prefill_token_s": token_s, "prefill_row_s": 0.0, "prefill_pair_s": 0.0,
                           "decode_context_s": 0.0, "sampled_row_s": 0.0, "rebuilt_row_s": 0.0},
                          decode_rows_s=decode_rows_s)
    first = results.get("decode_b1", {})
    facts = {"num_kv_blocks": int(min(v.get("kv_blocks", 0) for k, v in results.items()
                                      if isinstance(v, dict) and k.startswith("decode_b") and v.get("kv_blocks"))),
             "block_size": int(first.get("block_size", 16)), "max_model_len": 8192,
             # the check's Llama-3-8B shape: K and V of 8 KV heads of 128 per layer, bf16
             "kv_bytes_per_block": int(first.get("block_size", 16)) * results.get("num_layers", 32) * 2 * 8 * 128 * 2,
             "kv_window": None, "device": "cuda", "dtype": "bfloat16", "attention_backend": first.get("backend", "?"),
             "async_scheduling": bool(first.get("async_scheduling", True)), "num_threads": None,
             "quantization": "auto", "tensor_parallel_size": 1, "vocab_size": 128256}
    notes = [f"derived from {path.name}: decode steps at {sorted(b for b, _ in points)} rows (context ~530), "
             f"prompt tokens from same_workload_ours ({results['same_workload_ours']:.0f} tok/s)",
             "decode_context_s and prefill_pair_s are not separable in a GPU check: folded into the decode curve and "
             "the per-token cost (accurate near 512-token contexts, optimistic far beyond)"]
    return Profile(f"Llama-3-8B shape, random bf16 weights ({results.get('num_layers', 32)} layers)",
                   {"load_format": "dummy", "dtype": "bfloat16"}, facts, costs,
                   machine={"gpu": results.get("device", "?"), "torch": results.get("torch"),
                            "triton": results.get("triton"), "date": results.get("date")},
                   source=f"gpu_check {path.name}", notes=notes, created=str(results.get("date", "")))
