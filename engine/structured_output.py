"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar, with xgrammar (the backend vLLM and SGLang use; it runs on the CPU).

``StructuredOutput`` is the constraint as plain, hashable data (it travels inside ``SamplingParams``).
``GrammarCompiler`` turns one into xgrammar's compiled grammar for this model's tokenizer; it caches what it
compiled (bounded by ``CACHE_BYTES``), so a schema used again costs nothing, and a constraint that does not
compile is a ``ValueError`` naming the parameter. A server compiles a new constraint on a thread, within a
time bound (``AsyncLLMEngine.check_structured_output``), before it queues the request; the engine compiles it
again in its own process on a pool thread and queues the request when the grammar is ready, so neither an
event loop nor the batch waits for a compile (xgrammar releases the GIL while it compiles). ``Constraints`` keeps a grammar matcher per request beside
the sampler: before a step samples, each constrained row's logits are masked to the tokens its grammar allows
next; after, the matcher accepts the sampled token. Like the penalties' counts, the matcher advances with the
sampler itself, so with async scheduling a step already sees the previous step's token; a preempted request
keeps its matcher (its tokens are kept, not recomputed differently), and it goes when the request ends.

JSON schemas compile without free whitespace between tokens (``any_whitespace=False``): a model cannot spend
its ``max_tokens`` on blanks, which random or weak models otherwise do.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.engine.request_state import PerRequestState

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CACHE_BYTES = 64 << 20  # compiled grammars kept per compiler; beyond it the least recently used go
MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar longer than this is refused before compiling
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutput:
    """``kind``: "json" (``spec``: a JSON schema, as text or a dict), "json_object" (any JSON object; no spec),
    "regex", "grammar" (EBNF, xgrammar's dialect) or "choice" (``spec``: the strings allowed)."""

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: kind must be one of {KINDS}, got {str(self.kind)[:40]!r}")
        spec = self.spec
        if self.kind == "json":
            # One cache key per schema text. Keys keep their order: the grammar writes an object's properties in
            # the order the schema lists them (a tool call's "name" before its "arguments").
            if isinstance(spec, dict):
                spec = json.dumps(spec, separators=(",", ":"))
            elif isinstance(spec, str):
                try:
                    spec = json.dumps(json.loads(spec), separators=(",", ":"))
                except ValueError as e:
                    raise ValueError(f"structured_outputs: the JSON schema is not JSON: {e}") from None
            else:
                raise ValueError("structured_outputs: a json constraint needs a schema (an object)")
        elif self.kind == "choice":
            if (isinstance(spec, str) or not spec or len(spec) > MAX_CHOICES
                    or any(not isinstance(c, str) or not c for c in spec)):
                raise ValueError(f"structured_outputs: choice must be 1-{MAX_CHOICES} non-empty strings")
            spec = tuple(spec)
        elif self.kind in ("regex", "grammar"):
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"structured_outputs: a {self.kind} constraint needs a non-empty string")
        else:
            spec = None
        if spec is not None and sum(map(len, spec if isinstance(spec, tuple) else [spec])) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs: the {self.kind} is longer than {MAX_SPEC_CHARS} characters")
        object.__setattr__(self, "spec", spec)


