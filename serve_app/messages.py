"""What crosses between a router and its replicas: the requests, the replica's stream events and answers, its stats.

Each is a frozen dataclass. They cross Ray as themselves (pickle) and the stream channel
(``serve_app.stream_channel``, msgpack) in a plain form: a list of the type's tag and its fields in order
(``to_plain``; ``from_plain`` reads any of them back by its tag). Positional, not a dict: no key is packed per
message, so a chunk costs the channel no more than the dict it replaced.

A request's stream is ``Started`` (the acknowledgement with the first tokens; the request may end in it), then
``Chunk``s, then ``Finished``; or a single ``Refused`` (400, 429: an error the client gets as its HTTP status).
On the stream channel a request can also end in ``Lost`` (the replica's engine died), ``Draining`` (the replica
is being stopped and took nothing new) or ``Failed`` (a bug in the replica), which a Serve call reports as its
own exception instead. A replica's news on a connection is its ``ReplicaStats`` or ``Draining``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar


class _Message:
    """A message's plain form: its tag and its fields in order (a type with nested fields converts them too)."""
    __slots__ = ()
    TAG: ClassVar[int]

    def to_plain(self) -> list:
        return [self.TAG, *(getattr(self, name) for name in self.__slots__)]

    @classmethod
    def _from_fields(cls, values: list):
        return cls(*values)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a replica sends a request's messages: a router's stream channel and the request's key on it."""
    host: str
    port: int
    secret: str
    key: int


@dataclass(frozen=True, slots=True)
class Continued:
    """A choice continued from a replica since lost or drained: the token ids the client got, and the characters
    of text it was sent (the engine's ``Continuation``)."""
    index: int
    token_ids: list[int]
    text_len: int


@dataclass(frozen=True, slots=True)
class GenerateRequest(_Message):
    """One prompt's request, as the router sends it to a replica. ``params``: ``SamplingParams``' keyword
    arguments. A completion has ``prompt``, a chat ``messages`` (and ``tools``); ``prompt_token_ids`` (and
    ``prompt_text``) when the router tokenized it (prefix affinity), which the replica then takes as they are."""
    TAG: ClassVar[int] = 1
    request_id: str
    kind: str  # "completion" or "chat"
    params: dict[str, Any]
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    echo: bool = False
    priority: int = 0
    client_timeout: bool = False  # the client set the deadline: only then may it be refused as unmeetable
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    continue_from: tuple[Continued, ...] | None = None
    timeout_s: float | None = None  # what is left of the deadline when sent
    strict_deadline: bool = True
    route: Route | None = None  # where its messages go (the stream channel), else the Serve call's items

    def to_plain(self) -> list:
        return [1, self.request_id, self.kind, self.params, self.prompt, self.messages, self.add_generation_prompt,
                self.tools, self.echo, self.priority, self.client_timeout, self.prompt_text, self.prompt_token_ids,
                None if self.continue_from is None else [[c.index, c.token_ids, c.text_len] for c in self.continue_from],
                self.timeout_s, self.strict_deadline,
                None if self.route is None else [self.route.host, self.route.port, self.route.secret, self.route.key]]

    @classmethod
    def _from_fields(cls, values: list) -> "GenerateRequest":
        *head, continue_from, timeout_s, strict_deadline, route = values
        return cls(*head, None if continue_from is None else tuple(Continued(*c) for c in continue_from),
                   timeout_s, strict_deadline, None if route is None else Route(*route))


@dataclass(frozen=True, slots=True)
class EmbedRequest(_Message):
    """``/v1/embeddings``' inputs, each an engine request of its own (one Serve call: ``LLMReplica.embed``)."""
    TAG: ClassVar[int] = 10
    request_id: str
    inputs: list[str] | list[list[int]]
    client_timeout: bool = False
    timeout_s: float | None = None
    strict_deadline: bool = True


@dataclass(frozen=True, slots=True)
class Embeddings(_Message):
    """``LLMReplica.embed``'s answer (else ``Refused``): each input's embedding as float32 bytes."""
    TAG: ClassVar[int] = 11
    embeddings: list[bytes]
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice's news in a message: its new text and token ids (the router keeps the ids, to continue the
    request elsewhere if this replica is lost), and how it ended, if it did. ``num_echoed_chars``: how much of
    ``text`` is the echoed prompt (not generated text)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[str, Any]] | None = None
    num_echoed_chars: int = 0


def _choices_plain(choices: tuple[Choice, ...]) -> list:
    return [[c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.num_echoed_chars]
            for c in choices]


def _choices(plain: list) -> tuple[Choice, ...]:
    return tuple([Choice(*c) for c in plain])


