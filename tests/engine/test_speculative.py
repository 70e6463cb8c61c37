"""Speculative decoding: exact outputs with proposals accepted and rejected, the target distribution kept, the
adaptive controls, and bad settings refused."""

from __future__ import annotations

import json
import random

import pytest
import torch

from inflight.engine import SamplingParams
from inflight.engine.request import Request
from inflight.engine.sampler import Sampler, SamplingBatch
from inflight.engine.speculative.proposers import NgramProposer
from inflight.engine.speculative.speculator import StepCostModel, _worthwhile
from inflight.engine.structured_output import StructuredOutput
from tests.checkpoints import ARCHITECTURES, hf_greedy
from tests.engine.helpers import VOCAB_SIZE, greedy, make_engine, random_prompts, run_engine

# 20 blocks of 4 tokens and 16 tokens a step for 3 sequences: prompts go in chunks, the pool runs out and the
# newest request is preempted and recomputed, and proposals compete with prefill chunks for the budget.
PRESSURE = dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=4, num_kv_blocks=20)
MAX_TOKENS = [30, 7, 24, 1, 18, 12, 27, 9]


def corrupted(outputs: dict[tuple[int, ...], list[int]], every: int = 4) -> dict[tuple[int, ...], tuple[int, ...]]:
    """An oracle that is wrong at every ``every``-th token (shifted per prompt): proposals are accepted for a few
    tokens, then rejected at different offsets, so rows roll back all the time."""
    wrong = {}
    for n, (prompt, tokens) in enumerate(outputs.items()):
        wrong[prompt] = tuple(shifted(t) if (i + n) % every == every - 1 else t for i, t in enumerate(tokens))
    return wrong


def shifted(token_id: int) -> int:
    return (token_id + 1) % VOCAB_SIZE


def submit(engine, prompts, params) -> dict[str, object]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    return run_engine(engine)


@pytest.mark.parametrize("method", ["ngram", "oracle", "draft"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_with_speculation(checkpoint, arch, method):
    path = checkpoint(arch)
    prompts = random_prompts(len(MAX_TOKENS), 2, 40, seed=5)
    prompts[1] = (prompts[1] * 8)[:40]  # a prompt that repeats itself: n-gram lookup finds something
    want = [hf_greedy(path, prompt, n) for prompt, n in zip(prompts, MAX_TOKENS)]
    if method == "oracle":
        spec = {"method": "oracle", "oracle_outputs": corrupted({tuple(p): w for p, w in zip(prompts, want)})}
    elif method == "draft":  # another random checkpoint of the same architecture: it agrees now and then
        spec = {"method": "draft", "draft_model": str(checkpoint(arch, seed=1)), "adaptive": False}
    else:
        spec = {"method": "ngram", "prompt_lookup_min": 1, "adaptive": False}
    engine = make_engine(path, speculative_config=spec, **PRESSURE)
    outputs = submit(engine, prompts, [greedy(n) for n in MAX_TOKENS])
    got = [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: engine {g} != transformers {w}"
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the pool no longer forces preemption: shrink num_kv_blocks"
    # proposals were made and refused (rows rolled back); the corrupted oracle's are also accepted often
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    if method == "oracle":
        assert stats["spec_num_accepted_tokens"] > stats["spec_num_proposed_tokens"] / 2
    if method == "draft":  # the draft's blocks went back with the requests
        assert engine.speculator.proposer.kv.pool.num_used == 0
    assert stats["kv_blocks_used"] == 0
    engine.scheduler.kv.check_invariants()


def test_ngram_accepts_where_the_output_repeats_and_changes_nothing():
    prompts = random_prompts(4, 10, 30, seed=5)
    plain = submit(make_engine(), prompts, [greedy(60)] * 4)
    engine = make_engine(speculative_config={"method": "ngram", "adaptive": False})
    got = submit(engine, prompts, [greedy(60)] * 4)
    assert all(got[k].outputs[0].token_ids == plain[k].outputs[0].token_ids for k in plain)
    stats = engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    assert stats["num_generated_tokens"] == 240


def test_a_draft_that_is_the_target_is_always_right(checkpoint):
    """The target as its own draft: every greedy guess is the target's next token (the draft's KV catches up
    through chunks and rolls over its own guesses correctly), so nearly every proposal is accepted."""
    path = checkpoint("llama")
    prompts = random_prompts(4, 10, 40, seed=8)
    plain = submit(make_engine(path), prompts, [greedy(40)] * 4)
    engine = make_engine(path, speculative_config={"method": "draft", "draft_model": str(path), "adaptive": False})
    got = submit(engine, prompts, [greedy(40)] * 4)
    assert all(got[k].outputs[0].token_ids == plain[k].outputs[0].token_ids for k in plain)
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] > 0.95 and stats["spec_num_proposed_tokens"] > 100


def test_sampled_outputs_are_identical_with_and_without_speculation():
    """Seeded sampling with everything that reads earlier tokens (penalties, min_tokens, top-k/p, logprobs, stop
    strings, n=2): the same tokens, text, logprobs and finish reasons, whether proposals are right or wrong."""
    prompts = random_prompts(6, 5, 30, seed=2)

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=100 + i, max_tokens=25, min_tokens=4,
                              ignore_eos=i % 2 == 0, presence_penalty=0.5 if i % 3 == 0 else 0.0,
                              repetition_penalty=1.2 if i % 3 == 1 else 1.0, logprobs=2 if i < 3 else None,
                              stop=["e", "a"] if i in (1, 4) else None, n=2 if i == 5 else 1)

    def run(spec):
        engine = make_engine(speculative_config=spec)
        outputs = submit(engine, prompts, [params(i) for i in range(len(prompts))])
        assert engine.stats()["kv_blocks_used"] == 0
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, _ranked(c.logprobs))
                 for c in outputs[f"r{i}"].outputs] for i in range(len(prompts))], engine.stats()

    plain, _ = run(None)
    exact = {tuple(p): tuple(o[0][0]) for p, o in zip(prompts, plain)}
    for oracle in (exact, corrupted(exact, every=3)):
        got, stats = run({"method": "oracle", "oracle_outputs": oracle, "adaptive": False})
        assert stats["spec_num_accepted_tokens"] > 10
        assert got == plain


