// Linears on weights kept quantized (GGUF's Q4_0, Q4_1, Q4_K and Q8_0): included by cpu_kernels.cpp, which
// exports them (kernels/quantized.py packs the weights and calls them).
//
// A decode step of one stream streams every weight once; in bfloat16 that is 16 bits a weight, kept quantized 4.5-6.
// So the weight stays in its integers and the activations are quantized instead, per row and per block of 32 inputs,
// to int8 with one float scale (llama.cpp's Q8 activations): a block's dot product is then an exact integer sum on
// AVX-512 VNNI's vpdpbusd (64 byte products a instruction, twice vdpbf16ps' 32), scaled once in float32.
//
// Two layouts, each in groups of 16 output rows (QROWS) and blocks of 32 inputs (QBLOCK); a group's blocks follow one
// another, so a group's weights are one stream:
//   * q4 (Q4_0, Q4_1, Q4_K): w = scale * q + min, q in 0..15. A block: 256 bytes of nibbles, [4 chunks][16 rows][4],
//     chunk c's byte j of row r holding input 4c+j in its low nibble and input 16+4c+j in its high one; then the 16
//     rows' scales and mins, float32. Q4_0 is min = -8 scale; Q4_K's per-block scale d * sc and min -dmin * m are
//     exact in float32 (an 11-bit fp16 times a 6-bit integer). 384 bytes per 512 weights: 6 bits a weight.
//   * q8 (Q8_0): w = scale * q, q in -128..127. A block: 512 bytes, [8 chunks][16 rows][4]; the 16 scales (float32);
//     128 times each row's sum of q over the block (int32), which vpdpbusd's unsigned operand needs: the activations
//     go in as q + 128 and the sum removes the 128s, exactly. 640 bytes per 512 weights: 10 bits a weight.
// A block's contribution to a row's float32 sum: fma(float(integer dot), scale * dx, acc), then for q4
// fma(min, dx * sum(xq), acc): the same operations in the same order for every row whatever the batch, so a row's
// result never depends on the rows beside it. Vector and scalar code (machines without VNNI) give the same bits.

constexpr int64_t QBLOCK = 32;
constexpr int64_t QROWS = 16;
constexpr int64_t Q4_BLOCK_BYTES = 256 + 2 * 64;
constexpr int64_t Q8_BLOCK_BYTES = 512 + 2 * 64;
enum QuantFormat : int32_t { FORMAT_BF16_PAIRS = 0, FORMAT_Q4 = 1, FORMAT_Q8 = 2 };
// Activation rows per pass over a block's unpacked weights (registers: 8 weight vectors + QTILE accumulators).
constexpr int QTILE = 4;
// Rows per chunk of a large batch: a chunk's quantized activations stay in L2 while every group passes over them.
constexpr int64_t QCHUNK = 64;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && INFLIGHT_LANES == 16
#define INFLIGHT_QUANT_VNNI 1
#else
#define INFLIGHT_QUANT_VNNI 0
#endif

// One row of x quantized per block of 32: xq = round-half-even(x / d) with d = amax / 127 (0 for a zero block),
// dx[b] = d, sx[b] = d * sum(xq) (the q4 min's factor). Division as a multiply by 1 / d, as kernels/quantized.py's
// reference does.
template <class T>
static void quantize_row(const T* __restrict x, int64_t k, int8_t* __restrict xq, float* __restrict dx,
                         float* __restrict sx) {
    for (int64_t b = 0; b < k / QBLOCK; ++b) {
        float v[QBLOCK];
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; ++i) {
            v[i] = to_float(x[b * QBLOCK + i]);
            amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; ++i) {
            const int q = static_cast<int>(std::nearbyint(v[i] * id));
            xq[b * QBLOCK + i] = static_cast<int8_t>(q);
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * static_cast<float>(sum);
    }
}

// The 4 activation bytes of chunk c of a block, for vpdpbusd's broadcast operand (q8: made unsigned, q + 128).
template <int FORMAT>
static inline int32_t chunk_of(const int8_t* xb, int c) {
    uint32_t word;
    std::memcpy(&word, xb + 4 * c, 4);
    return static_cast<int32_t>(FORMAT == FORMAT_Q8 ? word ^ 0x80808080u : word);
}

