"""Where a step's time goes: one prefill step and one decode step of the real model, per kind of work, per dtype.

Each kind is timed where it is called (wall clock around the call, summed over the step):

* ``linears``: the decoder layers' projections (qkv, o, gate/up, down): oneDNN or our decode kernel;
* ``lm head``: the logits of the rows sampled;
* ``attention``: storing the step's K/V and attending (``backend.store_kv`` and ``backend.forward``);
* ``elementwise``: the embedding lookup, RMSNorm with its residual add, RoPE, SiLU-and-mul;
* ``layers, one call``: a bf16 decode step's decoder layers in one call of the CPU kernels
  (``engine.models.cpu_decode``: the kinds above, for those layers, in C++); the profile also runs that step
  layer by layer (``bfloat16, layer by layer``) to show what each kind costs there;
* ``python + scheduler``: the rest of ``LLMEngine.step``: scheduling, the batch's tensors, outputs, glue, and the
  greedy steps' argmax over the logits (microseconds).

The timers add a few microseconds per call (~300 calls a step), which land in the kinds they wrap. The systems run
alternately, ``--rounds`` times, and each kind's median over rounds is reported; ``--plot`` draws the shares.

    python -m benchmarks.micro.step_profile --dtypes float32,bfloat16 --plot docs/images/step_profile.png
    python -m benchmarks.micro.step_profile --dtypes bfloat16 --quantizations none,auto --decode-rows 1 --threads 1

``--quantizations``: a GGUF file dequantized (``none``, the default) and/or kept quantized (``auto``), each a system.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

from benchmarks.common.engine import build_engine, drain, engine_args
from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import pyplot, save_figure, write_json

KINDS = ["linears", "lm head", "attention", "elementwise", "layers, one call", "python + scheduler"]


class KindTimers:
    """Wall time per kind, summed over the calls since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.seconds.clear()

    def wrap(self, owner: Any, attr: str, kind: str) -> None:
        original: Callable = getattr(owner, attr)
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[kind] += time.perf_counter() - start

        setattr(owner, attr, timed)


def instrument(engine) -> KindTimers:
    """Wrap the engine's model, backend and sampler (this engine only: instance attributes, and the CPU kernels'
    module functions the model calls through ``ops``)."""
    from torch import nn

    from inflight.engine.models.quantized import QuantLinear
    from inflight.kernels import cpu_kernels

    timers = KindTimers()
    runner = engine.runner
    model = runner.model
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, (nn.Linear, QuantLinear)):
                timers.wrap(module, "forward", "linears")
        timers.wrap(layer.self_attn, "rope", "elementwise")
    timers.wrap(model.lm_head, "forward", "lm head")
    if hasattr(model.lm_head, "float32_forward"):  # (bf16 on the CPU kernels: float32 logits, cpu_packing.py)
        timers.wrap(model.lm_head, "float32_forward", "lm head")
    timers.wrap(model.model.embed_tokens, "forward", "elementwise")
    timers.wrap(runner.backend, "forward", "attention")
    timers.wrap(runner.backend, "store_kv", "attention")
    for name in ("rms_norm", "silu_and_mul"):
        timers.wrap(cpu_kernels, name, "elementwise")
    timers.wrap(cpu_kernels, "decode_layers", "layers, one call")
    return timers


def prompt(rng: random.Random, length: int, token_range: tuple[int, int]) -> list[int]:
    return [rng.randrange(*token_range) for _ in range(length)]


