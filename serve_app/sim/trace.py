"""A workload trace: one JSON object a line, the requests a fleet is asked to serve.

    {"arrival_s": 0.25, "prompt_tokens": 512, "max_tokens": 128}
    {"arrival_s": 0.31, "prompt_tokens": 900, "max_tokens": 64, "prefix_id": "sys-a", "prefix_tokens": 600,
     "priority": 0, "tenant": "team-1"}

``arrival_s``: seconds from the start (default 0; lines need not be sorted). ``max_tokens``: the output tokens
the request gets (as with ``ignore_eos``: a recorded trace gives each request's real output length here;
``output_tokens`` is read as the same field). Requests with the same ``prefix_id`` share their first
``prefix_tokens`` prompt tokens (default: half the prompt), as a shared system prompt does, so prefix caching
and prefix-affinity routing see them as such. ``priority`` (lower first, under ``--scheduling-policy priority``)
and ``tenant`` (under ``fair``) are the engine's ``SamplingParams`` meanings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence



@dataclass(frozen=True)
class TraceRequest:
    prompt_tokens: int
    max_tokens: int
    arrival_s: float = 0.0
    prefix_id: str | None = None
    prefix_tokens: int | None = None  # None: half the prompt, when prefix_id is set
    priority: int = 0
    tenant: str | None = None

    @property
    def shared_tokens(self) -> int:
        """How many leading prompt tokens come from ``prefix_id``'s prefix."""
        if self.prefix_id is None:
            return 0
        wanted = self.prompt_tokens // 2 if self.prefix_tokens is None else self.prefix_tokens
        return min(wanted, self.prompt_tokens)

    def token_ids(self, index: int, vocab_size: int | None = None) -> list[int]:
        """The prompt's (synthetic) token ids: the shared prefix's, then ones of this request alone (``index``,
        its place in the trace, seeds them); within ``vocab_size`` when given."""
        shared = self.shared_tokens
        prefix = synthetic_tokens(f"prefix:{self.prefix_id}", shared, vocab_size) if shared else []
        return prefix + synthetic_tokens(f"request:{index}", self.prompt_tokens - shared, vocab_size)

    @property
    def output_tokens(self) -> int:
        return self.max_tokens

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        return {key: value for key, value in record.items()
                if value is not None and not (key == "priority" and value == 0)}


def synthetic_tokens(seed: str, count: int, vocab_size: int | None = None) -> list[int]:
    """``count`` token ids that ``seed`` decides, ordinary ones: above the low ids where vocabularies keep their
    special tokens (end of sequence among them), and below ``vocab_size``. Only block hashing and routing read
    them (and a profile's prompts, which must not hit the prefix cache: distinct seeds give distinct runs)."""
    vocab = vocab_size or 32000
    low = min(1000, vocab // 4)
    span = max(1, min(30000, vocab - low - 1))
    start = int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=4).digest(), "little")
    return [low + (start + 7919 * i) % span for i in range(count)]


def _field(record: dict, key: str, where: str, kind: type, minimum: float | None, default: Any = None) -> Any:
    value = record.get(key, default)
    if value is None or value is default:
        return value
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{where}: {key} must be {'a number' if kind is float else 'an integer'}{bound}, "
                         f"got {value!r}")
    return value


def parse_request(record: Any, where: str) -> TraceRequest:
    """One trace line's object as a ``TraceRequest``; ``ValueError`` naming ``where`` and the field otherwise."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with arrival_s, prompt_tokens, max_tokens")
    known = {f.name for f in dataclasses.fields(TraceRequest)} | {"output_tokens"}
    unknown = sorted(set(record) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a trace line has {sorted(known)}")
    if "max_tokens" in record and "output_tokens" in record:
        raise ValueError(f"{where}: give max_tokens or output_tokens (the same field), not both")
    output_key = "output_tokens" if "output_tokens" in record else "max_tokens"
    for key in ("prompt_tokens", output_key):
        if key not in record:
            raise ValueError(f"{where}: {key} is missing")
    prefix_id = record.get("prefix_id")
    if prefix_id is not None and not isinstance(prefix_id, (str, int)):
        raise ValueError(f"{where}: prefix_id must be a string or an integer, got {prefix_id!r}")
    tenant = record.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"{where}: tenant must be a string, got {tenant!r}")
    if record.get("prefix_tokens") is not None and prefix_id is None:
        raise ValueError(f"{where}: prefix_tokens needs a prefix_id")
    return TraceRequest(
        prompt_tokens=_field(record, "prompt_tokens", where, int, 1),
        max_tokens=_field(record, output_key, where, int, 1),
        arrival_s=float(_field(record, "arrival_s", where, float, 0, 0.0)),
        prefix_id=None if prefix_id is None else str(prefix_id),
        prefix_tokens=_field(record, "prefix_tokens", where, int, 0),
        priority=_field(record, "priority", where, int, None, 0),
        tenant=tenant)


def load_trace(path: str | Path, flag: str = "--trace") -> list[TraceRequest]:
    """The requests of a JSONL trace, sorted by arrival (a stable sort: ties keep their lines' order). Errors
    name the flag, the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag}: no such file: {path}")
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{flag} {path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        requests.append(parse_request(record, where))
    if not requests:
        raise ValueError(f"{flag} {path}: the file holds no requests")
    return sorted(requests, key=lambda r: r.arrival_s)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests))
    return path


def at_rate(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The trace with its arrivals ``factor`` times as fast (2: twice the request rate)."""
    if not factor > 0:
        raise ValueError(f"a rate factor must be > 0, got {factor}")
    return [dataclasses.replace(r, arrival_s=r.arrival_s / factor) for r in requests]


def mean_rate(requests: Sequence[TraceRequest]) -> float:
    """Requests per second over the trace's arrival span (inf when they all arrive at once)."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    return math.inf if span <= 0 else (len(requests) - 1) / span
