"""Helpers for the serving tests: the OpenAI schemas, SSE parsing, /stats polling, Prometheus scraping.

Nothing here fakes the server: these only read what the real server sends.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from inflight.serve_app.ports import port_free  # noqa: F401  (the fixtures' check, shared with inflight serve)

HOST = "127.0.0.1"
HTTP_PORT = 8000
METRICS_PORT = 8080
BASE_URL = f"http://{HOST}:{HTTP_PORT}"
METRICS_URL = f"http://{HOST}:{METRICS_PORT}/metrics"
MODEL = "demo-tiny"

# The official OpenAPI description, copied into the repo so a fresh clone has it (see SOURCES.yaml there).
OPENAPI_PATH = Path(__file__).resolve().parent.parent / "data" / "openai" / "openai-api-subset.json"
OPENAPI_URI = "urn:openai:openapi"


def completion_body(prompt: str = "Hello, my name is", **overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **overrides}


def chat_body(content: str = "Say something.", **overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **overrides}


# -- OpenAI schemas -------------------------------------------------------------------------------------
def _nullable_to_json_schema(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` (which OpenAI's 3.1 document still uses in places) means "or null".

    JSON Schema 2020-12 does not know the keyword and would ignore it, rejecting the nulls the
    document allows (``finish_reason`` of a stream chunk, for one). Rewrite it as ``anyOf [..., null]``;
    nothing else in the document is changed.
    """
    if isinstance(node, list):
        return [_nullable_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _nullable_to_json_schema(value) for key, value in node.items()}
    if converted.get("nullable") is True:
        converted.pop("nullable")
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


# OpenAI's document gives streamed completions the non-streamed shape (CreateCompletionResponse: "both the
# streamed and non-streamed response objects share the same shape"), whose finish_reason is a non-null enum.
# But a stream's chunks before the last have no finish reason yet, and OpenAI's own API sends
# `"finish_reason": null` in them. This derived schema is CreateCompletionResponse with only that one field
# made nullable; everything else (required fields, types, the usage chunk) is checked as written.
COMPLETION_STREAM_CHUNK = "CreateCompletionResponse (stream chunk: finish_reason may be null)"


def _derive_completion_stream_chunk(schemas: dict[str, Any]) -> dict[str, Any]:
    derived = copy.deepcopy(schemas["CreateCompletionResponse"])
    choice = derived["properties"]["choices"]["items"]
    choice["properties"]["finish_reason"] = {"anyOf": [choice["properties"]["finish_reason"], {"type": "null"}]}
    return derived


# With echo and logprobs OpenAI sends null as the first prompt token's logprob and top_logprobs (nothing precedes
# it), which the document's number / object items do not allow. This derived schema is CreateCompletionResponse
# with only those two item types made nullable (the stream-chunk relaxation included, for streamed echo).
COMPLETION_ECHO = "CreateCompletionResponse (echo with logprobs: the first token's logprob may be null)"