def _ranked(logprobs):
    """Logprob entries as (token, rank, value to 4 significant digits): a verifying pass computes a position's
    logits over several tokens at once, which moves float32 values in their last bits (tokens never move)."""
    if logprobs is None:
        return None
    return [[(t, lp.rank, float(f"{lp.logprob:.4g}")) for t, lp in entry.items()] for entry in logprobs]


def test_structured_output_rejects_what_the_grammar_forbids():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"], "additionalProperties": False}
    prompts = random_prompts(2, 5, 20, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_output=StructuredOutput("json", schema))
    plain = submit(make_engine(), prompts, [params] * 2)
    # proposals that break the grammar: every token of the real output shifted by one
    wrong = {tuple(p): tuple(shifted(t) for t in plain[f"r{i}"].outputs[0].token_ids) for i, p in enumerate(prompts)}
    right = {tuple(p): tuple(plain[f"r{i}"].outputs[0].token_ids) for i, p in enumerate(prompts)}
    for oracle in (wrong, right):
        engine = make_engine(speculative_config={"method": "oracle", "oracle_outputs": oracle, "adaptive": False})
        got = submit(engine, prompts, [params] * 2)
        for i in range(2):
            assert got[f"r{i}"].outputs[0].token_ids == plain[f"r{i}"].outputs[0].token_ids
            if got[f"r{i}"].outputs[0].finish_reason == "stop":
                json.loads(got[f"r{i}"].outputs[0].text)
    assert engine.stats()["spec_num_accepted_tokens"] > 0


def test_blocks_cached_after_rejections_hold_the_right_kv():
    """A request's generated tokens go into the prefix cache as its blocks fill; rows roll back over rejected
    proposals all the time. A second request whose prompt is the first one's prompt and output reuses those
    blocks, and must continue exactly as on an engine without speculation (wrong KV under a right hash would
    change its tokens)."""
    prompt = random_prompts(1, 20, 20, seed=11)[0]
    plain_engine = make_engine()
    first = submit(plain_engine, [prompt], [greedy(48)])["r0"].outputs[0].token_ids
    follow_up = prompt + first[:40]
    want = submit(plain_engine, [follow_up], [greedy(20)])["r0"].outputs[0].token_ids
    for every in (2, 3, 4, 5):  # rejections at every offset in a row's proposals, and so across block ends
        oracle = corrupted({tuple(prompt): first}, every=every)
        engine = make_engine(speculative_config={"method": "oracle", "oracle_outputs": oracle, "adaptive": False})
        assert submit(engine, [prompt], [greedy(48)])["r0"].outputs[0].token_ids == first
        hits_before = engine.stats()["prefix_cache_hit_tokens"]
        assert submit(engine, [follow_up], [greedy(20)])["r0"].outputs[0].token_ids == want, every
        assert engine.stats()["prefix_cache_hit_tokens"] - hits_before >= 56  # 14 of its 15 full blocks of 4


