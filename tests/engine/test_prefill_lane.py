"""Prefill-only work (prompt scoring, embeddings): the lane and the mixed path against transformers, the lane's
independence from the KV cache and the decode batch, abort, timeout and validation."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from inflight.engine import AsyncLLMEngine, LLMEngine, PoolingParams, SamplingParams
from inflight.engine.config import EngineConfig
from inflight.engine.prefill_lane import PrefillLane
from tests.checkpoints import hf_greedy, hf_logits, hf_model
from tests.engine.helpers import greedy, make_engine, make_llm, make_request, random_prompts, run_engine

NUM_TOP = 3
SCORE = SamplingParams(max_tokens=0, prompt_logprobs=NUM_TOP)
# Mixed mode chunks a 60-token prompt into 4 steps of 16; the lane puts at most 40 tokens in a batch, so the
# 60-token prompt runs alone and the others are batched in arrival order.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_batch_tokens=40)
MODES = {"lane": dict(prefill_lane=True), "mixed": dict(prefill_lane=False)}


def prompts_of(seed: int) -> list[list[int]]:
    prompts = random_prompts(5, 2, 30, seed=seed)
    prompts[1] = random_prompts(1, 60, 60, seed=seed + 100)[0]
    return [[1, *p] for p in prompts]  # bos first, as a tokenized string would have it


def assert_prompt_logprobs_match_hf(path, prompt, prompt_logprobs, num_top=NUM_TOP):
    want = torch.log_softmax(hf_logits(path, prompt), dim=-1)  # [len, vocab]: row i predicts token i + 1
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[position], want[position - 1], prompt[position]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4), f"position {position}"
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        want_values, want_ids = row.topk(num_top)
        assert [lp.logprob for lp in top] == pytest.approx(want_values.tolist(), abs=1e-4)
        top_ids = sorted((t for t, lp in entry.items() if lp.rank <= num_top), key=lambda t: entry[t].rank)
        assert top_ids == want_ids.tolist(), f"position {position}: top-{num_top} ids differ"


def hf_embedding(path, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path).model(torch.tensor([prompt])).last_hidden_state.mean(dim=1)[0]


def check_kv(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv
    kv.check_invariants()
    stats = engine.scheduler.kv_stats()
    assert stats.num_blocks_used + stats.num_blocks_cached + stats.num_blocks_empty == stats.num_blocks_total


@pytest.mark.parametrize("mode", MODES)
def test_prompt_logprobs_match_transformers(checkpoint, mode):
    path = checkpoint("llama")
    prompts = prompts_of(0)
    outputs = make_llm(path, **SMALL, **MODES[mode]).generate(prompts, SCORE)
    for prompt, output in zip(prompts, outputs):
        assert output.finished and output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
        assert_prompt_logprobs_match_hf(path, prompt, output.prompt_logprobs)


@pytest.mark.parametrize("mode", MODES)
def test_embeddings_match_transformers_mean_pooled_last_hidden_state(checkpoint, mode):
    path = checkpoint("qwen3")
    prompts = prompts_of(1)
    outputs = make_llm(path, **SMALL, **MODES[mode]).embed(prompts)
    for prompt, output in zip(prompts, outputs):
        got = torch.tensor(output.embedding)
        torch.testing.assert_close(got, hf_embedding(path, prompt), atol=1e-4, rtol=1e-4)
        assert output.prompt_logprobs is None and output.outputs[0].token_ids == []


def test_prompt_logprobs_then_generation_go_through_the_scheduler(checkpoint):
    """max_tokens > 0 with prompt_logprobs: the ordinary path even with the lane on; prompt logprobs, then the
    same tokens as transformers' greedy generate."""
    path = checkpoint("llama")
    prompts = prompts_of(2)[:3]
    llm = make_llm(path, **SMALL)
    outputs = llm.generate(prompts, greedy(5, prompt_logprobs=1))
    assert llm.engine.lane.num_batches == 0
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, 5)
        assert_prompt_logprobs_match_hf(path, prompt, output.prompt_logprobs, num_top=1)