def profile_prefill(engine, timers: KindTimers, rng, length: int, token_range) -> dict[str, float]:
    """One step that prefills one fresh prompt of ``length`` tokens (random: no cached prefix) and samples once."""
    from inflight.engine import SamplingParams

    engine.add_request(f"prefill-{rng.random()}", {"prompt_token_ids": prompt(rng, length, token_range)},
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return timed_step(engine, timers)


def profile_decode(engine, timers: KindTimers, rng, rows: int, context: int, token_range, steps: int
                   ) -> list[dict[str, float]]:
    """``steps`` decode steps of ``rows`` requests, each with ``context`` tokens before it."""
    from inflight.engine import SamplingParams

    for i in range(rows):
        engine.add_request(f"decode-{i}-{rng.random()}", {"prompt_token_ids": prompt(rng, context, token_range)},
                           SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    while engine.stats()["num_waiting"] or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in engine.scheduler.running):
        engine.step()  # the prompts' prefill, untimed
    samples = [timed_step(engine, timers) for _ in range(steps)]
    drain(engine)
    return samples


def timed_step(engine, timers: KindTimers) -> dict[str, float]:
    timers.reset()
    start = time.perf_counter()
    engine.step()
    total = time.perf_counter() - start
    shares = {kind: timers.seconds.get(kind, 0.0) for kind in KINDS[:-1]}
    shares["python + scheduler"] = max(0.0, total - sum(shares.values()))
    shares["total"] = total
    return shares


def median_of(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--quantizations", default="none", help="comma-separated: none, auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-rows", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16")]
    if bad or not args.dtypes:
        parser.error(f"--dtypes: float32 and/or bfloat16, got {args.dtypes}")
    args.quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    if not args.quantizations or any(q not in ("none", "auto") for q in args.quantizations):
        parser.error(f"--quantizations: none and/or auto, got {args.quantizations}")
    args.bench_model = model_from_args(parser, args)
    return args


def run(args) -> dict[str, Any]:
    model = args.bench_model
    engines = {}
    for dtype in args.dtypes:
        for quantization in args.quantizations:
            engine = build_engine(model.engine_model, **engine_args("continuous", threads=args.threads, dtype=dtype,
                                                                    quantization=quantization))
            engines[dtype if quantization == "none" else f"{dtype}, kept quantized"] = (engine, instrument(engine))
    rng = random.Random(args.seed)
    prefill: dict[str, list] = defaultdict(list)
    decode: dict[str, list] = defaultdict(list)
    for dtype, (engine, timers) in engines.items():  # warm-up: first calls build oneDNN's primitives
        profile_prefill(engine, timers, rng, args.prefill_tokens, model.token_range)
        profile_decode(engine, timers, rng, args.decode_rows, args.decode_context, model.token_range, 2)
    for _ in range(args.rounds):
        for dtype, (engine, timers) in engines.items():
            prefill[dtype].append(profile_prefill(engine, timers, rng, args.prefill_tokens, model.token_range))
            decode[dtype].extend(profile_decode(engine, timers, rng, args.decode_rows, args.decode_context,
                                                model.token_range, 4))
            fused = engine.runner.model.fused_decode
            if fused is not None:  # the same step layer by layer, to see each kind's share
                engine.runner.model.fused_decode = None
                decode[f"{dtype}, layer by layer"].extend(profile_decode(
                    engine, timers, rng, args.decode_rows, args.decode_context, model.token_range, 4))
                engine.runner.model.fused_decode = fused
    return {"model": model.name, "threads": args.threads, "prefill_tokens": args.prefill_tokens,
            "decode_rows": args.decode_rows, "decode_context": args.decode_context, "rounds": args.rounds,
            "prefill": {d: median_of(s) for d, s in prefill.items()},
            "decode": {d: median_of(s) for d, s in decode.items()}}


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}, {result['threads']} threads; medians of {result['rounds']} rounds",
             "| step | dtype | total ms | " + " | ".join(KINDS) + " |",
             "|---|---|---|" + "---|" * len(KINDS)]
    for step, label in (("prefill", f"prefill {result['prefill_tokens']} tokens"),
                        ("decode", f"decode {result['decode_rows']} rows x {result['decode_context']} context")):
        for dtype, shares in result[step].items():
            total = shares["total"]
            cells = [f"{shares[k] * 1e3:.2f} ({shares[k] / total:.0%})" for k in KINDS]
            lines.append(f"| {label} | {dtype} | {total * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for ax, step in zip(axes, ("prefill", "decode")):
        labels = list(result[step])
        left = [0.0] * len(labels)
        for kind in KINDS:
            widths = [result[step][d][kind] * 1e3 for d in labels]
            ax.barh(labels, widths, left=left, label=kind)
            left = [a + b for a, b in zip(left, widths)]
        title = (f"prefill, {result['prefill_tokens']} tokens" if step == "prefill" else
                 f"decode, {result['decode_rows']} rows x {result['decode_context']} context")
        ax.set_title(title)
        ax.set_xlabel("ms per step")
    axes[1].legend(loc="upper center", bbox_to_anchor=(-0.1, -0.28), ncol=len(KINDS), fontsize=8)
    fig.suptitle(f"Where a step's time goes: {result['model']}, {result['threads']} threads", y=1.05)
    save_figure(fig, path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
