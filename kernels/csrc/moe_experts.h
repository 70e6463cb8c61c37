// A mixture-of-experts layer's experts in one call (engine/models/llama.py ``Experts``): included by cpu_kernels.cpp,
// which exports it.
//
// The (token, expert) pairs come grouped by expert: rows[offsets[e] .. offsets[e + 1]) are expert e's inputs. Each
// expert's weights are streamed once for all its rows, QROWS_MOE rows at a time per weight row: at decode batch
// sizes an expert gets a handful of rows, and its weights (3 x hidden x inter) are what a step reads. In PyTorch the
// same work was ~8 dispatched ops per expert (slice, two linears, chunk, SiLU, multiply, copy): with 64-128 experts a
// layer, more time than the arithmetic. Sums in float32; the SiLU-and-mul result is rounded to T as PyTorch's is
// between the two linears; a pair's result does not depend on the other pairs.

constexpr int64_t MOE_BLOCK = 32;  // weight rows per task (tasks: expert x block of output rows)

template <class T>
static inline float moe_dot(const T* __restrict w, const T* __restrict x, int64_t n) {
    vecf a0 = {}, a1 = {};
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        a0 += loadv(w + i) * loadv(x + i);
        a1 += loadv(w + i + VL) * loadv(x + i + VL);
    }
    for (; i + VL <= n; i += VL) a0 += loadv(w + i) * loadv(x + i);
    a0 += a1;
    float sum = 0.f;
    for (int l = 0; l < VL; ++l) sum += a0[l];
    for (; i < n; ++i) sum += to_float(w[i]) * to_float(x[i]);
    return sum;
}

// act[r, j] = silu(gate_j . x_r) * (up_j . x_r) for j in [first, last) of expert e's rows r.
template <class T>
ROW_FN void moe_gate_up_block(const T* __restrict rows, const T* __restrict weight, T* __restrict act, int64_t begin,
                              int64_t end, int64_t first, int64_t last, int64_t hidden, int64_t inter) {
    for (int64_t j = first; j < last; ++j) {
        const T* gate = weight + j * hidden;
        const T* up = weight + (inter + j) * hidden;
        for (int64_t r = begin; r < end; ++r) {
            const float g = moe_dot(gate, rows + r * hidden, hidden);
            const float u = moe_dot(up, rows + r * hidden, hidden);
            act[r * inter + j] = from_float<T>(g / (1.f + exp_approx(-g)) * u);
        }
    }
}

// out[r, h] = down_h . act_r for h in [first, last).
template <class T>
ROW_FN void moe_down_block(const T* __restrict act, const T* __restrict weight, T* __restrict out, int64_t begin,
                           int64_t end, int64_t first, int64_t last, int64_t hidden, int64_t inter) {
    for (int64_t h = first; h < last; ++h) {
        const T* down = weight + h * inter;
        for (int64_t r = begin; r < end; ++r) out[r * hidden + h] = from_float<T>(moe_dot(down, act + r * inter, inter));
    }
}

// rows, out: [pairs, hidden]; gate_up: [experts, 2 * inter, hidden] (gate rows then up rows); down: [experts,
// hidden, inter]; act: scratch [pairs, inter].
template <class T>
static void moe_experts(const T* rows, const int64_t* offsets, int64_t num_experts, const T* gate_up, const T* down,
                        T* act, T* out, int64_t hidden, int64_t inter, int num_threads) {
    std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first weight row): the blocks of experts with rows
    for (int64_t e = 0; e < num_experts; ++e)
        if (offsets[e + 1] > offsets[e])
            for (int64_t first = 0; first < std::max(inter, hidden); first += MOE_BLOCK) tasks.emplace_back(e, first);
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for num_threads(num_threads) schedule(dynamic) if (num_threads > 1)
    for (int64_t t = 0; t < num_tasks; ++t) {
        const auto [e, first] = tasks[t];
        if (first < inter)
            moe_gate_up_block(rows, gate_up + e * 2 * inter * hidden, act, offsets[e], offsets[e + 1], first,
                              std::min(first + MOE_BLOCK, inter), hidden, inter);
    }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic) if (num_threads > 1)
    for (int64_t t = 0; t < num_tasks; ++t) {
        const auto [e, first] = tasks[t];
        if (first < hidden)
            moe_down_block(act, down + e * hidden * inter, out, offsets[e], offsets[e + 1], first,
                           std::min(first + MOE_BLOCK, hidden), hidden, inter);
    }
}
