"""The Python API: LLM.generate / LLM.chat, LLMEngine request handling, argument checking."""

from __future__ import annotations

import pytest

from inflight.engine import LLM, LLMEngine, RequestOutput, SamplingParams
from tests.engine.helpers import generate_ids, greedy, make_engine, make_llm, random_prompts, run_engine


@pytest.fixture(scope="module")
def llm():
    return make_llm(max_num_seqs=3, max_num_batched_tokens=16)


# -- LLM.generate ----------------------------------------------------------------------------------------

def test_generate_accepts_one_string(llm):
    [out] = llm.generate("Hello", greedy(4))
    assert isinstance(out, RequestOutput)
    assert out.prompt == "Hello"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello")
    assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 4


def test_generate_accepts_one_list_of_ids(llm):
    [out] = llm.generate([10, 20, 30], greedy(3))
    assert out.prompt_token_ids == [10, 20, 30] and out.prompt is None
    assert len(out.outputs[0].token_ids) == 3


def test_generate_outputs_follow_input_order(llm):
    prompts = ["a much longer first prompt, for sure", "b", "third", "4", "the fifth prompt"]
    max_tokens = [2, 9, 1, 6, 3]  # they finish in another order than they arrive
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    assert all(o.finished for o in outs)
    # the same prompts one at a time give the same tokens
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert llm.generate(prompt, greedy(m))[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_generate_token_id_lists_and_shared_params(llm):
    prompts = random_prompts(4, 2, 20, seed=3)
    outs = llm.generate(prompts, greedy(5))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert generate_ids(make_engine(), prompts, greedy(5)) == [o.outputs[0].token_ids for o in outs]


def test_generate_default_params(llm):
    [out] = llm.generate("x")
    assert 1 <= len(out.outputs[0].token_ids) <= SamplingParams().max_tokens


def test_generate_params_count_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(2)])
    assert not llm.engine.has_unfinished_requests()


def test_request_output_fields(llm):
    [out] = llm.generate("fields", greedy(6, logprobs=1))
    assert out.request_id and out.finished
    c = out.outputs[0]
    assert c.index == 0 and c.finish_reason == "length" and c.finished
    assert len(c.token_ids) == 6 and len(c.logprobs) == 6
    assert_text_is_decoded_tokens(llm.tokenizer, c)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_preemptions == 0


def assert_text_is_decoded_tokens(tokenizer, completion):
    """The text is the decoded tokens. Bytes of an unfinished UTF-8 character at the very end are held back by
    the incremental detokenizer (as in vLLM), so only trailing replacement characters may be missing."""
    full = tokenizer.decode(completion.token_ids)
    assert full.startswith(completion.text)
    assert set(full[len(completion.text):]) <= {"\ufffd"}


