"""The chat workload: real text through the real model's chat template, stopping at its end of turn."""

from __future__ import annotations

import pytest

from benchmarks.common import chat_texts
from benchmarks.common.engine import engine_args
from benchmarks.common.engine_run import check_output_lens, run_engine
from benchmarks.common.models import resolve_model
from benchmarks.common.workloads import OUTPUT_LEN_RANGE, build_workload, request_params
from inflight.engine.models.packaged import SMOLLM2, packaged_model_path

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|> (its end of turn)


@pytest.fixture(scope="module")
def real():
    try:
        packaged_model_path(SMOLLM2)
    except ValueError as e:
        pytest.skip(str(e))
    return resolve_model(SMOLLM2)


def test_prompts_are_the_chat_template_around_a_question_about_the_repositorys_documents(real):
    requests = build_workload("chat", 32, seed=0, model=real)
    tokenizer = real.tokenizer
    corpus = "\n\n".join(chat_texts.passages() * 2)  # a passage may wrap around from the last paragraph
    for r in requests:
        text = tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        user = text.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>", 1)[0]
        # exactly the template's rendering of that one user turn, token for token
        assert r.prompt_token_ids == tokenizer.chat_prompt([{"role": "user", "content": user}])["prompt_token_ids"]
        question = next(q for q in chat_texts.QUESTIONS if user.startswith(q.split("{passage}")[0])
                        and user.endswith(q.split("{passage}")[1]))
        passage = user[len(question.split("{passage}")[0]):len(user) - len(question.split("{passage}")[1])]
        assert passage and passage[:max(1, len(passage) // 2)] in corpus  # (its end may be a token cut short)
        assert r.prompt_token_ids.count(IM_START) == 3 and r.prompt_token_ids.count(IM_END) == 2
    lengths = [r.prompt_len for r in requests]
    assert 40 <= min(lengths) < 200 and 600 < max(lengths) <= 810  # about 50-800 tokens, spread
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 32


def test_requests_stop_at_the_end_of_turn_within_the_seed_mixs_output_lengths(real):
    requests = build_workload("chat", 16, seed=3, model=real)
    assert all(not r.ignore_eos and OUTPUT_LEN_RANGE[0] <= r.max_tokens <= OUTPUT_LEN_RANGE[1] for r in requests)
    params = request_params(requests[0])
    assert params.ignore_eos is False and params.max_tokens == requests[0].max_tokens
    # the seed mix still runs every request to its max_tokens
    assert all(r.ignore_eos and request_params(r).ignore_eos for r in build_workload("seed", 4, model=real))


def test_the_same_seed_gives_the_same_requests_and_another_seed_others(real):
    assert build_workload("chat", 8, seed=5, model=real) == build_workload("chat", 8, seed=5, model=real)
    assert build_workload("chat", 8, seed=5, model=real) != build_workload("chat", 8, seed=6, model=real)
    shorter = build_workload("chat", 8, seed=5, prompt_lens=(60, 120), output_lens=(5, 9), model=real)
    assert all(50 <= r.prompt_len <= 130 and 5 <= r.max_tokens <= 9 for r in shorter)


def test_a_model_without_a_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="--workload chat: model bench-random has no chat template"):
        build_workload("chat", 2, model=resolve_model("bench-random"))
    with pytest.raises(ValueError, match="--workload chat: needs a model"):
        build_workload("chat", 2)


@pytest.mark.slow
def test_the_real_model_ends_some_turns_before_max_tokens(real):
    """Through our engine (one thread, a small KV cache): a request that ends its turn stops there, with <|im_end|>
    as its last token, and the run counts the tokens it really got."""
    from inflight.engine import LLMEngine

    requests = build_workload("chat", 3, seed=1, prompt_lens=(50, 90), output_lens=(40, 40), model=real)
    engine = LLMEngine(real.engine_model, **engine_args("continuous", 4, 256, 1, 32))
    finished = {}
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_token_ids, request_params(r))
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    outputs = [finished[str(i)] for i in range(len(requests))]
    stopped = [o for o in outputs if len(o) < 40]
    assert stopped and all(o[-1] == IM_END and IM_END not in o[:-1] for o in stopped)
    check_output_lens([len(o) for o in outputs], requests)  # fewer than max_tokens is right for these
    run = run_engine(engine, requests)
    assert run.output_lens == [len(o) for o in outputs] and run.useful_tokens == sum(map(len, outputs))


def test_output_lengths_are_checked_by_each_requests_stop(real):
    seed, chat = build_workload("seed", 1, model=real)[0], build_workload("chat", 1, model=real)[0]
    check_output_lens([seed.max_tokens, 1], [seed, chat])
    with pytest.raises(RuntimeError, match="request 0: 3"):
        check_output_lens([3, 1], [seed, chat])
    with pytest.raises(RuntimeError, match=f"request 1: {chat.max_tokens + 1}"):
        check_output_lens([seed.max_tokens, chat.max_tokens + 1], [seed, chat])
