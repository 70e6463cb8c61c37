"""What structured outputs cost the engine: ``python -m benchmarks.offline.offline --structured-fraction 0,0.2,1.0``.

Each fraction is a continuous-batching run of the workload with that share of its requests (every k-th)
constrained by ``SCHEMA`` (a JSON schema with nested objects, arrays, enums and bounded strings), the others
unconstrained; every request still generates exactly its ``max_tokens`` (``ignore_eos``: once its JSON is done
a constrained request runs on unconstrained), so the runs do the same work and differ by the grammar's
cost per step (a matcher advanced per token, a mask filled and applied per constrained row). Reported: tok/s
per fraction against fraction 0, and the time to first token a request with an already compiled schema adds
(``cached_schema_ttft_ms``: matcher, first mask), measured on an idle engine, alternating with and without.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence

from benchmarks.common.engine import drain
from benchmarks.common.workloads import BenchRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "maxLength": 32},
                                                   "active": {"type": "boolean"}},
                  "required": ["email", "active"], "additionalProperties": False},
    },
    "required": ["id", "name", "tags", "owner"],
    "additionalProperties": False,
}
TTFT_TRIALS = 21


def system_name(fraction: float) -> str:
    return f"structured-{fraction:g}"


def fraction_of(system: str) -> float:
    return float(system.removeprefix("structured-"))


def with_structured_fraction(requests: Sequence[BenchRequest], fraction: float) -> list[BenchRequest]:
    """``requests`` with every k-th generating request made a structured one, ``fraction`` of them in all."""
    generating = [i for i, r in enumerate(requests) if r.kind == "generate"]
    chosen = set(generating[j] for j in range(len(generating)) if int((j + 1) * fraction) > int(j * fraction))
    return [dataclasses.replace(r, kind="structured") if i in chosen else r for i, r in enumerate(requests)]


def cached_schema_ttft_ms(engine, prompt: list[int]) -> dict[str, float]:
    """Median time to first token (ms) of one request on an idle engine with ``SCHEMA`` (compiled before) and
    without, alternating; and their difference."""
    from inflight.engine import SamplingParams, StructuredOutput

    constraint = StructuredOutput("json", SCHEMA)
    params = {False: SamplingParams(max_tokens=1, temperature=0.0),
              True: SamplingParams(max_tokens=1, temperature=0.0, structured_output=constraint)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for trial in range(TTFT_TRIALS + 1):
        for structured in (False, True):
            engine.add_request(f"ttft-{trial}-{structured}", prompt, params[structured])
            started = time.perf_counter()
            drain(engine)
            if trial:  # the first pair compiles the schema and warms up
                times[structured].append(time.perf_counter() - started)
    plain, schema = (statistics.median(times[s]) * 1e3 for s in (False, True))
    return {"plain_ttft_ms": plain, "schema_ttft_ms": schema, "cached_schema_ttft_ms": schema - plain}