def test_generated_text_equals_decoded_tokens():
    engine = make_engine()
    prompts = ["The quick brown fox", "naïve café ☕ — ünïcödé", "0123456789"]
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, greedy(20))
    outs = run_engine(engine)
    for i in range(len(prompts)):
        assert_text_is_decoded_tokens(engine.tokenizer, outs[f"t{i}"].outputs[0])


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    [out] = llm.chat(messages, greedy(3))
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text.startswith("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(1) == 1, "bos must appear once, not twice"
    assert len(out.outputs[0].token_ids) == 3


def test_chat_accepts_several_conversations(llm):
    convs = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two, longer"}]]
    outs = llm.chat(convs, greedy(2))
    assert [o.prompt for o in outs] == [llm.tokenizer.apply_chat_template(c) for c in convs]


# -- argument checking --------------------------------------------------------------------------------------

def test_unknown_engine_argument_is_named():
    with pytest.raises(ValueError, match="max_num_seq_s"):
        LLM("demo-tiny", max_num_seq_s=4)


@pytest.mark.parametrize("name,value", [
    ("block_size", 3), ("block_size", 0), ("max_num_seqs", 0), ("batching", "x"), ("dtype", "int8"),
    ("device", "tpu"), ("num_kv_blocks", 0), ("max_num_batched_tokens", 2), ("gpu_memory_utilization", 0.0),
    ("max_model_len", 0), ("attention_backend", "nope"), ("one_thread_max_tokens", -1),
    ("one_thread_max_tokens", 1.5), ("one_thread_max_tokens", True),
])
def test_bad_engine_values_are_named(name, value):
    with pytest.raises(ValueError, match=name):
        LLMEngine("demo-tiny", **{**dict(num_kv_blocks=8), name: value})


def test_max_model_len_over_the_model_limit_is_rejected():
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine("demo-tiny", num_kv_blocks=8, max_model_len=10**6)


@pytest.mark.parametrize("name,value", [
    ("n", 0), ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("min_p", 1.5), ("min_p", -0.1), ("seed", 1.5), ("max_tokens", -1),
    ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", 21), ("logprobs", -1),
    ("timeout_s", 0),
])
def test_bad_sampling_params_are_named(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_over_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_sampling_params_normalise_inputs():
    p = SamplingParams(stop="ab", stop_token_ids=[3, 4], top_k=-1)
    assert p.stop == ("ab",) and p.stop_token_ids == (3, 4) and p.top_k == 0
    assert hash(p) == hash(SamplingParams(stop=["ab"], stop_token_ids=(3, 4), top_k=0))


# -- request validation --------------------------------------------------------------------------------------

@pytest.fixture
def small_engine():
    return make_engine(max_model_len=32)


def test_prompt_longer_than_max_model_len_is_rejected(small_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        small_engine.add_request("long", list(range(7, 7 + 32)), greedy(1))
    assert not small_engine.has_unfinished_requests()


def test_prompt_plus_max_tokens_over_max_model_len_is_rejected(small_engine):
    with pytest.raises(ValueError, match="max_tokens"):
        small_engine.add_request("long", list(range(7, 7 + 20)), greedy(13))
    small_engine.add_request("ok", list(range(7, 7 + 20)), greedy(12))  # exactly max_model_len is fine
    assert len(run_engine(small_engine)["ok"].outputs[0].token_ids) == 12


@pytest.mark.parametrize("prompt", [[], [7, 300], [7, -1], [7, 1.5], [True, 8], None, "lone \ud800 surrogate"])
def test_bad_prompts_are_rejected(small_engine, prompt):
    with pytest.raises(ValueError):
        small_engine.add_request("bad", prompt, greedy(1))
    assert not small_engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(small_engine):
    small_engine.add_request("dup", [10, 11], greedy(3))
    with pytest.raises(ValueError, match="dup"):
        small_engine.add_request("dup", [12, 13], greedy(3))
    outs = run_engine(small_engine)
    assert outs["dup"].prompt_token_ids == [10, 11]
    small_engine.add_request("dup", [12, 13], greedy(3))  # free again once finished
    assert run_engine(small_engine)["dup"].prompt_token_ids == [12, 13]


def test_request_id_colliding_with_a_child_of_n_does_not_corrupt_it():
    """With n=2, 'x' runs as sequences 'x#0' and 'x#1'; a user request called 'x#0' must not share their state."""
    prompt_x, prompt_y = [10, 11, 12, 13, 14], [50, 60, 70]
    want_x, want_y = generate_ids(make_engine(), [prompt_x, prompt_y], greedy(6))
    engine = make_engine()
    engine.add_request("x", prompt_x, greedy(6, n=2))
    try:
        engine.add_request("x#0", prompt_y, greedy(6))
    except ValueError:
        return  # rejecting the colliding id is fine too
    outs = run_engine(engine)
    assert [c.token_ids for c in outs["x"].outputs] == [want_x, want_x]
    assert outs["x#0"].outputs[0].token_ids == want_y


def test_bad_request_in_a_batch_leaves_no_queued_work():
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError):
        llm.generate([[10, 11], list(range(7, 7 + 64)), [12]], greedy(2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["num_waiting"] == 0
    # and the engine still works afterwards
    assert len(llm.generate([[10, 11]], greedy(2))[0].outputs[0].token_ids) == 2


def test_prompt_too_big_for_the_kv_pool_leaves_no_queued_work():
    """The pool check happens when requests are queued: earlier prompts of the batch must not stay queued."""
    llm = make_llm(num_kv_blocks=8)  # 32 token slots
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate([[10, 11], list(range(7, 7 + 40))], greedy(2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["num_waiting"] == 0


# -- abort and stats ----------------------------------------------------------------------------------------

def test_abort_request_frees_blocks_and_reports_abort():
    engine = make_engine()
    engine.add_request("a", list(range(7, 40)), greedy(50))
    engine.add_request("b", [10, 11, 12], greedy(5))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("never-existed")  # ignored
    assert engine.stats()["kv_blocks_used"] == 0, "abort frees the blocks at once, not at the next step"
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"a", "b"}
    for out in outs.values():
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert len(out.outputs[0].token_ids) == 2  # what was generated before the abort
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_abort_waiting_request():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", [10, 11], greedy(5))
    engine.add_request("b", [12, 13], greedy(5))
    engine.step()
    engine.abort_request("b")
    outs = run_engine(engine)
    assert outs["b"].outputs[0].finish_reason == "abort" and outs["b"].outputs[0].token_ids == []
    assert outs["a"].outputs[0].finish_reason == "length"


def test_timeout_via_engine():
    engine = make_engine()
    engine.add_request("t", [10, 11], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, timeout_s=1.0),
                       arrival_time=0.0)  # arrived long ago: past its deadline at the first step
    out = run_engine(engine)["t"]
    assert out.outputs[0].finish_reason == "timeout"
    assert engine.stats()["kv_blocks_used"] == 0


def test_stats_keys_and_values():
    engine = make_engine(num_kv_blocks=40, block_size=4, max_num_seqs=5)
    stats = engine.stats()
    assert set(stats) >= {
        "batching", "num_running", "num_waiting", "num_queued_prompt_tokens", "kv_blocks_total", "kv_blocks_used",
        "kv_blocks_free", "kv_block_usage", "kv_token_usage", "block_size", "max_num_seqs", "max_model_len",
        "num_preemptions", "num_recomputed_tokens", "num_steps", "time",
    }
    assert (stats["kv_blocks_total"], stats["kv_blocks_used"], stats["kv_blocks_free"]) == (40, 0, 40)
    assert (stats["block_size"], stats["max_num_seqs"], stats["batching"]) == (4, 5, "continuous")
    engine.add_request("a", list(range(7, 17)), greedy(3))
    assert engine.stats()["num_waiting"] == 1 and engine.stats()["num_queued_prompt_tokens"] == 10
    engine.step()
    stats = engine.stats()
    assert stats["num_running"] == 1 and stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 3 and stats["kv_blocks_free"] == 37
    assert stats["kv_block_usage"] == pytest.approx(3 / 40)
    assert stats["kv_token_usage"] == pytest.approx(10 / 160)
    assert stats["num_steps"] == 1
