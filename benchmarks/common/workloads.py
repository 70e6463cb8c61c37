"""What the benchmarks run: the benchmark checkpoint and the named workloads (our engine: ``benchmarks.common.engine``).

* ``build_checkpoint`` writes a random-weight ``LlamaForCausalLM`` (hidden 256, 4 layers, 8 heads,
  4 KV heads, intermediate 688, vocab 4096, 2048 positions, fp32) with transformers, plus a
  4096-entry word-level tokenizer, into a cache directory (built once, then reused).
* ``WORKLOADS`` names the request mixes (``seed`` is the seed document's: prompts of 50-800 random token
  ids asking for 20-200 output tokens each, end of sequence ignored; ``prefill-only`` puts prompt-scoring and
  embedding requests, which generate nothing, among the seed's; ``chat`` is real text: conversations rendered
  through the model's chat template that stop at its end of turn); ``build_workload`` draws one, reproducibly
  from a seed, for a model (``benchmarks.common.models``: which token ids a prompt may hold, the chat template);
  ``trace_workload`` turns a JSONL trace (``benchmarks.common.arrivals``) into requests and arrival times.
* ``NUM_KV_BLOCKS`` x ``BLOCK_SIZE`` is the KV budget every system gets: 8 x 1,000 = 8,000 tokens.
* ``add_workload_args`` and ``add_sampling_args`` are the workload flags the benchmarks share;
  ``workload_from_args`` reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

from benchmarks.common.arrivals import TraceEntry, load_trace
from benchmarks.common.flags import positive_int

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
    return write_once(path, lambda tmp: _write_checkpoint(tmp, seed))


def write_once(path: Path, write: Callable[[Path], None]) -> Path:
    """``path``, a directory that ``write`` fills, written first if it is not there whole yet: into a temporary
    directory beside it, then renamed, so a half-written one is never picked up."""
    if (path / ".complete").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write(tmp)
        (tmp / ".complete").write_text("ok\n")
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
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
    _write_tokenizer(path)


def write_shape(path: Path, config: dict[str, Any]) -> Path:
    """A model directory with no weights: ``config`` (a Hugging Face config.json's keys; the vocabulary is this
    tokenizer's) and the benchmark tokenizer, for ``load_format="dummy"``: any architecture's shape, at any size,
    without transformers writing weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": 2,
                                                  "torch_dtype": "bfloat16", **config}))
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
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
RequestKind = Literal["generate", "score", "embed", "structured"]  # structured: generate under benchmarks.offline.structured.SCHEMA
PROMPT_LOGPROBS = 1  # what a scoring request asks for: each prompt token's logprob and the top alternative


@dataclass(frozen=True)
class BenchRequest:
    """``score`` and ``embed`` requests generate nothing (``max_tokens`` 0): prompt logprobs, or an embedding."""

    prompt_token_ids: list[int]
    max_tokens: int
    kind: RequestKind = "generate"
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    # True: exactly max_tokens tokens; False: the request may stop earlier, at the model's end of sequence
    ignore_eos: bool = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


TOY_TOKEN_RANGE = (FIRST_WORD_ID, VOCAB_SIZE)  # the benchmark checkpoint's ordinary tokens


