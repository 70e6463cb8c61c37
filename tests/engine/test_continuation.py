"""Continuing a request on another engine (issue 17): a sequence cut after k of its outputs and continued on a
fresh engine from its tokens so far (``Continuation``) must produce exactly what the uninterrupted run produced,
token for token and character for character: greedy and seeded sampling, stop strings (with the text held back
for them at the cut), logprobs, penalties, min_tokens, a JSON schema, and n = 2 with each choice cut at its own
point, in both loops."""

from __future__ import annotations

import pytest

from inflight.engine import Continuation, SamplingParams, StructuredOutput
from tests.engine.helpers import make_engine, random_prompts

PROMPTS = random_prompts(8, 6, 24, seed=41)


def params(**kw) -> SamplingParams:
    return SamplingParams(output_kind="delta", **{"max_tokens": 24, "ignore_eos": True, **kw})


CASES = {
    "greedy": params(temperature=0.0),
    "seeded": params(temperature=1.0, top_p=0.95, seed=7),
    "stop-string-logprobs": params(temperature=1.0, seed=3, stop=["e", "ab"], logprobs=2, max_tokens=60),
    "penalties": params(temperature=1.0, seed=17, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                        max_tokens=40),
    "min-tokens": params(temperature=1.0, seed=5, ignore_eos=False, min_tokens=10),
    "json": params(temperature=1.0, seed=9, ignore_eos=False, max_tokens=80,
                   structured_output=StructuredOutput("json", {"type": "object", "properties": {
                       "name": {"type": "string", "maxLength": 8}}, "required": ["name"]})),
    "n2": params(temperature=1.0, seed=13, n=2),
}


def run(engine, request_id, prompt, sampling, continuations=None) -> dict[int, list]:
    """Each choice's outputs in order: (new token ids, new text, logprob entries, finish reason)."""
    engine.add_request(request_id, prompt, sampling, continuations=continuations)
    events: dict[int, list] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return events
        for output in engine.step():
            for c in output.outputs:
                if c.token_ids or c.text or c.finish_reason:
                    events.setdefault(c.index, []).append((list(c.token_ids), c.text, c.logprobs, c.finish_reason))
    raise AssertionError("the engine did not finish")


def joined(events: list) -> tuple[list[int], str, list, str | None]:
    tokens, text, logprobs = [], "", []
    for new_tokens, new_text, new_logprobs, _ in events:
        tokens += new_tokens
        text += new_text
        logprobs += new_logprobs or []
    return tokens, text, logprobs, events[-1][3] if events else None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_sequence_cut_anywhere_continues_exactly_on_another_engine(case, async_scheduling):
    sampling = CASES[case]
    prompt = PROMPTS[list(CASES).index(case)]
    whole = run(make_engine(async_scheduling=async_scheduling), "whole", prompt, sampling)
    assert whole and all(joined(e)[3] for e in whole.values())
    for cut in (1, 3, 6):  # outputs the caller got before the replica was lost; each choice cut at its own point
        cuts = {i: min(cut + i, len(e) - 1) for i, e in whole.items()}
        sent = {i: joined(whole[i][:k]) for i, k in cuts.items()}
        continuations = {i: Continuation(tuple(tokens), len(text)) for i, (tokens, text, _, _) in sent.items()}
        rest = run(make_engine(async_scheduling=async_scheduling), f"continued-{cut}", prompt, sampling, continuations)
        for i, events in whole.items():
            expected_tokens, expected_text, expected_logprobs, reason = joined(events)
            tokens, text, logprobs, _ = sent[i]
            more_tokens, more_text, more_logprobs, more_reason = joined(rest[i])
            assert tokens + more_tokens == expected_tokens, (case, cut, i)
            assert text + more_text == expected_text, (case, cut, i)
            assert more_reason == reason
            if sampling.logprobs is not None:
                assert [set(e) for e in logprobs + more_logprobs] == [set(e) for e in expected_logprobs]


def test_a_finished_choice_is_not_made_again():
    sampling = CASES["n2"]
    whole = run(make_engine(), "whole", PROMPTS[0], sampling)
    tokens, text, _, _ = joined(whole[1][:2])
    rest = run(make_engine(), "continued", PROMPTS[0], sampling, {1: Continuation(tuple(tokens), len(text))})
    assert set(rest) == {1}
    assert tokens + joined(rest[1])[0] == joined(whole[1])[0]


@pytest.mark.parametrize("continuations, words", [
    ({}, "at least one"),
    ({2: Continuation((10,), 0)}, r"choice indices must be in \[0, 1\)"),
    ({0: Continuation((10, 100_000), 0)}, "token ids must be in"),
    ({0: Continuation(tuple([10] * 24), 0)}, "nothing left to generate"),
    ({0: Continuation((10,), -1)}, "text_len"),
])
def test_bad_continuations_are_value_errors_naming_them(continuations, words):
    engine = make_engine()
    with pytest.raises(ValueError, match=words) as caught:
        engine.add_request("r", PROMPTS[0], params(), continuations=continuations)
    assert "continuations" in str(caught.value)
    with pytest.raises(ValueError, match="output_kind 'delta'"):
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=8), continuations={0: Continuation((10,), 0)})
    assert not engine.has_unfinished_requests()


def test_a_choice_with_no_new_token_yet_does_not_send_its_text_again():
    """n = 2 cut at very different points, with a small token budget: choice 0 (a short recompute) emits while
    choice 1 is still recomputing its long output, so choice 1 appears in outputs before its detokenizer has
    replayed anything; what it was sent must not be sent again."""
    sampling = CASES["n2"].replace(max_tokens=60)
    whole = run(make_engine(), "whole", PROMPTS[0], sampling)
    cuts = {0: 1, 1: len(whole[1]) - 2}
    sent = {i: joined(whole[i][:k]) for i, k in cuts.items()}
    continuations = {i: Continuation(tuple(tokens), len(text)) for i, (tokens, text, _, _) in sent.items()}
    rest = run(make_engine(max_num_batched_tokens=8), "continued", PROMPTS[0], sampling, continuations)
    for i in (0, 1):
        assert sent[i][1] + joined(rest[i])[1] == joined(whole[i])[1], i
        assert sent[i][0] + joined(rest[i])[0] == joined(whole[i])[0], i
