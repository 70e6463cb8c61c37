"""LLMEngine.step_listener: one record per step with the batch and the state it ran in."""

from __future__ import annotations

from tests.engine.helpers import greedy, make_engine, run_engine


def test_listener_sees_every_step_with_slots_waiting_and_kv():
    # two slots for three requests of 8-token prompts: the third waits until a slot frees
    engine = make_engine(max_num_seqs=2, block_size=4)
    records = []
    engine.step_listener = records.append
    for name, max_tokens in (("a", 2), ("b", 4), ("c", 2)):
        engine.add_request(name, list(range(10, 18)), greedy(max_tokens))
    run_engine(engine)

    assert [r.step_index for r in records] == list(range(engine.num_steps))
    first = records[0]
    assert [first.parent_ids[s] for s in first.running_ids] == ["a", "b"]
    assert first.num_waiting == 1
    assert first.batch.query_lens == [8, 8]
    # 16 prompt tokens in 4 blocks of 4 (the sampled token's slot comes with the next step)
    assert (first.kv_tokens_used, first.kv_blocks_used) == (16, 4)
    second = records[1]
    assert second.batch.query_lens == [1, 1] and second.kv_tokens_used == 18
    # a ends after its 2nd token (step 2): c takes its slot in step 3, prefilling next to b's decode;
    # its prompt is a's, so a's first full block comes from the prefix cache and 4 tokens are left
    third = records[2]
    assert sorted(third.parent_ids[s] for s in third.running_ids) == ["b", "c"]
    assert third.num_waiting == 0 and sorted(third.batch.query_lens) == [1, 4]
    assert all(r.duration_s > 0 for r in records)



def test_a_step_that_runs_nothing_is_recorded_too():
    """A step can have nothing to run (here: the only request waits for its grammar to compile); the listener
    still hears of it, since benchmarks advance their step clock by every step's duration."""
    import threading

    from inflight.engine import SamplingParams, StructuredOutput
    from tests.engine.helpers import make_engine

    engine = make_engine()
    release = threading.Event()
    compile_for_real = engine.runner.sampler.constraints.compile
    engine.runner.sampler.constraints.compile = lambda c: (release.wait(10), compile_for_real(c))[1]
    engine.request_maker.check_structured_output = lambda c: None  # checked elsewhere, as by a server's process
    records = []
    engine.step_listener = records.append
    constrained = SamplingParams(max_tokens=3, structured_output=StructuredOutput("regex", "[0-9]+"))
    engine.add_request("r", [7, 8, 9], constrained)
    engine.step()
    assert len(records) == 1 and records[0].batch.is_empty
    release.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert len(records) > 2 and not records[-2].batch.is_empty
