"""Sampling and stopping: seeds, top-k/top-p/min-p, min_tokens, stop tokens and strings, logprobs, n."""

from __future__ import annotations

import pytest
import torch

from inflight.engine import SamplingParams
from tests.checkpoints import hf_logits
from tests.engine.helpers import (EOS_ID, generate_ids, greedy, make_engine, random_prompts, run_engine)

PROMPT = [7 + (i * 37) % 256 for i in range(11)]  # an arbitrary byte-token prompt


def one(engine, prompt, params, max_steps=2000):
    """Run one request alone; return its single CompletionOutput."""
    engine.add_request("one", prompt, params)
    return run_engine(engine, max_steps)["one"].outputs[0]


@pytest.fixture(scope="module")
def greedy_ref():
    """demo-tiny's greedy continuation of PROMPT (24 tokens)."""
    return generate_ids(make_engine(), [PROMPT], greedy(24))[0]


# -- seeds ------------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=14, ignore_eos=True)


def test_seeded_request_is_independent_of_its_batch():
    alone = generate_ids(make_engine(), [PROMPT], SEEDED)[0]
    assert len(alone) == 14

    others = random_prompts(5, 3, 40, seed=11)
    other_params = [SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True),  # unseeded random
                    greedy(17),
                    SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_tokens=9, ignore_eos=True),
                    greedy(3),
                    SamplingParams(temperature=0.7, seed=99, max_tokens=20, ignore_eos=True)]
    prompts = others[:2] + [PROMPT] + others[2:]
    params = other_params[:2] + [SEEDED] + other_params[2:]
    # Few slots, small chunks and a tight KV pool: the seeded request is queued, chunked and preempted.
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=16)
    together = generate_ids(engine, prompts, params)[2]
    assert engine.scheduler.preemption.num_preemptions > 0
    assert together == alone

    wide = generate_ids(make_engine(max_num_seqs=8), prompts, params)[2]
    assert wide == alone


def test_different_seeds_give_different_samples():
    a = generate_ids(make_engine(), [PROMPT], SEEDED)[0]
    b = generate_ids(make_engine(), [PROMPT], SEEDED.replace(seed=4321))[0]
    assert a != b


# -- filters that reduce to greedy ------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.5, min_p=1.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1e-4, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1e-40, max_tokens=24, ignore_eos=True),  # tiny but valid: still greedy
], ids=["top_k=1", "top_p=1e-6", "min_p=1", "temperature=1e-4", "temperature=1e-40"])
def test_degenerate_sampling_equals_greedy(greedy_ref, params):
    assert one(make_engine(), PROMPT, params).token_ids == greedy_ref


def test_sampling_without_filters_is_not_greedy(greedy_ref):
    """The counterpart of the test above: at temperature 1 the draws do leave the greedy path."""
    sampled = one(make_engine(), PROMPT, SEEDED.replace(max_tokens=24)).token_ids
    assert sampled != greedy_ref


# -- stopping -----------------------------------------------------------------------------------------

