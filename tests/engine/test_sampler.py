"""The sampler against the definitions it implements: the nucleus top_p keeps, and draws distributed as the
temperature-scaled, filtered softmax (unseeded rows share one noise draw for the batch; seeded rows draw
their own). Direct calls on small logits, so each check takes milliseconds."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.sampler import Sampler, SamplingBatch, _nucleus_threshold, _top_k_threshold
from inflight.engine.sampling_params import SamplingParams


class _Request:  # what the sampler reads of a seeded row's request
    index = 0
    request_id = "r"


def nucleus_by_definition(row: torch.Tensor, top_p: float) -> set[int]:
    """The most likely tokens, most likely first, up to and including the first at which the cumulative
    probability reaches top_p."""
    probs = torch.softmax(row.double(), dim=-1)
    kept, total = set(), 0.0
    for token in probs.argsort(descending=True).tolist():
        kept.add(token)
        total += float(probs[token])
        if total >= top_p:
            break
    return kept


@pytest.mark.parametrize("vocab", [7, 300])
def test_top_p_keeps_exactly_the_nucleus(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab, generator=generator) * 3
    top_ps = [0.0001, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0, 0.6] * 5
    probs = torch.softmax(logits, dim=-1)
    outside = probs < _nucleus_threshold(probs, top_ps)
    for row, top_p in enumerate(top_ps):
        kept = set(torch.nonzero(~outside[row]).flatten().tolist())
        assert kept == (set(range(vocab)) if top_p >= 1.0 else nucleus_by_definition(logits[row], top_p)), top_p


def test_top_k_keeps_the_k_most_likely_and_their_ties():
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(7, 40, generator=generator), dim=-1)
    probs[6, :5] = probs[6].max()  # at least five tokens tied for the most likely: k = 3 keeps them all
    top_ks = [1, 5, 39, 40, 0, -1, 3]
    kept = probs >= _top_k_threshold(probs, top_ks)
    for row, k in enumerate(top_ks):
        assert set(torch.nonzero(kept[row]).flatten().tolist()) == top_k_by_definition(probs[row], k), k


def test_top_p_keeps_every_token_tied_with_the_last_one():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    kept = (probs >= _nucleus_threshold(probs, [0.5])).tolist()[0]
    assert kept == [True, True, True, True]  # 0.4 + 0.2 reaches 0.5; the other 0.2s are as likely


def top_k_by_definition(row: torch.Tensor, k: int) -> set[int]:
    """The k most likely tokens and any as likely as the k-th (every token for k <= 0 or k >= the vocabulary)."""
    if not 0 < k < len(row):
        return set(range(len(row)))
    kth = row.sort(descending=True).values[k - 1]
    return set(torch.nonzero(row >= kth).flatten().tolist())


def expected_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top_k, then top_p's nucleus of what top_k kept, then min_p; normalised."""
    x = logits.double() / params.temperature
    kept = top_k_by_definition(x, params.top_k)
    x = torch.where(torch.tensor([t in kept for t in range(len(x))]), x, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        nucleus = nucleus_by_definition(x, params.top_p)
        probs = torch.tensor([p if token in nucleus else 0.0 for token, p in enumerate(probs.tolist())])
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
         SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=1.0, min_p=0.2),
         SamplingParams(temperature=1.0, top_k=4, top_p=0.75, min_p=0.05)]


@pytest.mark.parametrize("params", CASES, ids=["t1", "top_p", "top_k", "min_p", "all_filters"])
def test_unseeded_draws_follow_the_filtered_softmax(params):
    logits = torch.tensor([1.5, 0.2, -0.4, 0.9, 0.0, -1.2])
    rows = 20_000
    batch = SamplingBatch([params] * rows, [0] * rows, frozenset())
    token_ids, _ = Sampler(seed=1)(logits.expand(rows, -1).contiguous(), batch)
    frequencies = torch.bincount(torch.tensor(token_ids), minlength=len(logits)).double() / rows
    expected = expected_distribution(logits, params)
    assert (frequencies[expected == 0] == 0).all(), "a filtered-out token was drawn"
    assert (frequencies - expected).abs().max() < 0.015  # ~4.5 standard deviations at 20,000 draws


def test_seeded_draws_follow_the_softmax_and_repeat_exactly():
    logits = torch.tensor([[1.5, 0.2, -0.4, 0.9, 0.0, -1.2]])
    params = SamplingParams(temperature=1.0, seed=42)
    sampler = Sampler(seed=1)
    draws = []
    for position in range(4_000):  # one seeded row, the draws of its successive output positions
        batch = SamplingBatch([params], [position], frozenset(), [_Request()])
        draws.append(sampler(logits, batch)[0][0])
    frequencies = torch.bincount(torch.tensor(draws), minlength=6).double() / len(draws)
    assert (frequencies - expected_distribution(logits[0], params)).abs().max() < 0.035
    again = [Sampler(seed=2)(logits, SamplingBatch([params], [p], frozenset(), [_Request()]))[0][0]
             for p in range(50)]
    assert again == draws[:50], "a seeded draw depends on (seed, choice, position) alone"


def test_a_token_of_probability_zero_is_never_drawn_at_the_ends_of_the_uniform():
    from inflight.engine.sampler import _inverse_cdf

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.5, 0.0]])
    largest_below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for u, expected in ((0.0, [1, 2]), (float(largest_below_one), [3, 4]), (0.5, [3, 4])):
        assert _inverse_cdf(probs, torch.full((2,), u)).tolist() == expected, u


def test_logprobs_of_every_row_that_asks_match_their_definition():
    """The sampled token's logprob and rank (1 + the tokens strictly more likely), then the top k, for rows asking
    for different k (None: not asked, 0: the sampled token alone)."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 50, generator=generator)
    asks = [None, 0, 1, 5, None, 3]
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in asks]
    token_ids, logprobs = Sampler(seed=0)(logits, SamplingBatch(params, [0] * 6, frozenset()))
    raw = torch.log_softmax(logits, dim=-1)
    for row, k in enumerate(asks):
        if k is None:
            assert logprobs[row] is None
            continue
        (token, value, rank), top = logprobs[row]
        assert token == token_ids[row] == int(logits[row].argmax())
        assert value == pytest.approx(float(raw[row, token])) and rank == int((raw[row] > raw[row, token]).sum()) + 1
        order = raw[row].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in top] == order
        assert [v for _, v in top] == pytest.approx(raw[row, order].tolist())
