"""The least a Ray Serve streaming path can be, to measure ours against (``serving_overhead --engine no-work``).

A FastAPI ingress relays SSE from a deployment that yields a token every ``no_work_engine.STEP_S``:
no validation, admission, routing policy, pacing or metrics, one message per token. Served beside
ours (whose replica holds the no-work engine), it shows how much of the path's cost is our code and
how much is Ray Serve's.
"""

# No `from __future__ import annotations`: FastAPI must see real types on the ingress methods.
import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve

from benchmarks.serving.no_work_engine import STEP_S, TOKEN_TEXT

api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  logging_config={"enable_access_log": False})
class BareTokens:
    async def generate(self, num_tokens: int):
        for _ in range(num_tokens):
            await asyncio.sleep(STEP_S)
            yield TOKEN_TEXT


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  logging_config={"enable_access_log": False})
@serve.ingress(api)
class BareRouter:
    def __init__(self, tokens) -> None:
        self.tokens = tokens.options(stream=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> StreamingResponse:
        num_tokens = (await request.json())["max_tokens"]

        async def sse():
            count = 0
            async for text in self.tokens.generate.remote(num_tokens):
                count += 1
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": count}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


def bare_serve_app():
    return BareRouter.bind(BareTokens.bind())
