"""What crosses between a router and its replicas: the requests, the replica's stream events and answers, its stats.

Each is a frozen msgspec struct, as the engine core's messages are (``engine/core_messages.py``): as cheap to build
as a tuple. They cross Ray as themselves (pickle) and the stream channel (``serve_app.stream_channel``, msgpack) in
a plain form: a list of the type's tag and its fields in order, nested ones as lists too (``to_plain``;
``from_plain`` reads any of them back by its tag, checking every field's type). Positional, not a dict: no key is
packed per message. Both conversions run in msgspec's C code.

A request's stream is ``Started`` (the acknowledgement with the first tokens; the request may end in it), then
``Chunk``s, then ``Finished``; or a single ``Refused`` (400, 429: an error the client gets as its HTTP status).
On the stream channel a request can also end in ``Lost`` (the replica's engine died), ``Draining`` (the replica
is being stopped and took nothing new) or ``Failed`` (a bug in the replica), which a Serve call reports as its
own exception instead. A replica's news on a connection is its ``ReplicaStats`` or ``Draining``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class _Value(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Frozen, positional on the wire; no reference cycles (``gc=False``: the collector never scans them)."""


class _Message(_Value):
    """A message: tagged (``tag=``), its tag first in its plain form."""


class Route(_Value):
    """Where a replica sends a request's messages: a router's stream channel and the request's key on it."""
    host: str
    port: int
    secret: str
    key: int


class Continued(_Value):
    """A choice continued from a replica since lost or drained: the token ids the client got, and the characters
    of text it was sent (the engine's ``Continuation``)."""
    index: int
    token_ids: list[int]
    text_len: int


class GenerateRequest(_Message, tag=1):
    """One prompt's request, as the router sends it to a replica. ``params``: ``SamplingParams``' keyword
    arguments. A completion has ``prompt``, a chat ``messages`` (and ``tools``); ``prompt_token_ids`` (and
    ``prompt_text``) when the router tokenized it (prefix affinity), which the replica then takes as they are."""
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


class EmbedRequest(_Message, tag=10):
    """``/v1/embeddings``' inputs, each an engine request of its own (one Serve call: ``LLMReplica.embed``)."""
    request_id: str
    inputs: list  # texts, or token id lists
    client_timeout: bool = False
    timeout_s: float | None = None
    strict_deadline: bool = True


class Embeddings(_Message, tag=11):
    """``LLMReplica.embed``'s answer (else ``Refused``): each input's embedding as float32 bytes."""
    embeddings: list[bytes]
    num_prompt_tokens: int


class Choice(_Value):
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


class Started(_Message, tag=2):
    """A request's first message: it was taken (by ``replica_id``, its prompt ``num_prompt_tokens`` long), with
    its first tokens; ``finished`` when it is also the last."""
    replica_id: str
    num_prompt_tokens: int
    choices: tuple[Choice, ...]
    finished: bool = False


class Chunk(_Message, tag=3):
    """A request's tokens since its last message; more follow."""
    finished: ClassVar[bool] = False
    choices: tuple[Choice, ...]


class Finished(Chunk, tag=4):
    """A request's last chunk (every choice ended)."""
    finished: ClassVar[bool] = True


class Refused(_Message, tag=5):
    """The request was not taken: ``error`` is an ``APIError``'s ``to_dict`` (400, 429 ...), the client's status."""
    finished: ClassVar[bool] = True
    error: dict[str, Any]


class Lost(_Message, tag=6):
    """The replica's engine died under the request: the router continues it elsewhere."""
    reason: str


class Draining(_Message, tag=7):
    """The replica is being stopped: as news, the router sends it nothing new; for a request, it was not taken."""


class Failed(_Message, tag=8):
    """The request failed with an error of the replica's own (a bug), named by its type."""
    error_type: str


class ReplicaStats(_Message, tag=9):
    """A replica's engine state, time-stamped (``time``, wall clock): what routing ranks replicas by (its load,
    KV use, block size), sent up each router's connection every ``routing_stats_period_s`` (also the connection's
    heartbeat) and, as a dict (``to_dict``), to Serve's request router and /stats. ``spec``: the speculative
    decoding counters (``spec_*``), which only an engine that speculates has."""
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


_STATS_FIELDS = ReplicaStats.__struct_fields__
_STATS_FIELD_SET = frozenset(_STATS_FIELDS) - {"spec"}


Message = (GenerateRequest | EmbedRequest | Embeddings | Started | Chunk | Finished | Refused | Lost | Draining
           | Failed | ReplicaStats)
StreamEvent = Started | Chunk | Finished | Refused | Lost | Draining | Failed


def _builtin(obj: Any) -> Any:
    """What msgpack cannot pack by itself: numpy's scalars (a stat or a logprob may be one) as Python numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot send a {type(obj).__name__} on the stream channel")


def to_plain(message: Message) -> list:
    """``message`` as msgpack packs it: its tag, then its fields in order (nested ones as lists too)."""
    return msgspec.to_builtins(message, builtin_types=(bytes,), enc_hook=_builtin)


def from_plain(plain: Any) -> Message:
    """The message ``to_plain`` made; a ``ValueError`` for anything else (a broken or hostile peer). (Its type is
    looked up by its tag here: msgspec converting to the union itself costs ~30 times as much.)"""
    try:
        return msgspec.convert(plain, _BY_TAG[plain[0]])
    except (msgspec.ValidationError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"not a message ({e!r}): {plain!r:.200}") from None


def tag_of(message_type: type) -> int:
    return message_type.__struct_config__.tag


_BY_TAG = {tag_of(cls): cls for cls in Message.__args__}
