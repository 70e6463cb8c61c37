"""The engine with ``tensor_parallel_size=2`` (rank 0 here, rank 1 a worker process; engine.parallel) against the
same engine on one rank: the same greedy tokens, seeded samples and prompt logprobs, through chunked prefill, more
requests than slots and preemption (recomputed and swapped), on Llama with 3 KV heads dealt unevenly, Llama with
one KV head (replicated), Qwen3, Qwen2 (qkv bias, tied embeddings) and Qwen3-MoE (each expert cut as the MLP);
async scheduling's placeholder tokens and speculative decoding's verification too. A token may differ only where the one-rank model's two best candidates are
a near-tie (the ranks sum in another order), which ``assert_same_tokens`` checks from the logprobs. And the ranks'
life: a size the model does not allow is refused before any process starts, a rank that dies fails the next step
with ``PeerLost``, and closing leaves no process and no shared memory behind."""

from __future__ import annotations

import glob
import multiprocessing
import os
import re
import signal

import pytest

from inflight import LLM, SamplingParams
from inflight.engine.parallel.shm import PeerLost

pytestmark = pytest.mark.slow  # (rank processes spawn: ~45 s; make test runs them, make test-fast does not)

CHECKPOINTS = {
    "llama-uneven": ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
                     {"preemption_mode": "recompute"}),
    "llama-one-kv-head": ("llama", {"hidden_size": 128, "num_key_value_heads": 1},
                          {"preemption_mode": "swap", "swap_space_bytes": 1 << 20}),
    "qwen3": ("qwen3", {}, {"preemption_mode": "swap", "swap_space_bytes": 1 << 20}),
    "qwen2-bias-tied": ("qwen2", {}, {"preemption_mode": "recompute"}),
    "qwen3-moe": ("qwen3_moe", {}, {"preemption_mode": "swap", "swap_space_bytes": 1 << 20}),  # experts cut too
}
# Small on purpose: 4 slots for 8 requests, chunks of 16 tokens for prompts up to 40, and 30 blocks of 4 tokens for
# requests that grow to ~60 tokens each: chunked prefill, queueing and preemption in one run.
ENGINE_ARGS = dict(block_size=4, num_kv_blocks=30, max_num_seqs=4, max_num_batched_tokens=16, num_threads=1,
                   enable_prefix_caching=False)
NEAR_TIE = 1e-3  # logprob gap between the best two candidates under which summing in another order may swap them


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(5 + 5 * i)] for i in range(8)]


def params() -> list[SamplingParams]:
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True) for _ in range(6)]
    sampled = [SamplingParams(max_tokens=24, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(2)]
    return greedy + sampled


def run(path, size: int, inputs=None, sampling=None, **engine_args) -> tuple[list, dict]:
    llm = LLM(str(path), tensor_parallel_size=size, **{**ENGINE_ARGS, **engine_args})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in inputs or prompts()], sampling or params())
        return outputs, llm.engine.stats()
    finally:
        llm.engine.close()


def assert_same_tokens(whole, cut) -> None:
    for a, b in zip(whole, cut):
        ours, theirs = a.outputs[0], b.outputs[0]
        if ours.token_ids == theirs.token_ids:
            continue
        at = next(i for i, (x, y) in enumerate(zip(ours.token_ids, theirs.token_ids)) if x != y)
        assert ours.logprobs is not None, f"sampled tokens differ at {at}"
        best = sorted((lp.logprob for lp in ours.logprobs[at].values()), reverse=True)
        assert best[0] - best[1] < NEAR_TIE, f"tokens differ at {at} where the top two are {best[0] - best[1]} apart"


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_two_ranks_give_one_ranks_tokens_through_chunks_and_preemption(checkpoint, name):
    arch, overrides, engine_args = CHECKPOINTS[name]
    path = checkpoint(arch, **overrides)
    whole, whole_stats = run(path, 1, **engine_args)
    cut, cut_stats = run(path, 2, **engine_args)
    assert whole_stats["num_preemptions"] > 0 and cut_stats["num_preemptions"] > 0
    if engine_args["preemption_mode"] == "swap":
        assert cut_stats["num_swapped_in_bytes"] > 0
    assert_same_tokens(whole, cut)
    assert [o.outputs[0].token_ids for o in whole[6:]] == [o.outputs[0].token_ids for o in cut[6:]]  # seeded
    for a, b in zip(whole[:6], cut[:6]):  # the greedy rows' logprobs, summed in another order
        for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            if mine.keys() == theirs.keys():
                assert max(abs(mine[t].logprob - theirs[t].logprob) for t in mine) < 1e-4


def test_prompt_logprobs_and_scoring_through_the_prefill_lane(checkpoint):
    path = checkpoint("qwen3")
    scoring = [SamplingParams(max_tokens=0, prompt_logprobs=1)] * 3  # prefill lane: whole prompts, no KV cache
    chunked = [SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0.0)]  # chunks through the scheduler
    inputs = prompts()[:4]
    whole, _ = run(path, 1, inputs, scoring + chunked)
    cut, stats = run(path, 2, inputs, scoring + chunked)
    assert stats["num_prefill_lane_batches"] > 0
    for a, b in zip(whole, cut):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for mine, theirs in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert mine.keys() == theirs.keys()
            assert max(abs(mine[t].logprob - theirs[t].logprob) for t in mine) < 1e-4
    assert whole[3].outputs[0].token_ids == cut[3].outputs[0].token_ids