@dataclass(frozen=True, slots=True)
class Started(_Message):
    """A request's first message: it was taken (by ``replica_id``, its prompt ``num_prompt_tokens`` long), with
    its first tokens; ``finished`` when it is also the last."""
    TAG: ClassVar[int] = 2
    replica_id: str
    num_prompt_tokens: int
    choices: tuple[Choice, ...]
    finished: bool = False

    def to_plain(self) -> list:
        return [2, self.replica_id, self.num_prompt_tokens, _choices_plain(self.choices), self.finished]

    @classmethod
    def _from_fields(cls, values: list) -> "Started":
        replica_id, num_prompt_tokens, choices, finished = values
        return cls(replica_id, num_prompt_tokens, _choices(choices), finished)


@dataclass(frozen=True, slots=True)
class Chunk(_Message):
    """A request's tokens since its last message; more follow."""
    TAG: ClassVar[int] = 3
    finished: ClassVar[bool] = False
    choices: tuple[Choice, ...]

    def to_plain(self) -> list:
        return [self.TAG, _choices_plain(self.choices)]

    @classmethod
    def _from_fields(cls, values: list):
        return cls(_choices(values[0]))


@dataclass(frozen=True, slots=True)
class Finished(Chunk):
    """A request's last chunk (every choice ended)."""
    TAG: ClassVar[int] = 4
    finished: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Refused(_Message):
    """The request was not taken: ``error`` is an ``APIError``'s ``to_dict`` (400, 429 ...), the client's status."""
    TAG: ClassVar[int] = 5
    finished: ClassVar[bool] = True
    error: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Lost(_Message):
    """The replica's engine died under the request: the router continues it elsewhere."""
    TAG: ClassVar[int] = 6
    reason: str


@dataclass(frozen=True, slots=True)
class Draining(_Message):
    """The replica is being stopped: as news, the router sends it nothing new; for a request, it was not taken."""
    TAG: ClassVar[int] = 7


@dataclass(frozen=True, slots=True)
class Failed(_Message):
    """The request failed with an error of the replica's own (a bug), named by its type."""
    TAG: ClassVar[int] = 8
    error_type: str


@dataclass(frozen=True, slots=True)
class ReplicaStats(_Message):
    """A replica's engine state, time-stamped (``time``, wall clock): what routing ranks replicas by (its load,
    KV use, block size), sent up each router's connection every ``routing_stats_period_s`` (also the connection's
    heartbeat) and, as a dict (``to_dict``), to Serve's request router and /stats. ``spec``: the speculative
    decoding counters (``spec_*``), which only an engine that speculates has."""
    TAG: ClassVar[int] = 9
    replica_id: str = ""
    node_id: str = ""
    model: str = ""
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prompt_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 1
    kv_blocks_free: int | None = None  # None: as many as in total
    kv_blocks_cached: int = 0
    kv_token_usage: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    kv_diagnosis: Any = None
    max_num_seqs: int = 1
    max_model_len: int = 0
    block_size: int | None = None
    num_preemptions: int = 0
    num_finished_requests: int = 0
    num_generated_tokens: int = 0
    router_connections: int = 0
    spec: dict[str, Any] | None = None
    time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Serve's routing stats and /stats' replica entries: every field by name, the ``spec_*`` counters flat.
        (Serve's controller unpickles routing stats in its own process, which never imports this package.)"""
        out = {name: getattr(self, name) for name in _STATS_FIELDS}
        out.update(out.pop("spec") or {})
        return out

    @classmethod
    def from_dict(cls, stats: dict[str, Any]) -> "ReplicaStats":
        known = {k: v for k, v in stats.items() if k in _STATS_FIELD_SET}
        spec = {k: v for k, v in stats.items() if k.startswith("spec_")}
        return cls(**known, spec=spec or None)


_STATS_FIELDS = tuple(f.name for f in fields(ReplicaStats))
_STATS_FIELD_SET = frozenset(_STATS_FIELDS) - {"spec"}


_BY_TAG = {cls.TAG: cls for cls in (GenerateRequest, EmbedRequest, Embeddings, Started, Chunk, Finished, Refused, Lost,
                                    Draining, Failed, ReplicaStats)}

Message = (GenerateRequest | EmbedRequest | Embeddings | Started | Chunk | Finished | Refused | Lost | Draining
           | Failed | ReplicaStats)
StreamEvent = Started | Chunk | Finished | Refused | Lost | Draining | Failed


def to_plain(message: Message) -> list:
    """``message`` as msgpack packs it: its tag, then its fields in order (nested ones as lists too)."""
    return message.to_plain()


def from_plain(plain: list) -> Message:
    """The message ``to_plain`` made; a ``ValueError`` for anything else (a broken or hostile peer)."""
    try:
        return _BY_TAG[plain[0]]._from_fields(plain[1:])
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"not a message: {plain!r:.200}") from e
