// A mixture-of-experts layer's experts in one call (engine/models/llama.py ``Experts``): included by cpu_kernels.cpp,
// which exports it. bfloat16 on AVX-512 BF16's dot products only (where ``linear_pairs`` is built).
//
// The (token, expert) pairs come grouped by expert: rows[offsets[e] .. offsets[e + 1]) are expert e's inputs. Each
// expert is two ``linear_pairs`` (its weights packed per expert as the dense linears' are, so each is streamed once
// for all the expert's rows) around ``silu_and_mul``, the dense MLP's kernels in the dense MLP's order. In PyTorch
// the same work was ~8 dispatched ops per expert (slice, two linears, chunk, SiLU, multiply, copy): with 64-128
// experts a layer, more time than the arithmetic. A pair's result does not depend on the other pairs.

#if INFLIGHT_BF16_DOT
// rows, out: [pairs, hidden]; gate_up: each expert's packed [2 * inter, hidden], gate_up_stride apart; down: each
// expert's packed [hidden, inter], down_stride apart; scratch: [pairs, 2 * inter] and act [pairs, inter].
static void moe_experts(const bf16* rows, const int64_t* offsets, int64_t num_experts, const bf16* gate_up,
                        int64_t gate_up_stride, const bf16* down, int64_t down_stride, bf16* scratch, bf16* act,
                        bf16* out, int64_t hidden, int64_t inter, int num_threads) {
    for (int64_t e = 0; e < num_experts; ++e) {
        const int64_t first = offsets[e], count = offsets[e + 1] - offsets[e];
        if (count == 0) continue;
        linear_pairs(rows + first * hidden, gate_up + e * gate_up_stride, nullptr, scratch + first * 2 * inter, count,
                     2 * inter, hidden, hidden, num_threads);
        silu_and_mul(scratch + first * 2 * inter, act + first * inter, count, inter, 2 * inter, num_threads);
        linear_pairs(act + first * inter, down + e * down_stride, nullptr, out + first * hidden, count, hidden, inter,
                     inter, num_threads);
    }
}
#endif
