"""Sliding-window layers and soft-capped scores (Gemma 2 and 3, Mistral): logprobs equal transformers' on prompts
several windows long, through each attention path (fresh prompt, chunk after cached context, decode, prefill lane).

Greedy tokens over the whole engine (chunked prefill, preemption, more requests than slots, async scheduling) are
compared for these families by tests/engine/test_vs_transformers.py (tests/checkpoints.ARCHITECTURES); a final
logit cap keeps the order of the logits, so only logprobs show it, here.
"""

from __future__ import annotations

import pytest
import torch

from inflight.engine import SamplingParams
from tests.checkpoints import SLIDING_WINDOW, hf_greedy, hf_logits
from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts, run_engine
from tests.engine.test_prefill_lane import SCORE, assert_prompt_logprobs_match_hf

LONG = 4 * SLIDING_WINDOW + 5  # prompt tokens: four windows and a bit


@pytest.mark.parametrize("mode", ["lane", "mixed"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prompt_logprobs_match_transformers(checkpoint, arch, mode):
    """Scored whole in the prefill lane, or in chunks of 16 after cached context (mixed): every position's logprob."""
    path = checkpoint(arch)
    engine = make_engine(path, prefill_lane=mode == "lane", max_num_seqs=4, max_num_batched_tokens=16,
                         max_prefill_batch_tokens=64)
    prompt = [1, *random_prompts(1, LONG, LONG, seed=4)[0]]
    engine.add_request("score", prompt, SCORE)
    scored = run_engine(engine)["score"]
    assert_prompt_logprobs_match_hf(path, prompt, scored.prompt_logprobs)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_logprobs_match_transformers(checkpoint, backend):
    """Gemma 2 (windowed and capped scores, capped logits) decoding past four windows: each sampled token's
    logprob is transformers' at that position."""
    path = checkpoint("gemma2")
    engine = make_engine(path, attention_backend=backend)
    prompt = random_prompts(1, 2 * SLIDING_WINDOW, 2 * SLIDING_WINDOW, seed=5)[0]
    engine.add_request("r", prompt, greedy(2 * SLIDING_WINDOW + 3, logprobs=0))
    out = run_engine(engine)["r"].outputs[0]
    tokens = list(out.token_ids)
    want = torch.log_softmax(hf_logits(path, prompt + tokens), dim=-1)
    for i, (token, entry) in enumerate(zip(tokens, out.logprobs)):
        assert entry[token].logprob == pytest.approx(float(want[len(prompt) - 1 + i, token]), abs=1e-4), i


def test_seeded_samples_do_not_depend_on_the_batch(checkpoint):
    """A seeded request samples the same tokens alone and among others (Gemma 3: windowed and full layers)."""
    path = checkpoint("gemma3")
    prompts = random_prompts(5, SLIDING_WINDOW, 3 * SLIDING_WINDOW, seed=6)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = generate_ids(make_engine(path), prompts[:1], params)[0]
    together = generate_ids(make_engine(path, max_num_seqs=3, max_num_batched_tokens=16), prompts, params)[0]
    assert alone == together


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_layers_free_the_blocks_out_of_their_window(checkpoint, arch):
    """A prompt four windows long, in chunks of 16, then decoding: the sliding layers' own pool holds the window's
    blocks and a chunk's, no more, while the full layers' tables hold the whole sequence (Gemma 2: one layer of two;
    Mistral: none, so its block tables only count). Greedy tokens stay transformers'."""
    path = checkpoint(arch)
    engine = make_engine(path, max_num_seqs=2, max_num_batched_tokens=16)
    window_blocks = -(-(SLIDING_WINDOW - 1) // 4) + 1  # positions start - 7 .. start in blocks of 4, at most
    prompt = random_prompts(1, LONG, LONG, seed=7)[0]
    engine.add_request("r", prompt, greedy(12))
    prefill_peak, decoding, tokens = 0, [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids) if output.finished else tokens
        engine.scheduler.kv.check_invariants()
        stats, request = engine.stats(), next(iter(engine.scheduler.requests.values()), None)
        if request is None:
            continue
        computed = request.num_computed_tokens
        assert stats["kv_blocks_used"] == -(-computed // 4)  # the whole sequence
        if computed <= LONG:
            prefill_peak = max(prefill_peak, stats["kv_window_blocks_used"])
        else:
            decoding.append((computed, stats["kv_window_blocks_used"]))
    assert prefill_peak <= window_blocks + 16 // 4
    # (a decoding row gives blocks back when it takes its next one: one more block between the two)
    assert len(decoding) == 10 and all(used <= window_blocks + 1 for _, used in decoding), decoding
    assert -(-decoding[-1][0] // 4) == 12 > 2 * (window_blocks + 1)  # the full layers' blocks at the end
    assert engine.stats()["kv_window_blocks_used"] == engine.stats()["kv_blocks_used"] == 0
    assert tokens == hf_greedy(path, prompt, 12)


def test_a_kv_budget_is_split_between_the_window_caches_and_the_rest(checkpoint):
    """As many longest requests fit in the window caches (a window each) as in the others (their whole length), and a
    step's tokens: more tokens in the block tables than with every layer's KV whole, the budget never exceeded."""
    from inflight.engine.kv_budget import window_blocks_needed

    budget = 1 << 20
    engine = make_engine(checkpoint("gemma2"), num_kv_blocks=None, kv_cache_memory_bytes=budget)
    runner = engine.runner
    layer_block = runner.kv_layer_block_bytes
    assert 0 < runner.num_window_blocks <= window_blocks_needed(engine.config, SLIDING_WINDOW, 4)
    used = runner.num_kv_blocks * layer_block + runner.num_window_blocks * layer_block  # one layer of each kind
    assert budget - layer_block < used <= budget
    assert runner.num_kv_blocks > budget // (2 * layer_block)  # whole: a block of both layers each
    caches = [k.shape[runner.backend.block_dim] for k, _ in runner.kv_caches]
    assert caches == [runner.num_window_blocks + 1, runner.num_kv_blocks + 1]  # (a scratch block each)