// Rows [0, ROWS) of a tile against one group (16 output rows) over all nb blocks: acc[m * 16 + r].
template <int FORMAT, int ROWS>
static inline __attribute__((always_inline)) void quant_group_rows(const uint8_t* __restrict w, int64_t nb,
                                                                   const int8_t* __restrict xq, int64_t k,
                                                                   const float* __restrict dx,
                                                                   const float* __restrict sx, float* __restrict acc) {
    constexpr int64_t BYTES = FORMAT == FORMAT_Q4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    constexpr int64_t VALUES = FORMAT == FORMAT_Q4 ? 256 : 512;
#if INFLIGHT_QUANT_VNNI
    __m512 sums[ROWS];
    for (int m = 0; m < ROWS; ++m) sums[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w + b * BYTES;
        __m512i wv[8];
        if constexpr (FORMAT == FORMAT_Q4) {
            for (int c = 0; c < 4; ++c) {
                const __m512i raw = _mm512_loadu_si512(block + 64 * c);
                wv[c] = _mm512_and_si512(raw, low);
                wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        } else {
            for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(block + 64 * c);
        }
        const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(block + VALUES));
        const __m512i extra = _mm512_loadu_si512(block + VALUES + 64);  // q4: the mins; q8: 128 x sum(q)
        for (int m = 0; m < ROWS; ++m) {
            const int8_t* xb = xq + m * k + b * QBLOCK;
            __m512i dot = _mm512_setzero_si512();
            for (int c = 0; c < 8; ++c) {
                const __m512i a = _mm512_set1_epi32(chunk_of<FORMAT>(xb, c));
                dot = FORMAT == FORMAT_Q4 ? _mm512_dpbusd_epi32(dot, wv[c], a) : _mm512_dpbusd_epi32(dot, a, wv[c]);
            }
            if constexpr (FORMAT == FORMAT_Q8) dot = _mm512_sub_epi32(dot, extra);
            const float d = dx[m * (k / QBLOCK) + b];
            sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d)), sums[m]);
            if constexpr (FORMAT == FORMAT_Q4)
                sums[m] = _mm512_fmadd_ps(_mm512_castsi512_ps(extra), _mm512_set1_ps(sx[m * (k / QBLOCK) + b]),
                                          sums[m]);
        }
    }
    for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(acc + m * QROWS, sums[m]);
#else
    for (int m = 0; m < ROWS; ++m)
        for (int r = 0; r < QROWS; ++r) acc[m * QROWS + r] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w + b * BYTES;
        float scale[QROWS];
        int32_t extra[QROWS];
        std::memcpy(scale, block + VALUES, sizeof(scale));
        std::memcpy(extra, block + VALUES + 64, sizeof(extra));
        for (int m = 0; m < ROWS; ++m) {
            const int8_t* xb = xq + m * k + b * QBLOCK;
            const float d = dx[m * (k / QBLOCK) + b];
            for (int r = 0; r < QROWS; ++r) {
                int32_t dot = 0;
                for (int i = 0; i < QBLOCK; ++i) {
                    int q;
                    if constexpr (FORMAT == FORMAT_Q4) {
                        const uint8_t byte = block[(i % 16) / 4 * 64 + r * 4 + i % 4];
                        q = i < 16 ? byte & 15 : byte >> 4;
                    } else {
                        q = static_cast<int8_t>(block[i / 4 * 64 + r * 4 + i % 4]);
                    }
                    dot += q * xb[i];
                }
                float& sum = acc[m * QROWS + r];
                sum = std::fma(static_cast<float>(dot), scale[r] * d, sum);
                if constexpr (FORMAT == FORMAT_Q4) {
                    float mn;
                    std::memcpy(&mn, &extra[r], 4);
                    sum = std::fma(mn, sx[m * (k / QBLOCK) + b], sum);
                }
            }
        }
    }
#endif
}

template <int FORMAT, int R = QTILE>
static inline void quant_group_tail(int rows, const uint8_t* w, int64_t nb, const int8_t* xq, int64_t k,
                                    const float* dx, const float* sx, float* acc) {
    if constexpr (R > 0) {
        if (rows == R) quant_group_rows<FORMAT, R>(w, nb, xq, k, dx, sx, acc);
        else quant_group_tail<FORMAT, R - 1>(rows, w, nb, xq, k, dx, sx, acc);
    }
}

