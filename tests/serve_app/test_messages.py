"""The messages between router and replica (``serve_app.messages``): each type survives pickle (Ray's calls) and the
stream channel's frames (msgpack, in the plain form: a tag and the fields in order) unchanged. No Ray, no server."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from inflight.serve_app import messages as M
from inflight.serve_app.stream_channel import pack_frame, read_frame

CHOICES = (M.Choice(0, "Hello", [15, 16], None, None, [{"token": "Hello", "logprob": -0.25, "top": [["Hello", -0.25]]}]),
           M.Choice(1, "prompt and more", [17], "stop", "\n", None, num_echoed_chars=6))

EXAMPLES = [
    M.GenerateRequest("cmpl-1", "completion", {"max_tokens": 8, "seed": 3}, prompt="Say hi", echo=True, priority=-1,
                      client_timeout=True, timeout_s=4.5, strict_deadline=False,
                      continue_from=(M.Continued(0, [5, 6], 2),), route=M.Route("10.0.0.1", 4242, "secret", 7)),
    M.GenerateRequest("chatcmpl-2", "chat", {"n": 2}, messages=[{"role": "user", "content": "hi"}],
                      add_generation_prompt=False, tools=[{"type": "function", "function": {"name": "f"}}],
                      prompt_text="<s>hi", prompt_token_ids=[1, 2, 3]),
    M.EmbedRequest("embd-3", ["one", "two"], client_timeout=True, timeout_s=1.0),
    M.Embeddings([b"\x00\x00\x80?", b"\x00\x00\x00@"], 4),
    M.Started("replica-a", 12, CHOICES),
    M.Started("replica-a", 12, CHOICES, finished=True),
    M.Chunk(CHOICES),
    M.Finished(CHOICES),
    M.Refused({"message": "queue full", "type": "rate_limit_error", "param": None, "code": None,
               "retry_after_s": 2.0}),
    M.Lost("the engine died"),
    M.Draining(),
    M.Failed("KeyError"),
    M.ReplicaStats(replica_id="replica-a", node_id="node", model="demo", num_running=2, kv_blocks_total=64,
                   kv_blocks_free=60, kv_diagnosis={"cause": "slots"}, max_num_seqs=8, block_size=16,
                   spec={"spec_num_accepted_tokens": 4}, time=1_000_000.5),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_pickle(message):
    assert pickle.loads(pickle.dumps(message)) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_stream_channels_frames(message):
    async def through_a_frame(plain):
        reader = asyncio.StreamReader()
        reader.feed_data(pack_frame([[1, plain]]))
        return await read_frame(reader)

    [[key, plain]] = asyncio.run(through_a_frame(M.to_plain(message)))
    assert key == 1 and plain[0] == M.tag_of(type(message))
    assert M.from_plain(plain) == message


def test_every_message_type_has_its_own_tag_and_is_frozen():
    types = {type(m) for m in EXAMPLES}
    assert len({M.tag_of(t) for t in types}) == len(types) == 11
    with pytest.raises(AttributeError):
        EXAMPLES[-1].num_running = 3
    assert not hasattr(EXAMPLES[-1], "__dict__")  # slots: no per-instance dict


def test_the_plain_form_is_positional():
    """No field name travels: a chunk is its tag and one list per choice."""
    assert M.to_plain(M.Chunk(CHOICES[:1])) == [M.tag_of(M.Chunk), ([0, "Hello", [15, 16], None, None, CHOICES[0].logprobs, 0],)]


def test_a_frame_that_is_not_a_message_is_refused():
    for plain in ([99, "x"], [], [M.tag_of(M.Chunk)], "text"):
        with pytest.raises(ValueError):
            M.from_plain(plain)


def test_stats_as_a_dict_are_what_serve_and_stats_show():
    stats = EXAMPLES[-1]
    as_dict = stats.to_dict()
    assert as_dict["spec_num_accepted_tokens"] == 4 and "spec" not in as_dict
    assert as_dict["num_running"] == 2 and as_dict["time"] == stats.time
    assert M.ReplicaStats.from_dict(as_dict) == stats
    assert M.ReplicaStats.from_dict({"num_running": 1}) == M.ReplicaStats(num_running=1)