def _derive_completion_echo(schemas: dict[str, Any]) -> dict[str, Any]:
    derived = _derive_completion_stream_chunk(schemas)
    logprobs = derived["properties"]["choices"]["items"]["properties"]["logprobs"]
    fields = next(option for option in logprobs["anyOf"] if option.get("type") == "object")["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        fields[name]["items"] = {"anyOf": [fields[name]["items"], {"type": "null"}]}
    return derived


@functools.lru_cache(maxsize=1)
def _registry() -> Registry:
    document = _nullable_to_json_schema(json.loads(OPENAPI_PATH.read_text()))
    schemas = document["components"]["schemas"]
    schemas[COMPLETION_STREAM_CHUNK] = _derive_completion_stream_chunk(schemas)
    schemas[COMPLETION_ECHO] = _derive_completion_echo(schemas)
    # The whole document is one resource, so every "#/components/schemas/..." inside it resolves.
    return Registry().with_resource(OPENAPI_URI, Resource.from_contents(document, default_specification=DRAFT202012))


@functools.cache
def validator(schema_name: str) -> Draft202012Validator:
    document = _registry()[OPENAPI_URI].contents
    if schema_name not in document["components"]["schemas"]:
        raise KeyError(f"no schema {schema_name!r} in {OPENAPI_PATH.name}")
    pointer = schema_name.replace("~", "~0").replace("/", "~1")
    return Draft202012Validator({"$ref": f"{OPENAPI_URI}#/components/schemas/{quote(pointer)}"}, registry=_registry())


def schema_errors(schema_name: str, instance: Any) -> list[str]:
    errors = sorted(validator(schema_name).iter_errors(instance), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def assert_schema(schema_name: str, instance: Any) -> None:
    errors = schema_errors(schema_name, instance)
    assert not errors, (f"response does not match OpenAI's {schema_name}:\n  " + "\n  ".join(errors[:20])
                        + f"\ninstance: {json.dumps(instance)[:1500]}")


def assert_error_body(response: httpx.Response, status: int, error_type: str | None = None) -> dict[str, Any]:
    """``status`` with an OpenAI ``ErrorResponse`` body; returns the ``error`` object."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:500]}"
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert_schema("ErrorResponse", body)
    if error_type is not None:
        assert body["error"]["type"] == error_type, body
    assert body["error"]["message"], body
    return body["error"]


# -- SSE -------------------------------------------------------------------------------------------------
class SSEStream:
    """A parsed server-sent-event body: the JSON events in order, whether it ended with [DONE]."""

    def __init__(self, events: list[dict[str, Any]], done: bool, raw: str) -> None:
        self.events = events
        self.done = done
        self.raw = raw

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "error" in e]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "error" not in e]

    def text(self, index: int = 0, chat: bool = False) -> str:
        out = []
        for chunk in self.chunks:
            for choice in chunk.get("choices", []):
                if choice["index"] == index:
                    out.append((choice["delta"].get("content") or "") if chat else choice["text"])
        return "".join(out)

    @property
    def usage(self) -> dict[str, Any] | None:
        usages = [c["usage"] for c in self.chunks if c.get("usage")]
        return usages[-1] if usages else None


def parse_sse(raw: str) -> SSEStream:
    """Strict: every event is exactly ``data: <payload>\\n\\n``; ``[DONE]`` is last and appears once."""
    assert raw.endswith("\n\n"), f"SSE body does not end with a blank line: {raw[-200:]!r}"
    blocks = raw[:-2].split("\n\n")
    events: list[dict[str, Any]] = []
    done = False
    for i, block in enumerate(blocks):
        assert block.startswith("data: "), f"event {i} is not a `data: ` line: {block[:200]!r}"
        assert "\n" not in block, f"event {i} spans several lines: {block[:200]!r}"
        payload = block[len("data: "):]
        if payload == "[DONE]":
            assert i == len(blocks) - 1, f"[DONE] is event {i} of {len(blocks)}, not the last"
            done = True
            continue
        event = json.loads(payload)
        assert isinstance(event, dict), payload
        events.append(event)
    return SSEStream(events, done, raw)


def post_stream(client: httpx.Client, path: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[httpx.Response, SSEStream]:
    with client.stream("POST", BASE_URL + path, json={**body, "stream": True}, timeout=timeout) as response:
        raw = response.read().decode()
    if response.status_code != 200:
        return response, SSEStream([], False, raw)
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    return response, parse_sse(raw)


# -- /stats ----------------------------------------------------------------------------------------------
def get_stats(base_url: str = BASE_URL, timeout: float = 10.0) -> dict[str, Any]:
    response = httpx.get(base_url + "/stats", timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_stats(predicate: Callable[[dict[str, Any]], bool], *, base_url: str = BASE_URL, timeout: float = 10.0,
                   interval: float = 0.2, what: str = "condition") -> dict[str, Any]:
    """Poll /stats until ``predicate(stats)`` holds; fail with the last stats after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    stats: dict[str, Any] = {}
    while True:
        try:
            stats = get_stats(base_url)
            if predicate(stats):
                return stats
        except (httpx.HTTPError, AssertionError) as e:
            stats = {"error": repr(e)}
        if time.monotonic() > deadline:
            raise AssertionError(f"/stats never showed {what} within {timeout}s; last: {json.dumps(stats)[:2000]}")
        time.sleep(interval)


def idle(stats: dict[str, Any], num_replicas: int | None = None) -> bool:
    replicas = stats.get("replicas", [])
    if not replicas or (num_replicas is not None and len(replicas) != num_replicas):
        return False
    return all(r["num_running"] == 0 and r["num_waiting"] == 0 and r["kv_blocks_used"] == 0 for r in replicas)


def wait_idle(base_url: str = BASE_URL, timeout: float = 10.0, num_replicas: int | None = None) -> dict[str, Any]:
    return wait_for_stats(lambda s: idle(s, num_replicas) and s["router"]["in_flight"] == 0, base_url=base_url,
                          timeout=timeout, what="every replica idle (no running/waiting request, no KV block used)")


# -- Prometheus ------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)")


def scrape(url: str = METRICS_URL) -> dict[str, list[tuple[str, float]]]:
    """Sample name -> [(labels, value)] from a Prometheus text exposition."""
    response = httpx.get(url, timeout=10.0)
    response.raise_for_status()
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples.setdefault(match["name"], []).append((match["labels"] or "", float(match["value"])))
    return samples


def metric_family(samples: dict[str, list[tuple[str, float]]], family: str) -> dict[str, list[tuple[str, float]]]:
    """The samples of one family: the name itself or with a Prometheus suffix (_total, _bucket, _sum, _count)."""
    suffixes = ("", "_total", "_bucket", "_sum", "_count", "_created")
    return {name: values for name, values in samples.items() if any(name == family + s for s in suffixes)}


# -- async traffic ---------------------------------------------------------------------------------------
async def gather_bounded(coros, timeout: float):
    """``asyncio.gather`` that fails (instead of hanging) after ``timeout`` seconds."""
    return await asyncio.wait_for(asyncio.gather(*coros), timeout=timeout)


