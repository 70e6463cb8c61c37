"""Perplexity of the model kept quantized against the same file dequantized, on a fixed text: this repository's own
README and docs, tokenized with the model's tokenizer, in windows of ``--window`` tokens scored whole
(``prompt_logprobs``; each window's first token has no prediction).

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.offline.perplexity --dtype bfloat16
    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.offline.perplexity --model PATH.gguf --windows 8

Issue 48's target: the quantized model's perplexity within 1% of the dequantized model's.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import write_json

ROOT = Path(__file__).resolve().parents[2]


def corpus_text(root: Path = ROOT) -> str:
    """README.md then docs/*.md in name order: text that changes only with the repository."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return "\n\n".join(path.read_text() for path in files)


def windows(token_ids: list[int], size: int, count: int) -> list[list[int]]:
    """The first ``count`` whole windows of ``size`` tokens."""
    if size < 2 or count < 1:
        raise ValueError("window: at least 2 tokens, windows: at least 1")
    found = [token_ids[i:i + size] for i in range(0, len(token_ids) - size + 1, size)][:count]
    if len(found) < count:
        raise ValueError(f"windows: the text holds {len(found)} windows of {size} tokens, asked for {count}")
    return found


def perplexity(llm, prompts: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of every predicted token of ``prompts``."""
    from inflight.engine import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(max_tokens=0, prompt_logprobs=0))
    total, count = 0.0, 0
    for ids, output in zip(prompts, outputs):
        for token, logprobs in zip(ids[1:], output.prompt_logprobs[1:]):
            total -= logprobs[token].logprob
            count += 1
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from inflight.engine import LLM

    model = model_from_args(parser, args)
    results = {}
    prompts = None
    for quantization in ("none", "auto"):
        llm = LLM(model.engine_model, quantization=quantization, dtype=args.dtype, device="cpu",
                  num_threads=args.threads, max_model_len=max(2048, args.window))
        if prompts is None:
            prompts = windows(llm.tokenizer.encode(corpus_text()), args.window, args.windows)
        results[quantization] = perplexity(llm, prompts)
        print(f"quantization={quantization}: perplexity {results[quantization]:.4f}")
        del llm
    ratio = results["auto"] / results["none"]
    print(f"kept quantized / dequantized: x{ratio:.4f} ({args.windows} windows of {args.window} tokens, {args.dtype})")
    if args.json:
        write_json(args.json, {"model": model.served_name, "dtype": args.dtype, "window": args.window,
                               "windows": args.windows, "perplexity": results, "ratio": ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