def test_prompt_logprobs_survive_preemption_by_recomputation(checkpoint):
    """Requests preempted mid-prompt start their prompt logprobs over (every one still matches transformers)."""
    path = checkpoint("llama")
    prompts = [[1, *p] for p in random_prompts(6, 40, 60, seed=3)]
    engine = make_engine(path, max_num_seqs=3, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
                         preemption_mode="recompute")
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(8, prompt_logprobs=2))
    outputs = run_engine(engine)
    assert engine.scheduler.preemption.num_preemptions > 0, "no preemption: shrink num_kv_blocks"
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs_match_hf(path, prompt, outputs[str(i)].prompt_logprobs, num_top=2)
    check_kv(engine)
    assert engine.stats()["kv_blocks_used"] == 0


def test_lane_batches_never_touch_the_kv_pool():
    engine = make_engine(max_prefill_batch_tokens=64, max_prefill_batch_size=3)
    pool = engine.scheduler.kv.pool
    before = (pool.num_free, pool.num_used, pool.num_cached_idle)
    for i, prompt in enumerate(random_prompts(10, 5, 50, seed=4)):
        engine.add_request(f"s{i}", prompt, SCORE if i % 2 else PoolingParams())
    while engine.has_unfinished_requests():
        engine.step()
        assert (pool.num_free, pool.num_used, pool.num_cached_idle) == before
        assert not engine.scheduler.kv.block_tables
        check_kv(engine)
    assert engine.lane.num_batches >= 4  # 10 requests, at most 3 per batch
    assert engine.num_steps == 0  # the scheduler never ran a batch


def test_mixed_mode_frees_the_blocks_of_prefill_only_requests():
    engine = make_engine(prefill_lane=False, enable_prefix_caching=False)
    for i, prompt in enumerate(random_prompts(6, 5, 50, seed=5)):
        engine.add_request(f"s{i}", prompt, SCORE if i % 2 else PoolingParams())
    while engine.has_unfinished_requests():
        engine.step()
        check_kv(engine)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert engine.num_steps > 0 and stats["num_prefill_lane_batches"] == 0


def full_decode_batch(mode: str) -> LLMEngine:
    """Two long decodes hold both batch slots and every KV block; a third generation request waits."""
    engine = make_engine(max_num_seqs=2, block_size=4, num_kv_blocks=30, max_num_batched_tokens=64,
                         **MODES[mode])
    for i in range(3):
        engine.add_request(f"gen{i}", random_prompts(1, 40, 40, seed=10 + i)[0], greedy(20))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 2 and engine.scheduler.waiting
    assert engine.scheduler.kv.pool.num_free < 10, "decodes must hold (nearly) every block"
    return engine


def test_lane_request_does_not_wait_behind_decodes():
    engine = full_decode_batch("lane")
    engine.add_request("score", random_prompts(1, 50, 50, seed=20)[0], SCORE)
    engine.add_request("embed", random_prompts(1, 30, 30, seed=21)[0], PoolingParams())
    finished = {o.request_id: o for o in engine.step() if o.finished}
    assert set(finished) == {"score", "embed"}, "the lane runs in the very next step"
    assert len(finished["score"].prompt_logprobs) == 50 and len(finished["embed"].embedding) > 0
    assert len(engine.scheduler.running) == 2 and engine.scheduler.waiting  # the decodes are still going
    run_engine(engine)
    check_kv(engine)


def test_mixed_request_waits_behind_decodes():
    engine = full_decode_batch("mixed")
    engine.add_request("score", random_prompts(1, 50, 50, seed=20)[0], SCORE)
    finished_order = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order.index("score") > finished_order.index("gen0"), finished_order
    check_kv(engine)


@pytest.mark.parametrize("mode", MODES)
def test_abort_of_a_queued_prefill_only_request(mode):
    engine = make_engine(max_prefill_batch_size=1, **MODES[mode])
    prompts = random_prompts(3, 20, 20, seed=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, SCORE)
    engine.abort_request("s1")
    outputs = run_engine(engine)
    assert outputs["s1"].outputs[0].finish_reason == "abort"
    assert len(outputs["s1"].prompt_logprobs) == 1  # never computed: only position 0's None
    assert all(outputs[f"s{i}"].outputs[0].finish_reason == "length" for i in (0, 2))
    if mode == "lane":
        assert engine.lane.num_batches == 2 and not engine.lane.waiting
    check_kv(engine)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", MODES)