def seed_workload(num_requests: int, seed: int = 0, prompt_len_range: Sequence[int] = PROMPT_LEN_RANGE,
                  output_len_range: Sequence[int] = OUTPUT_LEN_RANGE,
                  token_range: Sequence[int] = TOY_TOKEN_RANGE) -> list[BenchRequest]:
    """``num_requests`` prompts of token ids drawn uniformly from ``token_range`` ([low, high)); lengths uniform in
    the (inclusive) ranges; the same for a given seed. A model's range: ``benchmarks.common.models.BenchModel.token_range``."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len_range[0], prompt_len_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_requests)
    return [BenchRequest(rng.integers(token_range[0], token_range[1], size=int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def chat_workload(num_requests: int, model, seed: int = 0, prompt_len_range: Sequence[int] = PROMPT_LEN_RANGE,
                  output_len_range: Sequence[int] = OUTPUT_LEN_RANGE) -> list[BenchRequest]:
    """``num_requests`` one-turn conversations through ``model``'s chat template (``model``: a
    ``benchmarks.common.models.BenchModel``): a question (``benchmarks.common.chat_texts.QUESTIONS``) about a passage of this
    repository's documents, cut so that the rendered prompt has about a length drawn uniformly from
    ``prompt_len_range`` (tokens); ``max_tokens`` uniform in ``output_len_range``; each request stops at the model's
    end of turn (``ignore_eos`` False). The same for a given seed and model. ``ValueError`` for a model without a
    chat template."""
    from benchmarks.common.chat_texts import QUESTIONS, passages

    tokenizer = model.tokenizer
    if not tokenizer.chat_template:
        raise ValueError(f"--workload chat: model {model.name} has no chat template (the chat workload renders "
                         f"conversations through it); use --model {_default_model()} or another model with one")
    texts = passages()
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len_range[0], prompt_len_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_requests)
    questions = rng.integers(0, len(QUESTIONS), size=num_requests)
    starts = rng.integers(0, len(texts), size=num_requests)
    requests = []
    for target, output_len, question, start in zip(prompt_lens, output_lens, questions, starts):
        template = QUESTIONS[question]

        def render(passage: str) -> list[int]:
            messages = [{"role": "user", "content": template.format(passage=passage)}]
            return tokenizer.chat_prompt(messages)["prompt_token_ids"]

        budget = max(1, int(target) - len(render("")))  # the passage's share of the prompt, in tokens
        passage_ids: list[int] = []
        i = int(start)
        while len(passage_ids) < budget:  # consecutive paragraphs from the chosen one on, wrapping around
            passage_ids += tokenizer.encode(("\n\n" if passage_ids else "") + texts[i % len(texts)],
                                            add_special_tokens=False)
            i += 1
        passage = tokenizer.decode(passage_ids[:budget]).strip()
        requests.append(BenchRequest(render(passage), int(output_len), ignore_eos=False))
    return requests


def _default_model() -> str:
    from benchmarks.common.models import default_model

    return default_model()


@dataclass(frozen=True)
class WorkloadSpec:
    """Lengths uniform in the inclusive ranges, or outputs taken in turn from ``output_cycle``."""

    description: str
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int] | None
    output_cycle: tuple[int, ...] = ()
    # every other request generates nothing: scoring (prompt logprobs) and embedding in turn
    prefill_only_mix: bool = False
    # each prompt is extended by the checkpoint's own continuation of it (benchmarks.offline.speculative.copy_heavy)
    copy_heavy: bool = False
    # real text: conversations through the model's chat template, stopping at its end of turn (chat_workload)
    chat: bool = False


WORKLOADS = {
    "seed": WorkloadSpec("the seed document's mix: prompts 50-800 tokens, outputs 20-200", PROMPT_LEN_RANGE,
                         OUTPUT_LEN_RANGE),
    "longtail": WorkloadSpec("the seed's long tail: outputs of 10, 50, 100 and 200 tokens in turn, prompts 50-800",
                             PROMPT_LEN_RANGE, None, (10, 50, 100, 200)),
    "uniform": WorkloadSpec("similar lengths: prompts 300-500 tokens, outputs 90-110", (300, 500), (90, 110)),
    "fixed": WorkloadSpec("equal lengths, static batching's best case: prompts of 400 tokens, outputs of 100",
                          (400, 400), (100, 100)),
    "one-token": WorkloadSpec("one output token per prompt of 50-800 (the seed's pitfall 3: static can win)",
                              PROMPT_LEN_RANGE, (1, 1)),
    "prefill-only": WorkloadSpec("the seed's mix, every other request replaced by prompt scoring or an embedding "
                                 "(no output; the prefill lane vs mixed, see benchmarks.offline.prefill_only)",
                                 PROMPT_LEN_RANGE, OUTPUT_LEN_RANGE, prefill_only_mix=True),
    "copy": WorkloadSpec("copy-heavy: prompts of 50-300 tokens and then the checkpoint's own greedy continuation of "
                         "them (120 tokens, built at start), outputs 100-200 that go on repeating spans of the prompt "
                         "(speculative decoding's case, see benchmarks.offline.speculative)", (50, 300), (100, 200),
                         copy_heavy=True),
    "chat": WorkloadSpec("real text: a question about a passage of this repository's documents through the model's "
                         "chat template, prompts of about 50-800 tokens, outputs up to 20-200 tokens that stop at the "
                         "model's end of turn (needs a model with a chat template)", PROMPT_LEN_RANGE,
                         OUTPUT_LEN_RANGE, chat=True),
}


def build_workload(name: str, num_requests: int, seed: int = 0, prompt_lens: Sequence[int] | None = None,
                   output_lens: Sequence[int] | None = None, model=None) -> list[BenchRequest]:
    """``num_requests`` requests of the named workload; ``prompt_lens``/``output_lens`` (MIN, MAX) override its ranges.
    ``model`` (a ``benchmarks.common.models.BenchModel``): token-id prompts draw from its ordinary tokens, and the chat
    workload needs it; None: the benchmark checkpoint's tokens (no chat)."""
    if name not in WORKLOADS:
        raise ValueError(f"--workload: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[name]
    token_range = TOY_TOKEN_RANGE if model is None else model.token_range
    if spec.chat:
        if model is None:
            raise ValueError("--workload chat: needs a model with a chat template (--model)")
        return chat_workload(num_requests, model, seed, prompt_lens or spec.prompt_lens,
                             output_lens or spec.output_lens)
    if spec.output_cycle and output_lens is not None:
        raise ValueError(f"--output-lens: the {name} workload's outputs are fixed at {spec.output_cycle}")
    if spec.output_cycle:
        requests = seed_workload(num_requests, seed, prompt_lens or spec.prompt_lens, (1, 1), token_range)
        return [BenchRequest(r.prompt_token_ids, spec.output_cycle[i % len(spec.output_cycle)])
                for i, r in enumerate(requests)]
    requests = seed_workload(num_requests, seed, prompt_lens or spec.prompt_lens, output_lens or spec.output_lens,
                             token_range)
    if spec.prefill_only_mix:  # odd requests: score, embed, score, ...
        kinds = ("score", "embed")
        return [r if i % 2 == 0 else BenchRequest(r.prompt_token_ids, 0, kinds[(i // 2) % 2])
                for i, r in enumerate(requests)]
    return requests


def trace_workload(entries: Sequence[TraceEntry], seed: int = 0,
                   token_range: Sequence[int] = TOY_TOKEN_RANGE) -> tuple[list[BenchRequest], list[float]]:
    """Requests with random prompts (ids in ``token_range``) of the trace's lengths, and their arrival times."""
    rng = np.random.default_rng(seed)
    requests = [BenchRequest(rng.integers(token_range[0], token_range[1], size=e.prompt_tokens).tolist(),
                             e.output_tokens) for e in entries]
    return requests, [e.arrival_s for e in entries]


def warmup_workload(token_range: Sequence[int] = TOY_TOKEN_RANGE) -> list[BenchRequest]:
    """A couple of tiny requests to run before timing (first-call allocations, lazy imports); ``token_range``: the
    model's ordinary tokens."""
    return [BenchRequest(_token_ids(token_range, 0, 24), 4), BenchRequest(_token_ids(token_range, 100, 140), 6)]


def engine_warmup_workload(token_range: Sequence[int] = TOY_TOKEN_RANGE) -> list[BenchRequest]:
    """``warmup_workload`` and a request of each kind that generates nothing (a score, an embedding): our engine's
    warm-up."""
    return warmup_workload(token_range) + [BenchRequest(_token_ids(token_range, 200, 230), 0, "score"),
                                           BenchRequest(_token_ids(token_range, 300, 320), 0, "embed")]


def _token_ids(token_range: Sequence[int], start: int, stop: int) -> list[int]:
    """The ``start``-th to ``stop``-th ids of ``token_range``, wrapping around in a small vocabulary."""
    low, high = token_range
    return [low + i % (high - low) for i in range(start, stop)]


def describe_workload(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Lengths in tokens; ``output_tokens`` is what the requests ask for at most (exactly, but for those that stop
    at end of sequence: ``num_stop_at_eos``)."""
    prompts = [r.prompt_len for r in requests]
    outputs = [r.max_tokens for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": int(sum(prompts)), "output_tokens": int(sum(outputs)),
            "mean_prompt_len": float(np.mean(prompts)) if prompts else 0.0,
            "mean_output_len": float(np.mean(outputs)) if outputs else 0.0,
            "num_prefill_only": sum(r.kind != "generate" for r in requests),
            "num_stop_at_eos": sum(not r.ignore_eos for r in requests)}


def kv_blocks(args) -> int:
    return args.kv_budget_tokens // BLOCK_SIZE


def sampling_params(max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, ignore_eos: bool = True):
    from inflight.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos)


def request_params(request: BenchRequest):
    """What the engine is given for ``request``: greedy generation, prompt scoring, or an embedding."""
    from inflight.engine import PoolingParams, SamplingParams

    if request.kind == "score":
        return SamplingParams(max_tokens=0, prompt_logprobs=PROMPT_LOGPROBS)
    if request.kind == "embed":
        return PoolingParams()
    if request.kind == "structured":
        from benchmarks.offline.structured import SCHEMA
        from inflight.engine import StructuredOutput

        return sampling_params(request.max_tokens, request.temperature, request.top_p, request.ignore_eos).replace(
            structured_output=StructuredOutput("json", SCHEMA))
    return sampling_params(request.max_tokens, request.temperature, request.top_p, request.ignore_eos)


# -- flags ----------------------------------------------------------------------------------------
def add_workload_args(parser: argparse.ArgumentParser, num_requests: int = 64, default: str = "seed") -> None:
    """Which requests: a named workload (with optional length ranges) or a trace file."""
    names = ", ".join(f"{name} ({spec.description})" for name, spec in WORKLOADS.items())
    parser.add_argument("--workload", default=default, choices=list(WORKLOADS), metavar="NAME",
                        help=f"request mix, one of: {names}")
    parser.add_argument("--trace", metavar="FILE.jsonl",
                        help="replay a trace of {prompt_tokens, output_tokens, arrival_s} lines instead of --workload")
    parser.add_argument("--num-requests", type=positive_int, default=num_requests, help="requests in the workload")
    parser.add_argument("--prompt-lens", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                        help="prompt length range in tokens, inclusive (default: the workload's)")
    parser.add_argument("--output-lens", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                        help="output length range in tokens, inclusive (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the workload and arrival times (the model weights always use seed 0)")
    add_sampling_args(parser)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """How every request samples (greedy by default); ``check_sampling_args`` validates them."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request samples at this temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="and keeps this nucleus (default 1: all tokens)")


def check_sampling_args(parser: argparse.ArgumentParser, args) -> bool:
    """``add_sampling_args``' flags, or ``parser.error``; True when the requests sample rather than decode greedily."""
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    return args.temperature > 0 or args.top_p < 1


def workload_from_args(parser: argparse.ArgumentParser, args, model=None
                       ) -> tuple[list[BenchRequest], list[float] | None, str]:
    """(requests, arrival times or None for all at t=0, a name for reports) for ``model`` (a
    ``benchmarks.common.models.BenchModel``; None: the benchmark checkpoint); bad flags end in ``parser.error``."""
    for flag in ("prompt_lens", "output_lens"):
        value = getattr(args, flag)
        if value is not None and value[0] > value[1]:
            parser.error(f"--{flag.replace('_', '-')}: MIN ({value[0]}) is larger than MAX ({value[1]})")
    try:
        token_range = TOY_TOKEN_RANGE if model is None else model.token_range
        if args.trace:
            requests, arrivals = trace_workload(load_trace(args.trace), args.seed, token_range)
            name = f"trace {Path(args.trace).name}"
        else:
            requests = build_workload(args.workload, args.num_requests, args.seed, args.prompt_lens, args.output_lens,
                                      model)
            arrivals, name = None, args.workload
    except ValueError as e:
        parser.error(str(e))
    if check_sampling_args(parser, args):
        requests = [dataclasses.replace(r, temperature=args.temperature, top_p=args.top_p) for r in requests]
    longest = max(r.prompt_len + r.max_tokens for r in requests)
    positions = MODEL_SHAPE["max_position_embeddings"] if model is None else model.max_position_embeddings
    if longest > positions:
        parser.error(f"--prompt-lens/--output-lens: a request of {longest} tokens (prompt + output) does not fit the "
                     f"model's {positions} positions")
    if getattr(args, "kv_budget_tokens", None) is not None:
        if args.kv_budget_tokens % BLOCK_SIZE:
            parser.error(f"--kv-budget-tokens: {args.kv_budget_tokens} is not a multiple of the block size {BLOCK_SIZE}")
        if longest > args.kv_budget_tokens:
            parser.error(f"--kv-budget-tokens: {args.kv_budget_tokens} tokens cannot hold a request of {longest}")
    return requests, arrivals, name