// y [num_rows, n] (row stride ldy) = x [num_rows, k] (row stride stride_x) W^T + bias, W packed in FORMAT (q4 or q8)
// by kernels/quantized.py; k a multiple of 32.
template <int FORMAT, class T, class O>
static void quant_linear(const T* x, const uint8_t* packed, const T* bias, O* y, int64_t num_rows, int64_t n,
                         int64_t k, int64_t stride_x, int64_t ldy, int num_threads) {
    constexpr int64_t BYTES = FORMAT == FORMAT_Q4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    const int64_t nb = k / QBLOCK;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> dx, sx;
    xq.resize(num_rows * k);
    dx.resize(num_rows * nb);
    sx.resize(num_rows * nb);
    int8_t* xq_data = xq.data();
    float *dx_data = dx.data(), *sx_data = sx.data();
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_rows * k))
    for (int64_t r = 0; r < num_rows; ++r)
        quantize_row(x + r * stride_x, k, xq_data + r * k, dx_data + r * nb, sx_data + r * nb);
    const int64_t groups = (n + QROWS - 1) / QROWS;
    const int64_t chunks = (num_rows + QCHUNK - 1) / QCHUNK;
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_rows * n * k / 8))
    for (int64_t t = 0; t < chunks * groups; ++t) {
        const int64_t chunk = t / groups, g = t % groups;
        const uint8_t* w = packed + g * nb * BYTES;
        const int64_t cols = std::min(QROWS, n - g * QROWS);
        const int64_t end = std::min(num_rows, (chunk + 1) * QCHUNK);
        float acc[QTILE * QROWS];
        for (int64_t m0 = chunk * QCHUNK; m0 < end; m0 += QTILE) {
            const int rows = static_cast<int>(std::min<int64_t>(QTILE, end - m0));
            quant_group_tail<FORMAT>(rows, w, nb, xq_data + m0 * k, k, dx_data + m0 * nb, sx_data + m0 * nb, acc);
            for (int m = 0; m < rows; ++m) {
                O* dst = y + (m0 + m) * ldy + g * QROWS;
                for (int64_t c = 0; c < cols; ++c) {
                    const float v = acc[m * QROWS + c];
                    dst[c] = from_float<O>(bias != nullptr ? v + to_float(bias[g * QROWS + c]) : v);
                }
            }
        }
    }
}

// Rows `ids` of W (an embedding) dequantized: out[i] = fma(scale, q, min) (q4) or scale * q (q8), rounded once to T.
template <int FORMAT, class T>
static void quant_rows(const uint8_t* packed, const int64_t* ids, int64_t num_ids, int64_t k, T* out,
                       int num_threads) {
    constexpr int64_t BYTES = FORMAT == FORMAT_Q4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    constexpr int64_t VALUES = FORMAT == FORMAT_Q4 ? 256 : 512;
    const int64_t nb = k / QBLOCK;
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_ids * k))
    for (int64_t i = 0; i < num_ids; ++i) {
        const int64_t g = ids[i] / QROWS, r = ids[i] % QROWS;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* block = packed + (g * nb + b) * BYTES;
            float scale, mn = 0.0f;
            std::memcpy(&scale, block + VALUES + 4 * r, 4);
            if constexpr (FORMAT == FORMAT_Q4) std::memcpy(&mn, block + VALUES + 64 + 4 * r, 4);
            for (int j = 0; j < QBLOCK; ++j) {
                float v;
                if constexpr (FORMAT == FORMAT_Q4) {
                    const uint8_t byte = block[(j % 16) / 4 * 64 + r * 4 + j % 4];
                    v = std::fma(scale, static_cast<float>(j < 16 ? byte & 15 : byte >> 4), mn);
                } else {
                    v = scale * static_cast<float>(static_cast<int8_t>(block[j / 4 * 64 + r * 4 + j % 4]));
                }
                out[i * k + b * QBLOCK + j] = from_float<T>(v);
            }
        }
    }
}

// A linear of any format: what decode_layers_bf16 and kernels/quantized.py's QuantLinear hand over. data: the packed
// weight (bf16 pairs, q4 or q8); bias nullptr where none.
struct LinearWeight {
    const void* data;
    const bf16* bias;
    int64_t format;
};

template <class O>
static void any_linear(const LinearWeight& w, const bf16* x, O* y, int64_t num_rows, int64_t n, int64_t k,
                       int64_t stride_x, int num_threads) {
    const auto* packed = static_cast<const uint8_t*>(w.data);
    if (w.format == FORMAT_Q4)
        quant_linear<FORMAT_Q4>(x, packed, w.bias, y, num_rows, n, k, stride_x, n, num_threads);
    else if (w.format == FORMAT_Q8)
        quant_linear<FORMAT_Q8>(x, packed, w.bias, y, num_rows, n, k, stride_x, n, num_threads);
#if INFLIGHT_BF16_DOT
    else
        linear_pairs(x, static_cast<const bf16*>(w.data), w.bias, y, num_rows, n, k, stride_x, num_threads);
#endif
}
