"""Shared pieces of the benchmarks: the benchmark checkpoint, the seed workload, arrival traces, reporting.

* ``build_checkpoint`` writes a random-weight ``LlamaForCausalLM`` (hidden 256, 4 layers, 8 heads,
  4 KV heads, intermediate 688, vocab 4096, 2048 positions, fp32) with transformers, plus a
  4096-entry word-level tokenizer, into a cache directory (built once, then reused).
* ``seed_workload`` is the "seed" workload: random prompts of 50-800 tokens asking for 20-200
  output tokens each, reproducible from a seed.
* ``poisson_arrivals`` turns a rate into a seeded Poisson arrival trace.
* ``engine_args`` is the KV budget every system gets: 8 x 1,000 = 8,000 tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

# -- the model ------------------------------------------------------------------------------------
MODEL_NAME = "bench-llama-h256-l4-v4096"
VOCAB_SIZE = 4096
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]
FIRST_WORD_ID = len(SPECIAL_TOKENS)  # prompts draw from [FIRST_WORD_ID, VOCAB_SIZE)

MODEL_SHAPE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)

# -- the KV budget: 8 sequences of 1,000 tokens ---------------------------------------------------
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 500  # 500 x 16 = 8,000 tokens
KV_BUDGET_TOKENS = BLOCK_SIZE * NUM_KV_BLOCKS

# -- the seed workload ----------------------------------------------------------------------------
PROMPT_LEN_RANGE = (50, 800)
OUTPUT_LEN_RANGE = (20, 200)


def default_cache_dir() -> Path:
    root = os.environ.get("INFLIGHT_BENCH_CACHE") or Path.home() / ".cache" / "inflight" / "benchmarks"
    return Path(root)


def build_checkpoint(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the benchmark checkpoint directory, writing it first if it is not there yet."""
    path = Path(cache_dir or default_cache_dir()) / f"{MODEL_NAME}-seed{seed}"
    if (path / ".complete").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        _write_checkpoint(tmp, seed)
        (tmp / ".complete").write_text("ok\n")
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)  # atomic: a half-written checkpoint is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_checkpoint(path: Path, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**MODEL_SHAPE)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "unk_token": "<|unk|>"}))


def build_tokenizer():
    """A word-level tokenizer with exactly VOCAB_SIZE entries: the specials, then ``w4`` ... ``w4095``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tokenizer


# -- workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def seed_workload(num_requests: int, seed: int = 0, prompt_len_range: Sequence[int] = PROMPT_LEN_RANGE,
                  output_len_range: Sequence[int] = OUTPUT_LEN_RANGE) -> list[BenchRequest]:
    """``num_requests`` random prompts; lengths uniform in the (inclusive) ranges; the same for a given seed."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len_range[0], prompt_len_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_requests)
    return [BenchRequest(rng.integers(FIRST_WORD_ID, VOCAB_SIZE, size=int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def warmup_workload() -> list[BenchRequest]:
    """A couple of tiny requests to run before timing (first-call allocations, lazy imports)."""
    return [BenchRequest(list(range(FIRST_WORD_ID, FIRST_WORD_ID + 24)), 4),
            BenchRequest(list(range(FIRST_WORD_ID + 100, FIRST_WORD_ID + 140)), 6)]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds (first at 0) with exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def describe_workload(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    prompts = [r.prompt_len for r in requests]
    outputs = [r.max_tokens for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": int(sum(prompts)), "output_tokens": int(sum(outputs)),
            "mean_prompt_len": float(np.mean(prompts)) if prompts else 0.0,
            "mean_output_len": float(np.mean(outputs)) if outputs else 0.0}


# -- our engine -----------------------------------------------------------------------------------
def engine_args(batching: str, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                threads: int | None = None, num_kv_blocks: int = NUM_KV_BLOCKS) -> dict[str, Any]:
    """Engine arguments for the benchmark: CPU, fp32, by default the 8,000-token KV budget."""
    return dict(device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, batching=batching,
                num_threads=threads)


def make_engine(model_path: str, batching: str, args):
    """Our engine in one batching mode, warmed up. Static batching has fixed slots (``--static-batch-size``,
    8 x 1,000 tokens of KV: the same batch of 8 as transformers' static run); continuous has the same KV."""
    from engine import LLMEngine

    max_num_seqs = args.static_batch_size if batching == "static" else args.max_num_seqs
    engine = LLMEngine(model_path, **engine_args(batching, max_num_seqs, args.max_num_batched_tokens, args.threads,
                                                 kv_blocks(args)))
    warm_up_engine(engine)
    return engine


def kv_blocks(args) -> int:
    return args.kv_budget_tokens // BLOCK_SIZE


def sampling_params(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(engine) -> list:
    """Step ``engine`` until it is idle; return the finished outputs."""
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    return finished


def warm_up_engine(engine) -> None:
    for i, request in enumerate(warmup_workload()):
        engine.add_request(f"warmup-{i}", request.prompt_token_ids, sampling_params(request.max_tokens))
    drain(engine)


# -- reporting ------------------------------------------------------------------------------------
def summarize(values: Iterable[float], percentiles: Sequence[int] = (50, 90)) -> dict[str, float]:
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in percentiles}}
    return {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in percentiles}}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], num_left: int = 1) -> str:
    """A plain fixed-width table: the first ``num_left`` columns left-aligned, the rest right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.ljust(w) if i < num_left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return "\n".join([line([str(h) for h in headers]), line(["-" * w for w in widths]), *map(line, cells)])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def load_average() -> float | None:
    """The 1-minute load average: other work on the machine skews CPU timings, so the reports show it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, BenchRequest):
        return asdict(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def add_common_args(parser, num_requests: int = 64) -> None:
    """Flags both benchmarks share."""
    parser.add_argument("--num-requests", type=int, default=num_requests, help="requests in the seed workload")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the workload and arrival trace (the model weights always use seed 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--prompt-lens", type=int, nargs=2, metavar=("MIN", "MAX"), default=list(PROMPT_LEN_RANGE),
                        help="prompt length range, inclusive")
    parser.add_argument("--output-lens", type=int, nargs=2, metavar=("MIN", "MAX"), default=list(OUTPUT_LEN_RANGE),
                        help="output length range, inclusive")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="batch slots (ours; hf-cb's max_requests_per_batch)")
    parser.add_argument("--kv-budget-tokens", type=int, default=KV_BUDGET_TOKENS,
                        help="KV cache size in tokens for every engine (the acceptance run uses 8 x 1,000)")
    parser.add_argument("--static-batch-size", type=int, default=8,
                        help="batch slots of static batching (ours and transformers'): 8 slots x 1,000 tokens of KV")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (ours and hf-cb)")
    parser.add_argument("--cache-dir", help="where the benchmark checkpoint is built; None: "
                                            "$INFLIGHT_BENCH_CACHE or ~/.cache/inflight/benchmarks")
