"""benchmarks.common.openai_client.SSEReader: one reading of an event stream, for aiohttp's byte lines and httpx's
text lines; and the soak's streaming requests through it (httpx with a mock transport, no server)."""

import asyncio

import httpx

from benchmarks.common.openai_client import SSEReader
from benchmarks.soak.soak import post_stream

BODY = ('data: {"a": 1}\n\n: a comment\ndata: not json\n\ndata: {"error": {"code": "x"}}\n\n'
        'data: [DONE]\n\ndata: {"late": 1}\n\n')


async def _lines(items):
    for item in items:
        yield item


def read(lines):
    reader = SSEReader()

    async def collect():
        return [event async for event in reader.events(_lines(lines))]

    return asyncio.run(collect()), reader


def test_bytes_and_text_lines_read_alike_up_to_done():
    text_lines = BODY.splitlines(keepends=True)
    for lines in (text_lines, [line.encode() for line in text_lines]):
        events, reader = read(lines)
        assert events == [{"a": 1}, {"error": {"code": "x"}}]
        assert reader.done and reader.num_malformed == 1


def test_a_stream_cut_before_done_is_not_done():
    events, reader = read([b'data: {"a": 1}\n'])
    assert events == [{"a": 1}] and not reader.done and reader.num_malformed == 0


def soak_reply(body: str, **kwargs):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await post_stream(client, "/v1/completions", {"model": "m"}, **kwargs)

    return asyncio.run(go())


def test_soak_streams_are_read_by_the_same_reader():
    reply = soak_reply(BODY)
    assert reply.done and not reply.body_ok and reply.error_code == "x"
    good = soak_reply('data: {"choices": []}\n\ndata: [DONE]\n\n')
    assert good.done and good.body_ok and good.error_code is None
    cut = soak_reply('data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n', cut_after_events=1)
    assert cut.cut_by_client and not cut.done