def test_async_scheduling_sends_rank_0s_tokens_to_the_other_ranks(checkpoint):
    """Async scheduling feeds decode rows a token rank 0 has not yet brought to the host: broadcast to the ranks."""
    path = checkpoint("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    sampling = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 6
    whole, _ = run(path, 1, prompts()[:6], sampling)
    cut, _ = run(path, 2, prompts()[:6], sampling, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in cut]


def test_speculative_decoding_verifies_on_every_rank(checkpoint):
    path = checkpoint("qwen3")
    loop = [[5, 6, 7, 8, 9, 10] * 4]  # a prompt the random model continues by repeating: proposals get accepted
    sampling = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    whole, _ = run(path, 1, loop, sampling)
    cut, stats = run(path, 2, loop, sampling, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "adaptive": False})
    assert stats["spec_num_proposed_tokens"] > 0
    assert whole[0].outputs[0].token_ids == cut[0].outputs[0].token_ids


def test_prefix_caching_and_structured_outputs_on_two_ranks():
    """demo-tiny (the served model): prompts sharing a prefix (cached blocks reused on every rank, as the scheduler
    says) and structured outputs (rank 0's sampler, masked by the grammar) give one rank's texts."""
    from inflight.engine.structured_output import StructuredOutput

    shared = "A long shared system prompt that fills several blocks of KV " * 3
    inputs = [shared + f"question {i}" for i in range(4)] * 2
    sampling = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8 + [
        SamplingParams(max_tokens=32, temperature=1.0, seed=5,
                       structured_output=StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")),
        SamplingParams(max_tokens=16, temperature=1.0, seed=6,
                       structured_output=StructuredOutput("choice", ["yes", "no", "maybe so"]))]
    texts, hits = {}, {}
    for size in (1, 2):
        llm = LLM("demo-tiny", tensor_parallel_size=size, block_size=4, num_kv_blocks=512, num_threads=1)
        try:
            first = llm.generate(inputs[:4], sampling[:4])  # then the same prompts again: their blocks are cached
            outputs = first + llm.generate(inputs[4:] + ["pick", "answer"], sampling[4:])
            texts[size] = [o.outputs[0].text for o in outputs]
            hits[size] = llm.engine.stats()["prefix_cache_hit_tokens"]
        finally:
            llm.engine.close()
    assert texts[1] == texts[2]
    assert hits[2] == hits[1] > 0
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", texts[2][8]) and texts[2][9] in ("yes", "no", "maybe so")


def test_ranks_can_sum_through_torch_distributed_as_gpus_do(checkpoint):
    """``tensor_parallel_backend="gloo"``: the model's tensors go through a ``torch.distributed`` group (the path
    NCCL takes between GPUs) instead of shared memory: the same tokens."""
    path = checkpoint("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    whole, _ = run(path, 1, prompts()[:4], params()[4:8])
    cut, _ = run(path, 2, prompts()[:4], params()[4:8], tensor_parallel_backend="gloo")
    assert_same_tokens(whole, cut)
    assert [o.outputs[0].token_ids for o in whole[2:]] == [o.outputs[0].token_ids for o in cut[2:]]  # seeded
    with pytest.raises(ValueError, match="tensor_parallel_backend: 'nccl' carries GPU tensors"):
        LLM(str(path), tensor_parallel_size=2, tensor_parallel_backend="nccl", device="cpu")


def test_a_size_the_model_does_not_allow_is_refused_before_any_rank_starts(checkpoint):
    path = checkpoint("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 cannot cut the model's 3 KV heads.*allows 1, 2, 3, 6"):
        LLM(str(path), tensor_parallel_size=4, **ENGINE_ARGS)
    assert set(multiprocessing.active_children()) == before
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(path), tensor_parallel_size=0)


def test_a_dead_rank_fails_the_next_step_and_closing_leaves_nothing_behind(checkpoint):
    path = checkpoint("qwen3")
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE_ARGS)
    parallel = llm.engine.runner.parallel
    worker = parallel.workers.processes[0]
    files = [parallel.shm.region.name, parallel.workers.channel.region.name]
    assert not any(os.path.exists(f) for f in files)  # removed once every rank had attached them
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(PeerLost, match="rank 1"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    llm.engine.close()
    assert not any(os.path.exists(f) for f in files)


def test_closing_stops_the_ranks_and_no_shared_memory_file_outlives_the_start(checkpoint):
    path = checkpoint("qwen3")
    before = set(glob.glob("/dev/shm/inflight-*"))
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE_ARGS)
    parallel = llm.engine.runner.parallel
    assert parallel.shm.region.name.startswith("/dev/shm/inflight-")
    assert set(glob.glob("/dev/shm/inflight-*")) == before  # every rank attached: the names are gone, the memory not
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    llm.engine.close()
    llm.engine.close()  # (twice is fine)
    assert parallel.workers.processes[0].exitcode == 0
