"""kernels.triton_backend against the dense float64 oracle, on fresh random inputs of many shapes.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by the
backend itself before Triton is imported), so this runs in CI. Every output buffer is poisoned with
NaN first, so an element a kernel forgets to write fails the comparison; caches start as huge
garbage, so a masked slot that leaks into a result fails it too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from inflight.kernels import BatchLayout  # noqa: E402
from inflight.kernels.triton_backend import TritonPagedAttention  # noqa: E402
from tests.kernels.cases import NUM_HEADS, batch_rows, run_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


def check(out, ref, dtype=torch.float32):
    assert out.shape == ref.shape
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


# Every (gqa, head_dim, block size, batch kind) on a GPU; in the interpreter (seconds a case) a covering set of 9
# that holds every pair of values of any two of the four, the pairs being where shape bugs meet (a GQA group
# with a head size, a block size with chunked prefill rows, ...).
FULL_MATRIX = list(itertools.product([1, 4, 8], [64, 128], [16, 32], ["mixed", "decode", "prefill"]))
PAIRWISE = [(1, 64, 32, "decode"), (1, 64, 32, "prefill"), (1, 128, 16, "mixed"), (4, 64, 16, "mixed"),
            (4, 128, 16, "prefill"), (4, 128, 32, "decode"), (8, 64, 16, "decode"), (8, 64, 16, "prefill"),
            (8, 128, 32, "mixed")]


def test_the_interpreters_cases_hold_every_pair_of_the_full_matrix():
    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(4), 2)}
    assert set(PAIRWISE) <= set(FULL_MATRIX)
    assert set().union(*map(pairs, PAIRWISE)) == set().union(*map(pairs, FULL_MATRIX))


@pytest.mark.parametrize("gqa,head_dim,bs,kind", FULL_MATRIX if DEVICE == "cuda" else PAIRWISE)
def test_triton_attention_matches_dense(gqa, head_dim, bs, kind):
    rows = batch_rows(kind, bs)
    out, ref = run_case(TritonPagedAttention(), rows, NUM_HEADS // gqa, head_dim, bs, fill="garbage",
                        seed=gqa * 1000 + head_dim + bs, device=DEVICE, out_fill=NAN)
    check(out, ref)


@pytest.mark.parametrize("num_sms", [1, 64])
def test_split_kv_decode_merges_splits_of_ragged_rows(num_sms):
    """Long ragged contexts cut into many splits (some rows shorter than others' split count, one row
    ending exactly on a split boundary), merged by log-sum-exp; and the same rows in one split."""
    backend = TritonPagedAttention(num_sms=num_sms, min_split_len=64)
    rows = [(1, 1), (1, 64), (1, 65), (1, 300), (1, 511), (1, 129)]
    out, ref = run_case(backend, rows, 2, 64, 16, fill="garbage", seed=num_sms, device=DEVICE, out_fill=NAN)
    assert (backend._num_splits(511, len(rows)) > 1) == (num_sms > 1)
    check(out, ref)


def test_long_prefill_spans_several_query_tiles_and_chunks():
    """A chunk of 150 tokens after 100 cached ones: three query tiles, keys across many blocks."""
    rows = [(150, 250), (70, 70), (1, 40)]
    out, ref = run_case(TritonPagedAttention(), rows, 2, 64, 16, fill="garbage", seed=7, device=DEVICE, out_fill=NAN)
    check(out, ref)


def test_head_dim_that_is_not_a_power_of_two():
    rows = batch_rows("mixed", 16)
    out, ref = run_case(TritonPagedAttention(), rows, 4, 80, 16, fill="garbage", seed=3, device=DEVICE, out_fill=NAN)
    check(out, ref)


INTERPRETED_BF16 = pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter cannot do bf16 dots (numpy has no bf16)")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=INTERPRETED_BF16), torch.float16])
def test_half_precision(dtype):
    rows = batch_rows("mixed", 16)
    out, ref = run_case(TritonPagedAttention(), rows, 2, 64, 16, fill=0.0, seed=11, dtype=dtype, device=DEVICE,
                        out_fill=NAN)
    check(out, ref, dtype)


def test_store_kv_writes_exactly_the_mapped_slots():
    """Every token lands in its slot, for every kv head; every other element of the cache is untouched."""
    backend = TritonPagedAttention()
    num_blocks, bs, kvh, hd = 6, 16, 4, 64
    gen = torch.Generator().manual_seed(0)
    shape = backend.kv_cache_shape(num_blocks, bs, kvh, hd)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5 * bs + 3, 0, 2 * bs + 15, bs, 3 * bs + 7])
    key = torch.randn(len(slots), kvh, hd, generator=gen)
    value = torch.randn(len(slots), kvh, hd, generator=gen)
    layout = BatchLayout(query_lens=[len(slots)], seq_lens=[len(slots)], block_tables=torch.zeros(1, 1, dtype=torch.long),
                         slot_mapping=slots.to(DEVICE), block_size=bs)
    backend.store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, backend.prepare(layout))
    expect_k, expect_v = k_before.cpu(), v_before.cpu()
    for i, slot in enumerate(slots.tolist()):
        expect_k[slot // bs, :, slot % bs] = key[i]
        expect_v[slot // bs, :, slot % bs] = value[i]
    torch.testing.assert_close(k_cache.cpu(), expect_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), expect_v, atol=0, rtol=0)


@pytest.mark.skipif(DEVICE != "cpu", reason="about the interpreter")
def test_bfloat16_in_the_interpreter_is_refused_not_garbage():
    with pytest.raises(ValueError, match="bfloat16"):
        run_case(TritonPagedAttention(), [(1, 5)], 2, 64, 16, fill=0.0, dtype=torch.bfloat16)


def test_static_decode_metadata_replays_any_context_length():
    """The CUDA-graph path: metadata over fixed buffers, split count fixed for the longest allowed context,
    split length set per step. It must give what per-step metadata gives, for short and long contexts."""
    backend = TritonPagedAttention(num_sms=16, min_split_len=64)
    gen = torch.Generator().manual_seed(1)
    bs, kvh, hd, rows = 16, 2, 64, 3
    num_blocks = 40
    shape = backend.kv_cache_shape(num_blocks + 1, bs, kvh, hd)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE)
    tables = torch.randperm(num_blocks, generator=gen)[:rows * 12].view(rows, 12).to(torch.int32).to(DEVICE)
    query = torch.randn(rows, NUM_HEADS, hd, generator=gen).to(DEVICE)
    static_lens = torch.ones(rows, dtype=torch.int32, device=DEVICE)
    static = backend.static_decode_metadata(tables, static_lens, torch.zeros(rows, dtype=torch.long, device=DEVICE),
                                            bs, max_model_len=12 * bs)
    assert static.num_splits > 1
    for seq_lens in ([1, 5, 17], [12 * bs, 100, 3], [64, 65, 129]):
        layout = BatchLayout([1] * rows, seq_lens, tables.long(), torch.zeros(rows, dtype=torch.long, device=DEVICE), bs)
        expected = backend.forward(query, None, None, k_cache, v_cache, backend.prepare(layout), 0.125)
        static_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        backend.set_decode_context(static, max(seq_lens))
        got = backend.forward(query, None, None, k_cache, v_cache, static, 0.125,
                              out=torch.full(query.shape, NAN, device=DEVICE))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
