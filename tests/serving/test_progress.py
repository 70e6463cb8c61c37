"""The router's record of what a client was sent of each choice (``_Progress``), from which a request lost with
its replica is continued elsewhere: token ids and text length per choice, finished choices left out, the
prompt's echo and logprobs not asked again. (The continuation itself: tests/engine/test_continuation.py and
tests/serving/test_replicas.py.)"""

from __future__ import annotations

from inflight.serve_app.router import _Progress, _seeded


def chunk(*choices):
    return {"choices": [{"index": i, "token_ids": ids, "text": text, "finish_reason": reason}
                        for i, ids, text, reason in choices]}


def test_progress_continues_the_unfinished_choices_from_what_was_sent():
    progress = _Progress(2)
    first = {**chunk((0, [5, 6], "hi ab", None), (1, [7], "hi ", None)), "started": True}
    for choice in first["choices"]:
        choice["echoed"] = 3  # the prompt's text, echoed before the generated text
    progress.add(first)
    progress.add(chunk((1, [8, 9], "xyz", "length")))
    progress.add(chunk((0, [10], "", None)))  # text held back (a possible stop string): tokens, no text yet
    assert not progress.finished and progress.num_tokens == 6
    payload = {"request_id": "cmpl-1", "params": {"n": 2, "seed": 3, "prompt_logprobs": 1}, "echo": True,
               "client_timeout": True, "prompt": "hi"}
    continued = progress.continued(payload, 2)
    assert continued["continue_from"] == [{"index": 0, "token_ids": [5, 6, 10], "text_len": 2}]
    assert continued["request_id"] == "cmpl-1-m2" and continued["prompt"] == "hi"
    assert continued["params"] == {"n": 2, "seed": 3} and continued["echo"] is False
    assert continued["client_timeout"] is False
    assert payload["params"]["prompt_logprobs"] == 1  # the original is left as it was
    progress.add(chunk((0, [11], "cd", "stop")))
    assert progress.finished


def test_the_router_seeds_a_request_that_brought_no_seed():
    seeds = {_seeded({"temperature": 1.0})["seed"] for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2 ** 63 for s in seeds)
    assert _seeded({"seed": 0})["seed"] == 0 and _seeded({"seed": -5})["seed"] == -5
