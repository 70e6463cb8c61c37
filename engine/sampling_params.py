"""Per-request sampling settings: the one type that crosses from the API into the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from inflight.engine.structured_output import StructuredOutput

# What each RequestOutput of a request carries (vLLM's RequestOutputKind): "cumulative", everything so far plus
# what is new (new_token_ids, new_text); "delta", only what is new since the previous output (no per-step copy
# of a long output, and little to send across a process boundary); "final_only", one output when it is done.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Immutable: the engine never changes a request's params. Values are checked here, once,
    so every layer above (Python API, HTTP) gets the same ``ValueError`` naming the argument.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len; 0: prefill-only (prompt scoring, see prompt_logprobs)
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    # Logprobs of the prompt's own tokens (position 0 has none), with this many top alternatives each (0: only the
    # prompt token's). Requests that compute them skip the prefix cache: cached tokens have no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    timeout_s: float | None = None  # deadline from arrival: queueing, prefill and decode
    # Refuse at admission (DeadlineUnmeetableError) when the first token is predicted past the deadline.
    # Servers turn it off for their own default timeout, a safety net rather than the client's need.
    reject_unmeetable_deadline: bool = True
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS
    # Logit adjustments before sampling (``engine/penalties.py``). OpenAI's: presence_penalty is subtracted once
    # from every token already generated, frequency_penalty once per time it was generated (both in [-2, 2]);
    # logit_bias adds a bias in [-100, 100] to chosen token ids (+100 forces one, -100 forbids it).
    # transformers' and vLLM's repetition_penalty: a token seen in the prompt or the output has its logit divided
    # by it when positive, multiplied when negative (> 0; 1 is off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    # What the output must match (a JSON schema, any JSON object, a regex, a choice, a grammar): see
    # engine/structured_output.py. Checked (compiled) when the request is made.
    structured_output: StructuredOutput | None = None
    # Prefix-cache isolation: requests with different salts never share cached KV blocks (so one cannot learn
    # another's prompt from its time to first token). Servers set it per tenant; None: the shared cache.
    cache_salt: str | None = None
    # Who the request is for (servers set an API key's tenant): the unit of fair share (scheduling_policy="fair")
    # and, unless cache_salt is given, of prefix-cache isolation.
    tenant: str | None = None

    def __post_init__(self) -> None:
        # Accept lists and a single stop string for convenience; store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.structured_output, dict):  # {"kind": ..., "spec": ...}, as it crosses from a server
            object.__setattr__(self, "structured_output", StructuredOutput(**self.structured_output))
        bias = self.logit_bias
        if isinstance(bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))
        elif bias is None:
            object.__setattr__(self, "logit_bias", ())
        else:
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in bias))
        # set once (the sampler asks for every row of every step), before _validate, which reads them
        object.__setattr__(self, "_penalised", bool(self.presence_penalty or self.frequency_penalty
                                                    or self.repetition_penalty != 1.0 or self.logit_bias))
        object.__setattr__(self, "_adjusts_logits", self._penalised or self.structured_output is not None)
        self._validate()
        object.__setattr__(self, "logit_bias", tuple((token_id, float(bias)) for token_id, bias in self.logit_bias))

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", "must be an integer >= 0 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20] or None")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "must be an integer in [0, 20] or None")
        if self.max_tokens == 0:  # prefill-only: nothing is sampled, so nothing about sampling may be asked for
            if self.logprobs is not None:
                raise bad("logprobs", "must be None when max_tokens is 0 (no token is generated; "
                                      "use prompt_logprobs to score the prompt)")
            if self.n != 1:
                raise bad("n", "must be 1 when max_tokens is 0 (every sequence would be the prompt alone)")
        if not isinstance(self.reject_unmeetable_deadline, bool):
            raise bad("reject_unmeetable_deadline", "must be true or false")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise bad("timeout_s", "must be > 0 or None")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"must be one of {OUTPUT_KINDS}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp <= 100.0:
            raise bad("repetition_penalty", "must be a number in (0, 100]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for pair in self.logit_bias:
            if (len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int) or pair[0] < 0
                    or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float))
                    or not -100.0 <= pair[1] <= 100.0):
                raise ValueError(f"logit_bias entries must map a token id >= 0 to a bias in [-100, 100], "
                                 f"got {str(pair)[:40]}")
        if self.max_tokens == 0 and self.penalised:
            raise ValueError("presence_penalty, frequency_penalty, repetition_penalty and logit_bias must be left "
                             "at their defaults when max_tokens is 0 (no token is generated)")
        for name in ("cache_salt", "tenant"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 256):
                raise ValueError(f"{name} must be a string of 1-256 characters or None")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise bad("structured_output", "must be a StructuredOutput or None")
            if self.max_tokens == 0:
                raise bad("structured_output", "must be None when max_tokens is 0 (no token is generated)")

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias or a structured output change this request's logits before sampling (and the
        runner keeps state for it: token counts, a grammar matcher)."""
        return self._adjusts_logits

    @property
    def penalised(self) -> bool:
        """Penalties or a logit bias apply (``engine/penalties.py``)."""
        return self._penalised

    @property
    def prefill_only(self) -> bool:
        """No token is generated: the request is its prompt's forward (logprobs, or pooled states) alone."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        # Below this, dividing float32 logits by the temperature overflows: it is greedy in all but name.
        return self.temperature < 1e-5

    @property
    def max_stop_chars(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def replace(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the mean over the prompt's positions of the final-norm hidden state.

    Nothing is generated; the engine runs it as prefill-only work (the prefill lane, when on).
    """

    timeout_s: float | None = None  # deadline from arrival
    reject_unmeetable_deadline: bool = True

    def __post_init__(self) -> None:
        timeout_s = self.timeout_s
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        if not isinstance(self.reject_unmeetable_deadline, bool):
            raise ValueError("reject_unmeetable_deadline must be true or false, "
                             f"got {self.reject_unmeetable_deadline!r}")

    def sampling_params(self) -> SamplingParams:
        """The engine's view: a prefill-only request with the same deadline."""
        return SamplingParams(max_tokens=0, timeout_s=self.timeout_s,
                              reject_unmeetable_deadline=self.reject_unmeetable_deadline)