def test_max_tokens_finishes_with_length():
    out = one(make_engine(), PROMPT, greedy(5))
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_ids_end_the_request(greedy_ref):
    # a token greedy produces at step 4 that it did not produce before
    k = next(i for i in range(3, 24) if greedy_ref[i] not in greedy_ref[:i])
    stop = greedy_ref[k]
    out = one(make_engine(), PROMPT, greedy(24, stop_token_ids=[stop]))
    assert out.token_ids == greedy_ref[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_suppresses_stop_token_ids(greedy_ref):
    k = next(i for i in range(1, 24) if greedy_ref[i] not in greedy_ref[:i])
    stop = greedy_ref[k]
    out = one(make_engine(), PROMPT, greedy(24, stop_token_ids=[stop], min_tokens=k + 3))
    assert out.token_ids[:k] == greedy_ref[:k]
    assert stop not in out.token_ids[:k + 3]
    assert len(out.token_ids) >= k + 3


@pytest.fixture(scope="module")
def eos_case(checkpoint):
    """(engine factory, prompt, greedy tokens with eos ignored, index of the first eos) on a random checkpoint."""
    for arch in ("qwen3", "llama", "mistral"):
        path = checkpoint(arch)
        prompts = random_prompts(16, 3, 20, seed=5)
        outs = generate_ids(make_engine(path), prompts, greedy(10))
        for prompt, tokens in zip(prompts, outs):
            if EOS_ID in tokens[1:6]:
                return path, prompt, tokens, tokens.index(EOS_ID)
    pytest.fail("no prompt makes a test checkpoint produce eos early: pick other seeds")


def test_eos_ends_the_request(eos_case):
    path, prompt, ref, k = eos_case
    out = one(make_engine(path), prompt, SamplingParams(temperature=0.0, max_tokens=10))
    assert out.token_ids == ref[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_suppresses_eos(eos_case):
    path, prompt, ref, k = eos_case
    out = one(make_engine(path), prompt, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=k + 2))
    assert out.token_ids[:k] == ref[:k]
    assert EOS_ID not in out.token_ids[:k + 2]
    assert len(out.token_ids) >= k + 2


def stop_string_case(engine, length):
    """Greedy text of PROMPT and a stop string of ``length`` printable ASCII chars spanning tokens.

    Returns (full text, the stop string, the index where it first begins).
    """
    full = one(engine, PROMPT, greedy(40))
    # the text after each token, as the engine's incremental detokenizer sees it
    decoder = engine.tokenizer.decode_stream()
    ends, text = [], ""
    for t in full.token_ids:
        text += decoder.step(t)
        ends.append(len(text))
    assert text == full.text
    owner = [next(k for k, e in enumerate(ends) if e > j) for j in range(len(text))]  # token of each char
    for j in range(1, len(text) - length):
        s = text[j:j + length]
        if (all(c.isascii() and c.isprintable() for c in s) and owner[j] != owner[j + length - 1]
                and text.find(s) == j):
            return text, s, j
    pytest.fail("no usable stop string in the greedy text: change PROMPT")


@pytest.mark.parametrize("length", [2, 3])
def test_stop_string_cuts_text(length):
    text, stop, j = stop_string_case(make_engine(), length)
    out = one(make_engine(), PROMPT, greedy(40, stop=[stop, "never-produced\x00"]))
    assert out.text == text[:j]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 40


@pytest.mark.parametrize("length", [2, 3])
def test_streamed_text_never_contains_stop_string(length):
    text, stop, j = stop_string_case(make_engine(), length)
    engine = make_engine()
    engine.add_request("s", PROMPT, greedy(40, stop=stop))
    streamed, final = "", None
    for _ in range(200):
        for output in engine.step():
            streamed += output.outputs[0].new_text
            assert stop not in streamed
            final = output
        if not engine.has_unfinished_requests():
            break
    assert final is not None and final.finished
    assert streamed == final.outputs[0].text == text[:j]


# -- logprobs -----------------------------------------------------------------------------------------

def test_greedy_logprobs_match_transformers(checkpoint):
    path = checkpoint("llama")
    prompts = random_prompts(3, 4, 25, seed=8)
    n_top, max_tokens = 5, 6
    engine = make_engine(path)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens, logprobs=n_top))
    outputs = run_engine(engine)
    for i, prompt in enumerate(prompts):
        out = outputs[f"r{i}"].outputs[0]
        assert len(out.logprobs) == max_tokens
        ref = torch.log_softmax(hf_logits(path, prompt + out.token_ids), dim=-1)
        for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + t]
            assert token in entry
            assert token == int(row.argmax())
            assert sorted(lp.rank for lp in entry.values()) == list(range(1, n_top + 1))
            assert set(entry) == set(row.topk(n_top).indices.tolist())
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(row[tid]), abs=1e-4)
        assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                                                       abs=1e-4)


def test_sampled_logprobs_hold_the_sampled_token():
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)
    out = one(make_engine(), PROMPT, params)
    assert len(out.logprobs) == 12
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        ranks = sorted(lp.rank for lp in entry.values())
        # the top 2, plus the sampled token with its own rank when it is not among them
        assert ranks == [1, 2] if entry[token].rank <= 2 else ranks == [1, 2, entry[token].rank]
        # ranks order the logprobs
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank)
        assert all(a.logprob >= b.logprob for a, b in zip(by_rank, by_rank[1:]))
    assert any(entry[token].rank > 1 for token, entry in zip(out.token_ids, out.logprobs)), \
        "at temperature 1.5 some sampled token should not be the most likely one"


def test_logprobs_zero_returns_only_the_sampled_token():
    out = one(make_engine(), PROMPT, greedy(4, logprobs=0))
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]
    assert all(entry[t].rank == 1 for t, entry in zip(out.token_ids, out.logprobs))


# -- n ----------------------------------------------------------------------------------------------------

def test_n_returns_distinct_seeded_samples():
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=10, ignore_eos=True)
    engine = make_engine()
    engine.add_request("n3", PROMPT, params)
    output = run_engine(engine)["n3"]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in output.outputs]
    assert all(len(s) == 10 for s in samples)
    assert len(set(samples)) == 3
    # and they are reproducible
    engine.add_request("again", PROMPT, params)
    assert [tuple(c.token_ids) for c in run_engine(engine)["again"].outputs] == samples


def test_n_greedy_gives_n_copies_of_greedy(greedy_ref):
    engine = make_engine()
    engine.add_request("n2", PROMPT, greedy(24, n=2))
    output = run_engine(engine)["n2"]
    assert [c.token_ids for c in output.outputs] == [greedy_ref, greedy_ref]