def test_prefill_only_request_past_its_deadline_times_out(mode):
    engine = make_engine(**MODES[mode])
    late = time.time() - 10
    engine.add_request("late", random_prompts(1, 20, 20, seed=7)[0], PoolingParams(timeout_s=1.0), arrival_time=late)
    engine.add_request("fine", random_prompts(1, 20, 20, seed=8)[0], PoolingParams(timeout_s=60.0))
    outputs = run_engine(engine)
    assert outputs["late"].outputs[0].finish_reason == "timeout" and outputs["late"].embedding is None
    assert outputs["fine"].outputs[0].finish_reason == "length" and outputs["fine"].embedding is not None
    check_kv(engine)


def test_lane_batches_form_in_arrival_order_under_both_limits():
    lane = PrefillLane(max_batch_tokens=12, max_batch_size=3)
    requests = [make_request(f"r{i}", n, max_tokens=0) for i, n in enumerate([5, 5, 20, 3, 2, 2, 2])]
    for request in requests:
        lane.add(request)
    batches = []
    while lane.waiting:
        batches.append([r.request_id for r in lane.next_batch()])
    # [5, 5] then 20 alone (longer than the limit), then three of 2-3 tokens (the size limit), then the last
    assert batches == [["r0", "r1"], ["r2"], ["r3", "r4", "r5"], ["r6"]]


def test_async_engine_streams_one_final_output_per_prefill_only_request():
    prompt = random_prompts(1, 25, 25, seed=9)[0]

    async def main():
        aengine = AsyncLLMEngine(engine=make_engine())
        try:
            scored = [o async for o in aengine.generate(prompt, SCORE)]
            embedded = [o async for o in aengine.generate(prompt, PoolingParams())]
            return scored, embedded
        finally:
            await aengine.shutdown()

    scored, embedded = asyncio.run(asyncio.wait_for(main(), 30))
    assert [o.finished for o in scored] == [True] and len(scored[0].prompt_logprobs) == 25
    assert [o.finished for o in embedded] == [True] and len(embedded[0].embedding) > 0


def test_prompt_of_max_model_len_tokens_is_fine_when_nothing_is_generated():
    engine = make_engine(max_model_len=32)
    engine.add_request("full", random_prompts(1, 32, 32, seed=11)[0], SCORE)
    assert len(run_engine(engine)["full"].prompt_logprobs) == 32
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("gen", random_prompts(1, 32, 32, seed=11)[0], greedy(1))


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0, logprobs=1), "logprobs"),
    (dict(max_tokens=0, n=2), "n"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0, min_tokens=1), "min_tokens"),
])
def test_bad_prefill_only_sampling_params_are_named(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(prefill_lane="yes"), "prefill_lane"),
    (dict(max_prefill_batch_tokens=0), "max_prefill_batch_tokens"),
    (dict(max_prefill_batch_size=0), "max_prefill_batch_size"),
    (dict(max_prefill_batch_size=2.5), "max_prefill_batch_size"),
])
def test_bad_lane_config_is_named(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        EngineConfig.from_kwargs(**kwargs)


def test_bad_pooling_params_are_named():
    with pytest.raises(ValueError, match="^timeout_s "):
        PoolingParams(timeout_s=0)
    with pytest.raises(ValueError, match="^pooling_params "):
        make_llm().embed("hello", SamplingParams())


def test_mixed_scoring_computes_a_cached_prefix_again():
    """A prompt whose blocks are in the prefix cache is computed in full when its logprobs are asked for."""
    prompt = random_prompts(1, 40, 40, seed=12)[0]
    want = make_llm().generate(prompt, SCORE)[0].prompt_logprobs  # the lane
    llm = make_llm(prefill_lane=False)
    llm.generate(prompt, greedy(2))  # its blocks are now cached
    got = llm.generate(prompt, SCORE)[0].prompt_logprobs
    assert llm.engine.stats()["prefix_cache_hit_tokens"] == 0
    assert len(got) == 40
    for position in range(1, 40):
        assert got[position].keys() == want[position].keys()
        assert [lp.logprob for lp in got[position].values()] == \
            pytest.approx([lp.logprob for lp in want[position].values()], abs=1e-4)
