"""``one_thread_max_tokens``: a CPU step of at most that many tokens runs on one thread, a larger one on all of
``num_threads``, and the tokens are the same either way."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def threads_per_step(engine) -> list[tuple[int, int]]:
    """(tokens, threads) of every forward the engine runs, recorded inside the model."""
    seen = []
    model = engine.runner.model
    forward = model.forward

    def recording(input_ids, *args, **kwargs):
        seen.append((int(input_ids.shape[0]), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    model.forward = recording
    return seen


def test_small_steps_run_on_one_thread_and_large_ones_on_all(restore_threads):
    engine = make_engine(num_threads=2, one_thread_max_tokens=4, max_num_seqs=4, max_num_batched_tokens=64)
    seen = threads_per_step(engine)
    prompts = random_prompts(4, 10, 30, seed=3)
    got = generate_ids(engine, prompts, greedy(12))

    assert {threads for tokens, threads in seen if tokens <= 4} == {1}
    assert {threads for tokens, threads in seen if tokens > 4} == {2}
    assert any(tokens <= 4 for tokens, _ in seen) and any(tokens > 4 for tokens, _ in seen)
    torch.set_num_threads(2)
    want = generate_ids(make_engine(num_threads=2, max_num_seqs=4, max_num_batched_tokens=64), prompts, greedy(12))
    assert got == want


def test_off_by_default(restore_threads):
    engine = make_engine(num_threads=2)
    seen = threads_per_step(engine)
    generate_ids(engine, random_prompts(2, 5, 9, seed=1), greedy(6))
    assert {threads for _, threads in seen} == {2}
