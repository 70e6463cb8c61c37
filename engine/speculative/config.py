"""``speculative_config``: how a replica speculates. Built from a plain dict (engine arguments, serve configs)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

# "draft": a smaller checkpoint with the target's vocabulary, its own paged KV cache (engine/speculative/draft.py).
# "oracle" replays outputs known in advance (tests and benchmarks: the mechanism's ceiling, 100% acceptance).
# An EAGLE-style head would be one more proposer (proposers.Proposer.propose_batch).
METHODS = ("ngram", "draft", "oracle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: where proposals come from. ``num_speculative_tokens``: at most this many per decode row and
    step. ``prompt_lookup_min``/``max``: n-gram sizes the ``ngram`` proposer matches (longest first) against the
    request's own prompt and output. ``adaptive``: each row's proposal length follows its measured acceptance
    and the step-cost model, which turns speculation off where it would lose (``Speculator``); off, every row
    with a proposal gets it whole. ``disable_above_batch_size``: no proposals at all while more rows than this
    decode (None: no fixed limit). ``draft_model``: for ``draft`` only, the draft checkpoint's path (or
    "demo-tiny"). ``oracle_outputs``: for ``oracle`` only, each prompt's (token ids) output."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True
    disable_above_batch_size: int | None = None
    draft_model: str | None = None
    oracle_outputs: Mapping[tuple[int, ...], tuple[int, ...]] | None = None

    @classmethod
    def from_value(cls, value: Any) -> "SpeculativeConfig | None":
        """None, a ``SpeculativeConfig``, or a dict of its fields; raises ValueError naming a bad field."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a mapping of its settings or null, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name} {why}, got {getattr(self, name)!r}")

        if self.method not in METHODS:
            raise bad("method", f"must be one of {METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 16:
                raise bad(name, "must be an integer in [1, 16]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            raise bad("adaptive", "must be true or false")
        limit = self.disable_above_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise bad("disable_above_batch_size", "must be an integer >= 1 or null")
        if (self.method == "draft") != (self.draft_model is not None):
            raise bad("draft_model", "is required by method 'draft' and only by it")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise bad("draft_model", "must be a checkpoint path or 'demo-tiny'")
        if (self.method == "oracle") != (self.oracle_outputs is not None):
            raise bad("oracle_outputs", "is required by method 'oracle' and only by it")