@pytest.mark.parametrize("accepted, hashed_blocks", [(4, 3), (3, 2), (0, 2)])
def test_only_valid_kv_is_hashed_into_the_prefix_cache(accepted, hashed_blocks):
    """A 7-token prompt, then a decode row at position 7 with 4 proposals (positions 8-11: the step ends exactly
    at a block end, 12). Blocks are hashed up to the KV that verification kept: 8 + ``accepted`` positions."""
    from tests.engine.helpers import fake_step, make_request, make_scheduler

    scheduler = make_scheduler(block_size=4)
    scheduler.speculative = True
    request = make_request("a", 7, max_tokens=20)
    scheduler.add(request)
    fake_step(scheduler, 50)  # the prompt, and the first token
    request.spec_token_ids = [51, 52, 53, 54]
    out = scheduler.schedule()
    assert out.query_lens == [5] and out.spec_token_ids == {0: [51, 52, 53, 54]}
    emitted = [51, 52, 53, 54, 55][:accepted] + [99]
    scheduler.update([emitted[0]], {0: emitted[1:]})
    assert request.output_token_ids == [50, *emitted]
    assert request.num_computed_tokens == 8 + accepted
    assert scheduler.kv.num_hashed_blocks("a") == hashed_blocks


def test_swapped_out_and_back_mid_speculation():
    prompts = random_prompts(len(MAX_TOKENS), 2, 40, seed=6)
    params = [greedy(n) for n in MAX_TOKENS]
    plain = submit(make_engine(**PRESSURE), prompts, params)
    oracle = corrupted({tuple(p): plain[f"r{i}"].outputs[0].token_ids for i, p in enumerate(prompts)})
    engine = make_engine(speculative_config={"method": "oracle", "oracle_outputs": oracle, "adaptive": False},
                         preemption_mode="swap", swap_space_bytes=1 << 20, **PRESSURE)
    got = submit(engine, prompts, params)
    assert all(got[k].outputs[0].token_ids == plain[k].outputs[0].token_ids for k in plain)
    stats = engine.stats()
    assert stats["num_swapped_out_bytes"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def test_aborts_and_deadlines_free_everything_mid_speculation():
    prompts = random_prompts(4, 10, 30, seed=4)
    oracle = {tuple(p): tuple(range(10, 200)) for p in prompts}
    engine = make_engine(speculative_config={"method": "oracle", "oracle_outputs": oracle, "adaptive": False})
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(100, timeout_s=60 if i != 2 else 0.05))
    for _ in range(3):
        engine.step()
    engine.abort_request("r1")
    outputs = run_engine(engine)
    assert outputs["r1"].outputs[0].finish_reason == "abort"
    assert outputs["r2"].outputs[0].finish_reason == "timeout"
    assert len(outputs["r0"].outputs[0].token_ids) == 100
    assert engine.stats()["kv_blocks_used"] == 0


def test_rejection_keeps_the_target_distribution():
    """Many rows verify the same proposals over a 6-token vocabulary: the first emitted token is distributed as
    the target's softmax, the proposal is accepted with its target probability, and after an accepted proposal
    the next token is again a draw from the target (chi-square, df 5, p = 0.001: 20.5)."""
    torch.manual_seed(0)
    target = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    probs = torch.softmax(target, dim=0)
    rows, proposed = 20_000, [0, 1]
    logits = target.repeat(rows * (len(proposed) + 1), 1)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=100)
    requests = [Request(f"q{i}", [1], params, max_model_len=200, eos_token_ids=frozenset()) for i in range(rows)]
    batch = SamplingBatch([params] * rows, [0] * rows, frozenset(), requests)
    emitted, _ = Sampler(seed=1).verify(logits, batch, [proposed] * rows)

    def chi_square(tokens: list[int]) -> float:
        counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
        expected = probs.double() * len(tokens)
        return float(((counts - expected) ** 2 / expected).sum())

    first = [e[0] for e in emitted]
    assert chi_square(first) < 20.5
    accepted = sum(1 for e in emitted if len(e) > 1) / rows
    assert abs(accepted - float(probs[0])) < 0.02
    after_accept = [e[1] for e in emitted if len(e) > 1]
    assert chi_square(after_accept) < 20.5
    assert all(e[:-1] == proposed[:len(e) - 1] for e in emitted)  # only proposals are accepted, in order


