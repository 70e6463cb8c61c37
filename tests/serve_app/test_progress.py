"""The router's record of what a client was sent of each choice (``_Progress``), from which a request lost with
its replica is continued elsewhere: token ids and text length per choice, finished choices left out, the
prompt's echo and logprobs not asked again. (The continuation itself: tests/engine/test_continuation.py and
tests/serving/test_replicas.py.)"""

from __future__ import annotations

from inflight.serve_app.messages import Choice, Chunk, Continued, GenerateRequest, Started
from inflight.serve_app.migration import Progress
from inflight.serve_app.request_builder import seeded


def chunk(*choices):
    return Chunk(tuple(Choice(i, text, ids, reason) for i, ids, text, reason in choices))


def test_progress_continues_the_unfinished_choices_from_what_was_sent():
    progress = Progress(2)
    # the prompt's text, echoed before the generated text
    first = Started("r1", 2, (Choice(0, "hi ab", [5, 6], num_echoed_chars=3), Choice(1, "hi ", [7], num_echoed_chars=3)))
    progress.add(first)
    progress.add(chunk((1, [8, 9], "xyz", "length")))
    progress.add(chunk((0, [10], "", None)))  # text held back (a possible stop string): tokens, no text yet
    assert not progress.finished and progress.num_tokens == 6
    request = GenerateRequest("cmpl-1", "completion", {"n": 2, "seed": 3, "prompt_logprobs": 1}, prompt="hi",
                              echo=True, client_timeout=True)
    continued = progress.continued(request, 2)
    assert continued.continue_from == (Continued(0, [5, 6, 10], 2),)
    assert continued.request_id == "cmpl-1-m2" and continued.prompt == "hi"
    assert continued.params == {"n": 2, "seed": 3} and continued.echo is False
    assert continued.client_timeout is False
    assert request.params["prompt_logprobs"] == 1  # the original is left as it was
    progress.add(chunk((0, [11], "cd", "stop")))
    assert progress.finished


def test_the_router_seeds_a_request_that_brought_no_seed():
    seeds = {seeded({"temperature": 1.0})["seed"] for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2 ** 63 for s in seeds)
    assert seeded({"seed": 0})["seed"] == 0 and seeded({"seed": -5})["seed"] == -5