def _choice_grammar(choices: tuple[str, ...]) -> str:
    def literal(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        return f'"{escaped}"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _not_json_text(token: bytes) -> bool:
    """A token that may not appear in strict JSON text on its own: a control character, or not whole UTF-8."""
    if any(b < 0x20 for b in token):
        return True
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+?:\d+:\s*")  # "[00:19:23] /project/cpp/x.cc:94: "


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and vocabulary (the model's: the logits' width)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured_outputs need the xgrammar package (pip install 'inflight[structured]')") \
                from None
        self._xgr = xgr
        backend = tokenizer.backend
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * (max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            encoded[token_id] = token
        self.info = xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=sorted(stop_token_ids),
                                      add_prefix_space=metadata["add_prefix_space"])
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        # xgrammar's JSON strings admit raw control characters (bytes < 0x20) and bytes that do not make whole
        # UTF-8 characters, which strict JSON parsers refuse (and which break maxLength: a stray byte decodes to
        # U+FFFD) and weak models emit. JSON constraints also mask every token that holds a control character or
        # is not whole UTF-8 by itself (compact JSON needs neither; the cost: a character that the tokenizer
        # only has as several byte tokens cannot be generated inside a JSON constraint).
        banned = [_not_json_text(token) for token in self.info.decoded_vocab]
        banned += [False] * (vocab_size - len(banned))
        import torch  # here, not at the top: a server's processes make requests without torch

        self.not_json_tokens = torch.tensor(banned[:vocab_size], dtype=torch.bool)
        for token_id in stop_token_ids:  # special tokens decode to nothing or to markup: never banned here
            if token_id < vocab_size:
                self.not_json_tokens[token_id] = False

    def compile(self, constraint: StructuredOutput):
        compiler = self._compiler
        try:
            if constraint.kind == "json":
                return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
            if constraint.kind == "json_object":  # OpenAI's JSON mode: an object (xgrammar's builtin takes any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.spec)
            if constraint.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(constraint.spec))
            return compiler.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
            raise ValueError(f"structured_outputs: the {constraint.kind} does not compile: {reason[:300]}") from None


class Constraints(PerRequestState[Any]):
    """A grammar matcher per constrained request, beside the sampler."""

    def __init__(self, compiler_factory) -> None:
        super().__init__()
        self._compiler_factory = compiler_factory
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the engine compiles on a pool thread while the sampler masks

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar (xgrammar caches it: the engine compiles each new constraint ahead, off the step
        loop, so the sampler's call finds it ready)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._compiler_factory()
        return self._compiler.compile(constraint)

    def mask(self, logits: torch.Tensor, rows: list[int], requests: list) -> torch.Tensor:
        """``logits`` with each of ``rows`` limited to the tokens its grammar allows next (a matcher that has
        finished, stop token included, leaves its row as it is). ``requests``: the engine ``Request`` of each row;
        a new matcher replays the request's output so far (a sequence continued from another engine has some)."""
        live = []
        for i in rows:
            request = requests[i]
            matcher = self._states.get(request.request_id)
            if matcher is None:
                grammar = self.compile(request.params.structured_output)
                matcher = self._states[request.request_id] = self._compiler._xgr.GrammarMatcher(grammar)
                for token_id in request.output_token_ids:
                    if not matcher.accept_token(token_id):
                        break  # not this grammar's output: the mask from here is the grammar's best
            if not matcher.is_terminated():
                live.append((i, matcher))
        if not live:
            return logits
        xgr = self._compiler._xgr
        bitmask = xgr.allocate_token_bitmask(len(live), self._compiler.info.vocab_size)
        for j, (_, matcher) in enumerate(live):
            matcher.fill_next_token_bitmask(bitmask, j)
        import torch  # loaded already (the logits are torch's): a lookup

        index = torch.tensor([i for i, _ in live], device=logits.device)
        rows_logits = logits.index_select(0, index).float()
        xgr.apply_token_bitmask_inplace(rows_logits, bitmask.to(logits.device))
        json_rows = [j for j, (i, _) in enumerate(live) if requests[i].params.structured_output.kind in ("json", "json_object")]
        if json_rows:
            banned = self._compiler.not_json_tokens.to(logits.device)
            rows_logits[json_rows] = rows_logits[json_rows].masked_fill(banned, float("-inf"))
        out = logits.clone()
        out[index] = rows_logits.to(logits.dtype)
        return out

    def accept(self, rows: list[int], requests: list, token_ids: list[int]) -> None:
        for i in rows:
            matcher = self._states.get(requests[i].request_id)
            if matcher is not None and not matcher.is_terminated():
                matcher.accept_token(token_ids[i])