def test_ngram_proposer_matches_a_naive_search():
    rng = random.Random(0)
    proposer = NgramProposer(1, 3)
    for trial in range(300):
        vocab = rng.choice([3, 5, 300, 1 << 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
        request = Request("p", tokens[:1], greedy(100), max_model_len=500, eos_token_ids=frozenset())
        request.all_token_ids = tokens
        want = []
        for n in range(min(3, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
            if starts:
                want = tokens[starts[-1] + n:starts[-1] + n + 4]
                break
        assert proposer.propose(request, 4) == want, (tokens, want)
        tokens.append(rng.randrange(vocab))  # grown by a token: the kept byte string must follow it
        request.all_token_ids = tokens


def test_low_acceptance_turns_proposals_down():
    """An oracle that is always wrong: after a few verified steps each request proposes nothing, bar a probe
    every 16 steps, and its output is unchanged."""
    prompts = random_prompts(3, 10, 20, seed=1)
    plain = submit(make_engine(), prompts, [greedy(120)] * 3)
    wrong = {tuple(p): tuple(shifted(t) for t in plain[f"r{i}"].outputs[0].token_ids) for i, p in enumerate(prompts)}
    engine = make_engine(speculative_config={"method": "oracle", "oracle_outputs": wrong})
    got = submit(engine, prompts, [greedy(120)] * 3)
    assert all(got[k].outputs[0].token_ids == plain[k].outputs[0].token_ids for k in plain)
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] == 0
    # 3 rows x 4 tokens x ~120 steps if nothing adapted; acceptance 0 leaves the probes
    assert stats["spec_num_proposed_tokens"] < 3 * 120 / 4


def test_cost_model_switches_speculation_off_where_it_loses():
    model = StepCostModel()
    for step in range(64):  # a step: 2 ms + 0.5 ms a row + 0.4 ms a proposed token
        rows, proposed = 4 + step % 5, (0 if step % 4 == 0 else 3 * (4 + step % 5))
        model.observe(0.002 + 0.0005 * rows + 0.0004 * proposed, rows, proposed)
    base, per_row, per_token = model.coefficients()
    assert per_token == pytest.approx(0.0004, rel=1e-3)
    assert model.threshold(1) == pytest.approx(0.0004 / 0.0025, rel=1e-3)  # cheap at one row
    assert model.threshold(64) > 0.7  # a proposal must be near certain to pay at 64 rows
    assert _worthwhile(0.9, model.threshold(1), 4) == 4
    assert _worthwhile(0.5, model.threshold(64), 4) == 0
    prompts = random_prompts(6, 10, 20, seed=3)
    oracle = {tuple(p): tuple(range(10, 200)) for p in prompts}
    engine = make_engine(speculative_config={"method": "oracle", "oracle_outputs": oracle,
                                             "disable_above_batch_size": 4})
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(20))
    for _ in range(6):
        engine.step()
    assert "disable_above_batch_size" in engine.stats()["spec_off_reason"]


def test_a_draft_with_another_vocabulary_is_refused(checkpoint):
    other = checkpoint("llama", vocab_size=300)
    with pytest.raises(ValueError, match="draft_model: its vocabulary"):
        make_engine(checkpoint("llama"), speculative_config={"method": "draft", "draft_model": str(other)})


@pytest.mark.parametrize("spec, overrides, message", [
    ({"method": "draft"}, {}, "draft_model"),
    ({"method": "ngram", "draft_model": "demo-tiny"}, {}, "draft_model"),
    ({"method": "magic"}, {}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, {}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {}, "prompt_lookup_min"),
    ({"method": "ngram", "bogus": 1}, {}, "bogus"),
    ({"method": "oracle"}, {}, "oracle_outputs"),
    ("ngram", {}, "speculative_config must be a mapping"),
    ({"method": "ngram"}, {"batching": "static"}, "batching"),
    ({"method": "ngram"}, {"async_scheduling": True}, "async_scheduling"),
])
def test_bad_speculative_settings_are_refused(spec, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_engine(speculative_config=spec, **overrides)


def test_a_draft_takes_its_kv_from_the_same_budget(checkpoint):
    """Sized in bytes, the target's blocks and the draft's (as many) fit the one budget together."""
    from inflight.engine.models.source import read_model_source

    path = checkpoint("llama")
    budget = 1 << 20
    alone = make_engine(path, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    paired = make_engine(path, num_kv_blocks=None, kv_cache_memory_bytes=budget,
                         speculative_config={"method": "draft", "draft_model": str(path)})
    draft = paired.speculator.proposer.runner
    assert draft.num_kv_blocks == paired.runner.num_kv_blocks == alone.runner.num_kv_blocks // 2
    used = (paired.runner.num_kv_blocks * paired.runner.kv_bytes_per_block
            + draft.num_kv_blocks * draft.kv_bytes_per_block)
    assert used <= budget



@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_parameter_count_matches_the_model(checkpoint, arch):
    """What the budget sets aside for a draft's weights on a GPU: ModelConfig.num_parameters, exactly."""
    from inflight.engine.models.source import read_model_source

    path = checkpoint(arch)
    engine = make_engine(path)
    assert read_model_source(str(path)).config.num_parameters == sum(
        p.numel() for p in engine.runner.model.parameters())
