// CPU kernels (float32 and bfloat16), called through ctypes by kernels/cpu_kernels.py.
//
// Every kernel is a template on the storage type T of its tensors: float, or bf16 (bfloat16's 16 bits). The
// arithmetic is float32 either way: a bf16 value widens exactly to a float on load (a shift), and a result is
// rounded to the nearest even bf16 once, on store. So a bf16 product is exact in float32 and sums accumulate in
// float32, as AVX-512 BF16's vdpbf16ps and AMX do; what bf16 saves is half the bytes read (the decode steps
// are memory-bound). Each kernel is exported twice, NAME_f32 and NAME_bf16.
//
// Decode attention over the paged KV cache, reading each row's context where it lies.
//
// The PyTorch path (kernels/torch_ref.py) gathers every decode row's context into one contiguous
// copy, then multiplies: for a single query token that copy costs more than the attention itself,
// and it streams the whole live cache through the caches twice. Here each (row, kv head) task walks
// its block table and reads every K and V vector once, in place.
//
// Layout (TorchPagedAttention's, head-major): cache [num_kv_heads, num_blocks, block_size, head_dim].
// Per task: scores of the group's query heads against every visible key (pass 1), a softmax per head
// (pass 2), then the weighted sum of V (pass 3). Built with -O3 -march=native; where GCC's own vectorisation
// fell short (accumulators kept in memory, loops inlined into OpenMP bodies left scalar) the code is written on
// GCC's vector types (vecf below), which any target lowers to its widest registers. Tasks split over OpenMP
// threads (the process's libgomp: torch's, already loaded).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// VL floats as one value of GCC's vector extension, VL the target's widest float register: 16 (a zmm) with
// AVX-512, else 8 (a ymm with AVX2; two xmm without). Written as locals, a tile's accumulators stay in registers;
// as the plain float arrays this kernel had, GCC kept them in memory and loaded and stored them around every FMA
// (the causal kernel: 3.2 ms a layer for 425 tokens x 8 heads x 32 on a Sapphire Rapids VM, against 1.4 ms on
// vectors). The width must be the register's: 16 lanes on an AVX2 machine (two ymm per value, half the register
// file per array of them) spilled every accumulator and ran the decode kernel 4x and the causal kernel 7x slower
// than plain loops (a Zen 3 VM, 2026-12-04). Unaligned loads and stores through memcpy.
// INFLIGHT_LANES (kernels/cpu_kernels.py's INFLIGHT_CPU_KERNEL_LANES) sets the width by hand: the tests build
// both widths, so the AVX-512 code runs, slowly, on a machine without it.
#if !defined(INFLIGHT_LANES)
#if defined(__AVX512F__)
#define INFLIGHT_LANES 16
#else
#define INFLIGHT_LANES 8
#endif
#endif
constexpr int VL = INFLIGHT_LANES;
// bf16 kernels on AVX-512 BF16's dot-product instructions where the build has them (16 lanes), else widened.
#if defined(__AVX512BF16__) && INFLIGHT_LANES == 16
#define INFLIGHT_BF16_DOT 1
#else
#define INFLIGHT_BF16_DOT 0
#endif

typedef float vecf __attribute__((vector_size(VL * 4)));
typedef int veci __attribute__((vector_size(VL * 4)));
typedef unsigned vecu __attribute__((vector_size(VL * 4)));
typedef uint16_t bf16;  // a bfloat16's bits: a float32's top half
typedef uint16_t vech __attribute__((vector_size(VL * 2)));
static inline vecf loadv(const float* p) { vecf v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline void storev(float* p, vecf v) { std::memcpy(p, &v, sizeof(v)); }
static inline vecf loadv(const bf16* p) {
    vech h;
    std::memcpy(&h, p, sizeof(h));
    return (vecf)(__builtin_convertvector(h, vecu) << 16);
}
// Round to nearest, ties to even (torch's .to(torch.bfloat16)); a NaN stays a (quiet) NaN.
static inline void storev(bf16* p, vecf v) {
    const vecu u = (vecu)v;
    const vecu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vech h = __builtin_convertvector((v != v) ? ((u >> 16) | 0x40u) : rounded, vech);
    std::memcpy(p, &h, sizeof(h));
}
static inline float to_float(float x) { return x; }
static inline float to_float(bf16 h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
}
template <class T> static inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    return static_cast<bf16>(x != x ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// exp(x) in a form the compiler vectorises (std::exp is a scalar call): Cephes' expf, 2^n * exp(r) with
// |r| <= ln(2)/2 and a degree-6 polynomial, within 2 ulp of expf. Inputs below -87 give exp(-87)
// (~1.6e-38) instead of a smaller number: a weight nobody can tell from zero next to exp(0) = 1. One body for a
// float (loops the compiler vectorises) and for VL lanes (loops written on vectors): the same operations in the
// same order, only the clamp, the floor (on lanes: truncation, then one down where that rounded up) and 2^n differ.
static inline float exp_clamp(float x) { return x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); }
static inline vecf exp_clamp(vecf x) {
    const vecf zero = {};
    x = x < -87.0f ? zero - 87.0f : x;
    return x > 88.0f ? zero + 88.0f : x;
}
static inline float floor_of(float t) { return __builtin_floorf(t); }
static inline vecf floor_of(vecf t) {
    const vecf n = __builtin_convertvector(__builtin_convertvector(t, veci), vecf);
    return n > t ? n - 1.0f : n;
}
static inline float pow2(float n) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return scale;
}
static inline vecf pow2(vecf n) {
    const veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
    vecf scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return scale;
}

template <class T>
static inline __attribute__((always_inline)) T exp_approx(T x) {
    x = exp_clamp(x);
    const T n = floor_of(x * 1.44269504088896341f + 0.5f);
    const T r = x - n * 0.693359375f + n * 2.12194440e-4f;
    T y = T{} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    return y * pow2(n);
}

// Blocks are scattered: the hardware prefetcher cannot guess the next one, so ask for it while the current
// one is being read (a block of one head is block_size * head_dim contiguous values), a 64-byte line at a time.
template <class T>
static inline void prefetch_block(const T* block, int64_t num_values) {
    for (int64_t i = 0; i < num_values; i += 64 / sizeof(T)) __builtin_prefetch(block + i, 0, 1);
}

// The largest of s[0 .. n), as a scalar loop from s[0] finds it: NaN never replaces a number (a lane holding NaN
// takes the next number), and a NaN s[0] stays.
static inline float max_of(const float* s, int64_t n) {
    float best = s[0];
    int64_t j = 0;
    if (n >= VL) {
        vecf m = loadv(s);
        for (j = VL; j + VL <= n; j += VL) {
            const vecf v = loadv(s + j);
            m = ((v > m) | (m != m)) ? v : m;
        }
        for (int64_t i = 0; i < VL; ++i) best = m[i] > best ? m[i] : best;
    }
    for (; j < n; ++j) best = s[j] > best ? s[j] : best;
    return best;
}

// s[j] <- exp(s[j] - max(s)) for j < n; returns their sum: a softmax before its division.
static inline float exp_in_place(float* __restrict s, int64_t n) {
    const float m = max_of(s, n);
    vecf sums = {};  // on lanes: an omp simd loop kept its reduction's lanes in memory (0.75 of the causal kernel's
    int64_t j = 0;    // 1.4 ms for 425 tokens x 8 heads went to its softmax; ~0.6 after)
    for (; j + VL <= n; j += VL) {
        const vecf e = exp_approx(loadv(s + j) - m);
        storev(s + j, e);
        sums += e;
    }
    float sum = 0.f;
    for (int i = 0; i < VL; ++i) sum += sums[i];
    for (; j < n; ++j) {
        s[j] = exp_approx(s[j] - m);
        sum += s[j];
    }
    return sum;
}

// The sums of VL vectors, as one vector (lane j: the sum of v[j]'s lanes): pairs of vectors folded into one
// of half-length partial sums, log2(VL) times. VL - 1 shuffle pairs and adds for VL dot products, where one
// horizontal sum per dot product costs about as many each. Fold k keeps, from each pair, lanes in runs of
// VL >> (k + 1): lo the first run of each two, hi the second; each level halves the number of vectors.
static inline vecf fold(vecf a, vecf b, veci lo, veci hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
#if INFLIGHT_LANES == 16
constexpr int FOLDS = 4;
static const veci FOLD_LO[FOLDS] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                                    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                                    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
#elif INFLIGHT_LANES == 8
constexpr int FOLDS = 3;
static const veci FOLD_LO[FOLDS] = {{0, 1, 2, 3, 8, 9, 10, 11},
                                    {0, 1, 4, 5, 8, 9, 12, 13},
                                    {0, 2, 4, 6, 8, 10, 12, 14}};
#else
#error "INFLIGHT_LANES must be 8 or 16"
#endif
static_assert(1 << FOLDS == VL, "one fold per halving");
static inline __attribute__((always_inline)) vecf sum_each(const vecf* v) {
    vecf level[VL];
    for (int i = 0; i < VL; ++i) level[i] = v[i];
    int count = VL;
#pragma GCC unroll 4
    for (int k = 0; k < FOLDS; ++k) {
        const veci lo = FOLD_LO[k];
        const veci hi = lo + (VL >> (k + 1));  // the run after each kept one
        count /= 2;
#pragma GCC unroll 8
        for (int i = 0; i < count; ++i) level[i] = fold(level[2 * i], level[2 * i + 1], lo, hi);
    }
    return level[0];
}

// Pass 2 of a decode task: scores [rows, n] <- exp(s - max) per row, inv_sum[row] <- 1 / their sum (the softmax,
// normalised when the values are summed).
static inline void softmax_rows(float* __restrict scores, int64_t rows, int64_t n, float* __restrict inv_sum) {
    for (int64_t r = 0; r < rows; ++r) inv_sum[r] = 1.f / exp_in_place(scores + r * n, n);
}

// Between passes 1 and 2, for a sliding-window or soft-capped layer (Gemma, Mistral): each score capped to
// softcap * tanh(score / softcap) (softcap > 0), then the first ``hidden`` keys (the part of the window's first
// block before the window) hidden. Every row keeps a visible key: its own.
static void window_and_cap(float* __restrict scores, int64_t rows, int64_t n, int64_t hidden, float softcap) {
    for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * n;
        if (softcap > 0.f)
            for (int64_t t = 0; t < n; ++t) row[t] = softcap * std::tanh(row[t] / softcap);
        for (int64_t t = 0; t < hidden; ++t) row[t] = -INFINITY;
    }
}

#if INFLIGHT_BF16_DOT
// Pass 1 of decode_task in bf16 on dot products: scores[g, t] = scale * q_g . k_t, 32 dimensions of a key per
// vdpbf16ps (half the instructions of widening and fusing multiply-adds), then summed as sum_each sums VL keys.
// head_dim a multiple of 32.
template <int HEAD_DIM>
static void decode_scores_dot(const bf16* __restrict query, const bf16* __restrict k_head,
                              const bf16* __restrict v_head, const int64_t* __restrict table, int64_t seq_len,
                              int64_t group,
                              int64_t runtime_head_dim, int64_t block_size, float scale, float* __restrict scores) {
    const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int W = static_cast<int>(head_dim / 32);
    constexpr int W_MAX = (HEAD_DIM > 0 ? HEAD_DIM : 256) / 32;
    const int64_t block_values = block_size * head_dim;
    for (int64_t first = 0; first < seq_len; first += block_size) {
        const bf16* __restrict k = k_head + table[first / block_size] * block_values;
        const int64_t n = std::min(block_size, seq_len - first);
        if (first + block_size < seq_len) {
            prefetch_block(k_head + table[first / block_size + 1] * block_values, block_values);
            // and this block's V into L2 for pass 3, which then reads it from there: 10% less time at 13-16 rows
            prefetch_block(v_head + table[first / block_size] * block_values, block_values);
        }
        for (int64_t j0 = 0; j0 < n; j0 += VL) {
            const int64_t keys = std::min<int64_t>(VL, n - j0);
            for (int64_t g = 0; g < group; ++g) {
                __m512bh q[W_MAX];
                for (int c = 0; c < W; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + g * head_dim + c * 32);
                vecf prod[VL];
                for (int64_t j = 0; j < VL; ++j) {
                    __m512 p = _mm512_setzero_ps();
                    if (j < keys) {
                        const bf16* kj = k + (j0 + j) * head_dim;
                        for (int c = 0; c < W; ++c)
                            p = _mm512_dpbf16_ps(p, q[c], (__m512bh)_mm512_loadu_si512(kj + c * 32));
                    }
                    prod[j] = (vecf)p;
                }
                const vecf dots = sum_each(prod) * scale;
                float* dst = scores + g * seq_len + first + j0;
                if (keys == VL) storev(dst, dots);
                else for (int64_t j = 0; j < keys; ++j) dst[j] = dots[j];
            }
        }
    }
}

// Two keys' rows of V (32 dimensions each) as pairs for vdpbf16ps: lane i of ``lo`` and ``hi`` holds the two keys'
// values of one dimension. unpacklo/hi interleave within 128-bit lanes, which scrambles the dimensions: lo holds
// 0-3, 8-11, 16-19, 24-27 and hi the others, so sums over pairs come out scrambled too, and unscrambled_values
// puts them back in order once, at the end.
static inline __attribute__((always_inline)) void value_pairs(__m512i x, __m512i y, __m512bh& lo, __m512bh& hi) {
    lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
    hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
}

// Dimensions 0-15 (``half`` 0) or 16-31 (1) of sums over value_pairs' lo and hi lanes, in order.
static inline __attribute__((always_inline)) vecf unscrambled_values(__m512 lo, __m512 hi, int half) {
    static const __m512i order[2] = {_mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                                     _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)};
    return (vecf)_mm512_permutex2var_ps(lo, order[half], hi);
}

// dst[0 .. n) = src's values rounded to bf16 as from_float<bf16> rounds them (to nearest even; NaN kept quiet), 16
// at a time: in pass 3's loop, rounding two weights per pair in scalar code cost more than the dot products.
static inline void round_to_bf16(const float* __restrict src, bf16* __restrict dst, int64_t n) {
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(lanes, src + i);
        const __m512i u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(high, one)), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(high, quiet));
        _mm256_mask_storeu_epi16(dst + i, lanes, _mm512_cvtepi32_epi16(r));
    }
}

// Pass 3 of decode_task in bf16 on dot products: out_g = inv_sum_g * sum_t p[g, t] v_t, two keys per vdpbf16ps.
// The weights come rounded to bf16 (``probs``, rows ``prob_stride`` apart: as transformers' bf16 attention rounds
// them before its matmul), a pair of them one 32-bit broadcast; two rows of V are interleaved into pairs
// (value_pairs). A block's odd last key pairs with a zero. Query heads in chunks whose accumulators fit registers.
template <int HEAD_DIM>
static void decode_values_dot(const bf16* __restrict probs, int64_t prob_stride, const bf16* __restrict v_head,
                              const int64_t* __restrict table, int64_t seq_len, int64_t group,
                              int64_t runtime_head_dim, int64_t block_size, const float* __restrict inv_sum,
                              bf16* __restrict out) {
    const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int W = static_cast<int>(head_dim / 32);
    constexpr int W_MAX = (HEAD_DIM > 0 ? HEAD_DIM : 256) / 32;
    constexpr int G_CHUNK = HEAD_DIM > 0 && HEAD_DIM <= 64 ? 4 : (HEAD_DIM == 128 ? 2 : 1);
    const int64_t block_values = block_size * head_dim;
    for (int64_t g0 = 0; g0 < group; g0 += G_CHUNK) {
        const int64_t gs = std::min<int64_t>(G_CHUNK, group - g0);
        __m512 a[G_CHUNK][2 * W_MAX];
        for (int g = 0; g < G_CHUNK; ++g)
            for (int c = 0; c < 2 * W; ++c) a[g][c] = _mm512_setzero_ps();
        for (int64_t first = 0; first < seq_len; first += block_size) {
            const bf16* __restrict v = v_head + table[first / block_size] * block_values;
            const int64_t n = std::min(block_size, seq_len - first);
            if (first + block_size < seq_len) prefetch_block(v_head + table[first / block_size + 1] * block_values, block_values);
            for (int64_t j = 0; j < n; j += 2) {
                const bool pair = j + 1 < n;
                __m512bh lo[W_MAX], hi[W_MAX];
                for (int c = 0; c < W; ++c)
                    value_pairs(_mm512_loadu_si512(v + j * head_dim + c * 32),
                                pair ? _mm512_loadu_si512(v + (j + 1) * head_dim + c * 32) : _mm512_setzero_si512(),
                                lo[c], hi[c]);
                for (int64_t g = 0; g < gs; ++g) {
                    const bf16* p = probs + (g0 + g) * prob_stride + first + j;
                    uint32_t bits = p[0];
                    if (pair) std::memcpy(&bits, p, 4);  // (little-endian: p[0] in the low half)
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
                    for (int c = 0; c < W; ++c) {
                        a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], w, lo[c]);
                        a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], w, hi[c]);
                    }
                }
            }
        }
        for (int64_t g = 0; g < gs; ++g) {
            const vecf norm = vecf{} + inv_sum[g0 + g];
            for (int c = 0; c < W; ++c) {
                bf16* dst = out + (g0 + g) * head_dim + c * 32;
                storev(dst, unscrambled_values(a[g][2 * c], a[g][2 * c + 1], 0) * norm);
                storev(dst + 16, unscrambled_values(a[g][2 * c], a[g][2 * c + 1], 1) * norm);
            }
        }
    }
}
#endif

// One (row, kv head) task: the group's query heads against the row's visible keys, in three passes: the scores
// (VL keys' dot products summed together by sum_each), a softmax per query head, the weighted sum of V (a block
// at a time, each query head's accumulators in registers). head_dim is a multiple of 16: HEAD_DIM / VL vectors
// per key, HEAD_DIM a compile-time constant for the common sizes and 0 for the runtime ``head_dim`` (at most
// 256). ``scores`` holds group * seq_len floats, ``acc`` group * head_dim. 14 rows x 500 tokens (8 heads of 32, 4 kv
// heads): 0.58 ms as plain loops (dot products summed one key at a time, accumulators in memory) against 0.44 on
// vectors on the Sapphire Rapids VM; 0.26 against 0.20 on the Zen 3 VM.
template <int HEAD_DIM, class T>
static void decode_task(const T* __restrict query, const T* __restrict k_head,
                        const T* __restrict v_head, const int64_t* __restrict table, int64_t seq_len,
                        T* __restrict out, int64_t group, int64_t runtime_head_dim, int64_t block_size,
                        float scale, float* __restrict scores, float* __restrict acc, int64_t hidden, float softcap) {
    static_assert(HEAD_DIM % 16 == 0 && 16 % VL == 0, "whole vectors per key");
    const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int V = static_cast<int>(head_dim / VL);
    constexpr int V_MAX = (HEAD_DIM > 0 ? HEAD_DIM : 256) / VL;
    const int64_t block_floats = block_size * head_dim;
    // pass 1: scores[g, t] = q_g . k_t, VL keys at a time for every query head of the group, so each key is read
    // from memory once (from L1 for the group's other heads): with the heads outside the walk, a group of 2 read
    // the cache twice and took 2.6x as long on a Zen 3 VM with slow scattered reads. Until pass 3, ``acc`` holds
    // the scaled queries. (bf16 where the build has AVX-512 BF16: passes 1 and 3 on dot products.)
    float inv_sum[64];
#if INFLIGHT_BF16_DOT
    if constexpr (sizeof(T) == sizeof(bf16)) {
        if (head_dim % 32 == 0) {
            decode_scores_dot<HEAD_DIM>(query, k_head, v_head, table, seq_len, group, head_dim, block_size, scale, scores);
            if (hidden > 0 || softcap > 0.f) window_and_cap(scores, group, seq_len, hidden, softcap);
            softmax_rows(scores, group, seq_len, inv_sum);
            thread_local std::vector<bf16> probs;
            probs.resize(group * seq_len);
            for (int64_t g = 0; g < group; ++g) round_to_bf16(scores + g * seq_len, probs.data() + g * seq_len, seq_len);
            decode_values_dot<HEAD_DIM>(probs.data(), seq_len, v_head, table, seq_len, group, head_dim, block_size,
                                        inv_sum, out);
            return;
        }
    }
#endif
    float* __restrict q_scaled = acc;
    for (int64_t i = 0; i < group * head_dim; ++i) q_scaled[i] = to_float(query[i]) * scale;
    for (int64_t first = 0; first < seq_len; first += block_size) {
        const T* __restrict k = k_head + table[first / block_size] * block_floats;
        const int64_t n = std::min(block_size, seq_len - first);
        if (first + block_size < seq_len) prefetch_block(k_head + table[first / block_size + 1] * block_floats, block_floats);
        for (int64_t j0 = 0; j0 < n; j0 += VL) {
            const int64_t keys = std::min<int64_t>(VL, n - j0);
            for (int64_t g = 0; g < group; ++g) {
                vecf q[V_MAX];
                for (int c = 0; c < V; ++c) q[c] = loadv(q_scaled + g * head_dim + c * VL);
                vecf prod[VL];
                for (int64_t j = 0; j < VL; ++j) {
                    vecf p = {};
                    if (j < keys) {
                        const T* kj = k + (j0 + j) * head_dim;
                        for (int c = 0; c < V; ++c) p += q[c] * loadv(kj + c * VL);
                    }
                    prod[j] = p;
                }
                const vecf dots = sum_each(prod);
                float* dst = scores + g * seq_len + first + j0;
                if (keys == VL) storev(dst, dots);
                else for (int64_t j = 0; j < keys; ++j) dst[j] = dots[j];
            }
        }
    }
    if (hidden > 0 || softcap > 0.f) window_and_cap(scores, group, seq_len, hidden, softcap);
    softmax_rows(scores, group, seq_len, inv_sum);
    // pass 3: out_g = sum_t p[g, t] v_t, a block of V at a time for every query head of the group
    std::fill_n(acc, group * head_dim, 0.f);
    for (int64_t first = 0; first < seq_len; first += block_size) {
        const T* __restrict v = v_head + table[first / block_size] * block_floats;
        const int64_t n = std::min(block_size, seq_len - first);
        if (first + block_size < seq_len) prefetch_block(v_head + table[first / block_size + 1] * block_floats, block_floats);
        for (int64_t g = 0; g < group; ++g) {
            const float* __restrict p = scores + g * seq_len + first;
            vecf a[V_MAX];
            for (int c = 0; c < V; ++c) a[c] = loadv(acc + g * head_dim + c * VL);
            for (int64_t j = 0; j < n; ++j)
                for (int c = 0; c < V; ++c) a[c] += p[j] * loadv(v + j * head_dim + c * VL);
            for (int c = 0; c < V; ++c) storev(acc + g * head_dim + c * VL, a[c]);
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < V; ++c) storev(out + g * head_dim + c * VL, loadv(acc + g * head_dim + c * VL) * inv_sum[g]);
}

// Parallel only when there is enough work: a parallel region costs more than a small pass.
static inline bool worth_threads(int64_t elements) { return elements >= (1 << 15); }

// Causal self-attention of one prompt chunk with nothing cached before it (a fresh prompt's prefill).
//
// torch's fused CPU SDPA runs ~21 GFLOP/s here at head_dim 32 (4.4 ms a layer for 425 tokens and 8 heads on
// the benchmark machine): its tiles suit larger heads. This kernel keeps each kv head's keys transposed
// ([head_dim, keys], built once per call) so a score tile is an outer-product sweep: for each of head_dim
// steps, CAUSAL_ROWS query values broadcast against KEY_VEC consecutive keys (one vector), no horizontal sums.
// Then an exact softmax per row over its visible keys, then the weighted sum of V with CAUSAL_ROWS rows of
// accumulators. A task is one query head and one tile of rows; tiles of later rows see more keys, so tasks
// are handed out dynamically.
constexpr int64_t CAUSAL_ROWS = 8;
constexpr int64_t KEY_VEC = VL;
// The V pass sweeps COL_VECS vectors of columns per row at a time: 2 x 8 rows = 16 of AVX-512's 32 registers;
// with 16 registers (AVX2) one per row, or the accumulators spill.
constexpr int COL_VECS = VL == 16 ? 2 : 1;

// The causal kernels' tasks: one query head and one tile of CAUSAL_ROWS rows each, handed out dynamically (tiles of
// later rows see more keys), the heaviest first; ``tile(head, kv_head, first_row, rows, scores)`` with a scores
// buffer of CAUSAL_ROWS x keys_stride per thread.
template <class Tile>
static void for_each_causal_tile(int64_t num_tokens, int64_t num_heads, int64_t group, int64_t keys_stride,
                                 int num_threads, Tile tile) {
    const int64_t num_tiles = (num_tokens + CAUSAL_ROWS - 1) / CAUSAL_ROWS;
    const int64_t num_tasks = num_heads * num_tiles;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores(CAUSAL_ROWS * keys_stride);
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = num_tasks - 1; task >= 0; --task) {  // the heaviest tiles (the last rows) first
            const int64_t head = task % num_heads, first_row = task / num_heads * CAUSAL_ROWS;
            tile(head, head / group, first_row, std::min(CAUSAL_ROWS, num_tokens - first_row), scores.data());
        }
    }
}

// A causal tile's softmax, once its scores [CAUSAL_ROWS, padded_keys] are in: row r's scores over the keys it sees
// (0 .. first_row + r) <- exp(s - max), inv_sum[r] <- 1 / their sum; the keys after it and the padding rows: zero.
static void causal_softmax(float* __restrict scores, int64_t padded_keys, int64_t first_row, int64_t num_rows,
                           float* __restrict inv_sum) {
    const int64_t num_keys = first_row + num_rows;
    for (int64_t r = 0; r < num_rows; ++r) {
        float* __restrict s = scores + r * padded_keys;
        const int64_t visible = first_row + r + 1;
        inv_sum[r] = 1.f / exp_in_place(s, visible);
        for (int64_t j = visible; j < num_keys; ++j) s[j] = 0.f;  // the keys after the row: masked
    }
    for (int64_t r = num_rows; r < CAUSAL_ROWS; ++r) {
        std::fill_n(scores + r * padded_keys, num_keys, 0.f);
        inv_sum[r] = 0.f;
    }
}

// A causal tile's V pass after causal_softmax: out_r = inv_sum_r * sum_j p[r, j] v_j in float32 (V widened as it
// is read), COL_VECS vectors of columns at a time: each V row read once per sweep for the tile's rows.
template <class T>
static void causal_values(const float* __restrict scores, int64_t padded_keys, const T* __restrict value,
                          T* __restrict out, int64_t first_row, int64_t num_rows, int64_t head, int64_t kv_head,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const float* __restrict inv_sum) {
    const int64_t num_keys = first_row + num_rows;
    const int64_t v_stride = num_kv_heads * head_dim;
    const T* v_head = value + kv_head * head_dim;
    for (int64_t c0 = 0; c0 < head_dim; c0 += COL_VECS * KEY_VEC) {
        vecf a[CAUSAL_ROWS][COL_VECS] = {};
        for (int64_t j = 0; j <= first_row; ++j) {  // keys every row of the tile sees
            vecf v[COL_VECS];
            for (int c = 0; c < COL_VECS; ++c) v[c] = loadv(v_head + j * v_stride + c0 + c * KEY_VEC);
#pragma GCC unroll 8
            for (int64_t r = 0; r < CAUSAL_ROWS; ++r) {
                const float p = scores[r * padded_keys + j];
                for (int c = 0; c < COL_VECS; ++c) a[r][c] += p * v[c];
            }
        }
        // The tile's own later keys, each only for the rows that see it: a weight of zero would still carry a
        // later token's inf or NaN into an earlier row (0 * inf), and attention must not look ahead even then.
        for (int64_t j = first_row + 1; j < num_keys; ++j) {
            vecf v[COL_VECS];
            for (int c = 0; c < COL_VECS; ++c) v[c] = loadv(v_head + j * v_stride + c0 + c * KEY_VEC);
#pragma GCC unroll 8
            for (int64_t r = 0; r < CAUSAL_ROWS; ++r) {
                if (r < j - first_row || r >= num_rows) continue;
                const float p = scores[r * padded_keys + j];
                for (int c = 0; c < COL_VECS; ++c) a[r][c] += p * v[c];
            }
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < CAUSAL_ROWS; ++r) {
            if (r >= num_rows) continue;
            T* __restrict dst = out + ((first_row + r) * num_heads + head) * head_dim + c0;
            for (int c = 0; c < COL_VECS; ++c) storev(dst + c * KEY_VEC, a[r][c] * inv_sum[r]);
        }
    }
}

template <int HEAD_DIM, class T>
static void causal_tile(const T* __restrict query, const float* __restrict kt, const T* __restrict value,
                        T* __restrict out, int64_t first_row, int64_t num_rows, int64_t head, int64_t kv_head,
                        int64_t num_heads, int64_t num_kv_heads, int64_t runtime_head_dim, int64_t keys_stride,
                        float scale, float* __restrict scores) {
    static_assert(HEAD_DIM % 32 == 0 && 32 % (COL_VECS * KEY_VEC) == 0, "head_dim in whole sweeps of columns");
    const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int64_t num_keys = first_row + num_rows;  // the tile's last row sees keys 0 .. first_row + num_rows - 1
    const int64_t padded_keys = (num_keys + KEY_VEC - 1) / KEY_VEC * KEY_VEC;
    float q[CAUSAL_ROWS][HEAD_DIM > 0 ? HEAD_DIM : 256];
    for (int64_t r = 0; r < CAUSAL_ROWS; ++r)
        for (int64_t d = 0; d < head_dim; ++d)
            q[r][d] = r < num_rows ? to_float(query[((first_row + r) * num_heads + head) * head_dim + d]) * scale : 0.f;
    // scores[r, j] = q_r . k_j, KEY_VEC keys at a time (kt is zero past the last key, so the tail is harmless)
    for (int64_t j0 = 0; j0 < padded_keys; j0 += KEY_VEC) {
        vecf acc[CAUSAL_ROWS] = {};
        for (int64_t d = 0; d < head_dim; ++d) {
            const vecf k = loadv(kt + d * keys_stride + j0);
#pragma GCC unroll 8
            for (int64_t r = 0; r < CAUSAL_ROWS; ++r) acc[r] += q[r][d] * k;
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < CAUSAL_ROWS; ++r) storev(scores + r * padded_keys + j0, acc[r]);
    }
    float inv_sum[CAUSAL_ROWS];
    causal_softmax(scores, padded_keys, first_row, num_rows, inv_sum);
    causal_values(scores, padded_keys, value, out, first_row, num_rows, head, kv_head, num_heads, num_kv_heads, head_dim,
                  inv_sum);
}

// -- Decode-sized linears -------------------------------------------------------------------------------------
//
// y[m, :] = x[m, :] W^T (+ bias) for a few rows m, W [n, k] packed once at load as [ceil(n / 64)][k][64]: a block
// of 64 output columns is k consecutive rows of 64 weights, so the whole weight is read as one forward stream.
// oneDNN's packed matmul (engine/models/cpu_packing.py) costs ~13 us per call before any arithmetic, 17 calls a
// decode step of the benchmark model; this costs the ctypes call.
//
// The sums are oneDNN's, bit for bit (tests/kernels/test_cpu_linear.py), so a row gets the same bits here as in
// a larger batch there: for each output, one chain of fused multiply-adds over k in order, from zero, in blocks
// of LINEAR_K_BLOCK whose partial sums are then added in order; the bias last. (That is oneDNN's order for
// k <= 1024 at every row count; above, oneDNN itself gives a lone row other bits than a batch.)
constexpr int64_t LINEAR_COLS = 64;
constexpr int64_t LINEAR_K_BLOCK = 512;
constexpr int LINEAR_VECS = LINEAR_COLS / VL;
// Rows sharing one read of a weight vector: 4 x 4 accumulators with AVX-512; with 8 lanes a row's 8 fill half
// of AVX2's 16 registers.
constexpr int LINEAR_ROWS = VL == 16 ? 4 : 1;
// Up to how many rows the kernel beats oneDNN's matmul in the engine (benchmarks.decode_steps --kernel-rows,
// Zen 4, 2026-12-05): with 16 lanes it was still 5-13% ahead at 16 rows and level above; with 8 (one row per
// read) level at 8 rows and behind at 16.
constexpr int LINEAR_MAX_ROWS = VL == 16 ? 16 : 8;

#if defined(__FMA__) || defined(__AVX512F__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
#define INFLIGHT_HARDWARE_FMA 1
#else
#define INFLIGHT_HARDWARE_FMA 0
#endif

// a * b + c rounded once, as oneDNN's FMA instructions compute it.
static inline vecf fused_mul_add(vecf a, vecf b, vecf c) {
#if INFLIGHT_LANES == 16 && defined(__AVX512F__)
    return (vecf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif INFLIGHT_LANES == 8 && defined(__FMA__)
    return (vecf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else  // one lane at a time: an FMA instruction where there is one (aarch64), a slow library call where not
    for (int i = 0; i < VL; ++i) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
#endif
}

// ROWS rows of x against one 64-column block of the packed weight: acc <- x[:, k0:k1] . W[k0:k1, block].
template <int ROWS, class T>
static inline __attribute__((always_inline)) void linear_chain(const T* __restrict x, int64_t stride_x,
                                                               const T* __restrict w, int64_t k0, int64_t k1,
                                                               vecf (&acc)[LINEAR_ROWS][LINEAR_VECS]) {
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < LINEAR_VECS; ++j) acc[r][j] = vecf{};
    for (int64_t kk = k0; kk < k1; ++kk) {
        vecf wv[LINEAR_VECS];
        for (int j = 0; j < LINEAR_VECS; ++j) wv[j] = loadv(w + kk * LINEAR_COLS + j * VL);
        for (int r = 0; r < ROWS; ++r) {
            const vecf a = vecf{} + to_float(x[r * stride_x + kk]);
            for (int j = 0; j < LINEAR_VECS; ++j) acc[r][j] = fused_mul_add(a, wv[j], acc[r][j]);
        }
    }
}

template <int ROWS, class T>
static void linear_rows(const T* __restrict x, int64_t stride_x, const T* __restrict w,
                        const T* __restrict bias, T* __restrict y, int64_t stride_y, int64_t k, int64_t cols) {
    vecf sum[LINEAR_ROWS][LINEAR_VECS], part[LINEAR_ROWS][LINEAR_VECS];
    linear_chain<ROWS>(x, stride_x, w, 0, std::min(k, LINEAR_K_BLOCK), sum);
    for (int64_t k0 = LINEAR_K_BLOCK; k0 < k; k0 += LINEAR_K_BLOCK) {
        linear_chain<ROWS>(x, stride_x, w, k0, std::min(k, k0 + LINEAR_K_BLOCK), part);
        for (int r = 0; r < ROWS; ++r)
            for (int j = 0; j < LINEAR_VECS; ++j) sum[r][j] += part[r][j];
    }
    for (int r = 0; r < ROWS; ++r) {
        float out[LINEAR_COLS];
        for (int j = 0; j < LINEAR_VECS; ++j) storev(out + j * VL, sum[r][j]);
        T* dst = y + r * stride_y;
        if (bias != nullptr)
            for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(out[c] + to_float(bias[c]));
        else
            for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(out[c]);
    }
}

// One 64-column block for every row (a function of its own: see ROW_FN below on OpenMP bodies).
template <class T>
static __attribute__((noinline)) void linear_block(const T* x, const T* w, const T* bias, T* y,
                                                   int64_t num_rows, int64_t k, int64_t n, int64_t stride_x,
                                                   int64_t cols) {
    int64_t r = 0;
    for (; r + LINEAR_ROWS <= num_rows; r += LINEAR_ROWS)
        linear_rows<LINEAR_ROWS, T>(x + r * stride_x, stride_x, w, bias, y + r * n, n, k, cols);
    for (; r < num_rows; ++r) linear_rows<1, T>(x + r * stride_x, stride_x, w, bias, y + r * n, n, k, cols);
}

// query, out: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim]; float32,
// contiguous. Token t attends to tokens 0..t. head_dim a multiple of 32 up to 256 (the caller checks: other
// sizes return without writing); num_heads a multiple of num_kv_heads.
#if INFLIGHT_BF16_DOT
// A causal tile's V pass on dot products, after causal_softmax: out_r = inv_sum_r * sum_j p[r, j] v_j, two keys per
// vdpbf16ps, the weights rounded to bf16 (as transformers' bf16 attention and the decode V pass round them): half
// the instructions of causal_values. Keys 0 .. first_row, which every row of the tile sees, go in pairs
// (value_pairs); the rest (an odd one out, and the tile's own later keys, each only for the rows that see it: a
// zero weight would still carry a later token's inf into an earlier row) one at a time, from the same weights.
static void causal_values_dot(float* __restrict scores, int64_t padded_keys, const bf16* __restrict value,
                              bf16* __restrict out, int64_t first_row, int64_t num_rows, int64_t head, int64_t kv_head,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              const float* __restrict inv_sum) {
    const int64_t num_keys = first_row + num_rows;
    const int64_t paired = (first_row + 1) / 2 * 2;
    // Each row's weights rounded to bf16 in place, at the start of its float row: value i's 2 bytes lie before
    // float i's 4, and a sweep of KEY_VEC reads its floats before it writes.
    bf16* weights[CAUSAL_ROWS];
    for (int64_t r = 0; r < CAUSAL_ROWS; ++r) {
        float* s = scores + r * padded_keys;
        weights[r] = reinterpret_cast<bf16*>(s);
        for (int64_t j = 0; j < padded_keys; j += KEY_VEC)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights[r] + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
    }
    const int64_t v_stride = num_kv_heads * head_dim;
    const bf16* __restrict v_head = value + kv_head * head_dim;
    for (int64_t c0 = 0; c0 < head_dim; c0 += 32) {
        __m512 a[CAUSAL_ROWS][2];
        for (int64_t r = 0; r < CAUSAL_ROWS; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < paired; j += 2) {
            __m512bh lo, hi;
            value_pairs(_mm512_loadu_si512(v_head + j * v_stride + c0), _mm512_loadu_si512(v_head + (j + 1) * v_stride + c0),
                        lo, hi);
#pragma GCC unroll 8
            for (int64_t r = 0; r < CAUSAL_ROWS; ++r) {
                uint32_t pair;
                std::memcpy(&pair, weights[r] + j, 4);
                const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
                a[r][0] = _mm512_dpbf16_ps(a[r][0], w, lo);
                a[r][1] = _mm512_dpbf16_ps(a[r][1], w, hi);
            }
        }
        vecf sum[CAUSAL_ROWS][2];
        for (int64_t r = 0; r < CAUSAL_ROWS; ++r)
            for (int half = 0; half < 2; ++half) sum[r][half] = unscrambled_values(a[r][0], a[r][1], half);
        for (int64_t j = paired; j < num_keys; ++j) {
            const vecf v0 = loadv(v_head + j * v_stride + c0), v1 = loadv(v_head + j * v_stride + c0 + 16);
            for (int64_t r = j - first_row > 0 ? j - first_row : 0; r < num_rows; ++r) {  // rows that see key j
                const float p = to_float(weights[r][j]);
                sum[r][0] += p * v0;
                sum[r][1] += p * v1;
            }
        }
        for (int64_t r = 0; r < num_rows; ++r) {
            bf16* __restrict dst = out + ((first_row + r) * num_heads + head) * head_dim + c0;
            storev(dst, sum[r][0] * inv_sum[r]);
            storev(dst + 16, sum[r][1] * inv_sum[r]);
        }
    }
}

// bf16 causal attention with its scores on AVX-512 BF16's dot products (vdpbf16ps: two bf16 products and a
// float32 sum per lane), half the instructions of widening to float32 and fusing multiply-adds: the tile of
// causal_tile, with K laid out in pairs of dimensions ([head_dim / 2][keys][2]: a lane's pair is one key's two
// dimensions), built once per call. Products are exact and sums float32; the V pass is causal_values_dot.
static void causal_tile_dot(const bf16* __restrict query, const bf16* __restrict kt2, const bf16* __restrict value, bf16* __restrict out, int64_t first_row, int64_t num_rows,
                            int64_t head, int64_t kv_head, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t keys_stride, float scale, float* __restrict scores) {
    const int64_t num_keys = first_row + num_rows;
    const int64_t padded_keys = (num_keys + KEY_VEC - 1) / KEY_VEC * KEY_VEC;
    const int64_t half = head_dim / 2;
    uint32_t q[CAUSAL_ROWS][128];  // each row's query as pairs of bf16 (head_dim <= 256)
    for (int64_t r = 0; r < CAUSAL_ROWS; ++r)
        for (int64_t i = 0; i < half; ++i) {
            uint32_t pair = 0;
            if (r < num_rows) std::memcpy(&pair, query + ((first_row + r) * num_heads + head) * head_dim + 2 * i, 4);
            q[r][i] = pair;
        }
    const vecf scale_v = vecf{} + scale;
    for (int64_t j0 = 0; j0 < padded_keys; j0 += KEY_VEC) {
        __m512 acc[CAUSAL_ROWS];
        for (int64_t r = 0; r < CAUSAL_ROWS; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < half; ++i) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(kt2 + (i * keys_stride + j0) * 2);
#pragma GCC unroll 8
            for (int64_t r = 0; r < CAUSAL_ROWS; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][i])), k);
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < CAUSAL_ROWS; ++r) storev(scores + r * padded_keys + j0, (vecf)acc[r] * scale_v);
    }
    float inv_sum[CAUSAL_ROWS];
    causal_softmax(scores, padded_keys, first_row, num_rows, inv_sum);
    causal_values_dot(scores, padded_keys, value, out, first_row, num_rows, head, kv_head, num_heads, num_kv_heads,
                      head_dim, inv_sum);
}

// causal_attention for bf16 on the dot-product instructions: K re-laid in pairs once per call.
static void causal_attention_dot(const bf16* query, const bf16* key, const bf16* value, bf16* out,
                                 int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t keys_stride = (num_tokens + KEY_VEC - 1) / KEY_VEC * KEY_VEC;
    std::vector<bf16> kt2(num_kv_heads * head_dim * keys_stride, 0);  // [kv head][head_dim / 2][keys][2]
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_tokens * num_kv_heads * head_dim))
    for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t t = 0; t < num_tokens; ++t)
            for (int64_t d = 0; d < head_dim; ++d)
                kt2[((h * (head_dim / 2) + d / 2) * keys_stride + t) * 2 + d % 2] = key[(t * num_kv_heads + h) * head_dim + d];
    for_each_causal_tile(num_tokens, num_heads, group, keys_stride, num_threads,
                         [&](int64_t head, int64_t kv_head, int64_t first_row, int64_t rows, float* scores) {
        causal_tile_dot(query, kt2.data() + kv_head * head_dim * keys_stride, value, out, first_row, rows, head,
                        kv_head, num_heads, num_kv_heads, head_dim, keys_stride, scale, scores);
    });
}
#endif

template <class T>
static void causal_attention(const T* query, const T* key, const T* value, T* out, int64_t num_tokens,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int num_threads) {
    if (num_tokens <= 0 || head_dim <= 0 || head_dim > 256 || head_dim % 32 != 0) return;
#if INFLIGHT_BF16_DOT
    if constexpr (sizeof(T) == sizeof(bf16)) {
        causal_attention_dot(query, key, value, out, num_tokens, num_heads, num_kv_heads, head_dim, scale, num_threads);
        return;
    }
#endif
    const int64_t group = num_heads / num_kv_heads;
    const int64_t keys_stride = (num_tokens + KEY_VEC - 1) / KEY_VEC * KEY_VEC;
    std::vector<float> kt(num_kv_heads * head_dim * keys_stride, 0.f);  // [kv head, head_dim, keys], zero tail
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_tokens * num_kv_heads * head_dim))
    for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t t = 0; t < num_tokens; ++t)
            for (int64_t d = 0; d < head_dim; ++d)
                kt[(h * head_dim + d) * keys_stride + t] = to_float(key[(t * num_kv_heads + h) * head_dim + d]);
    for_each_causal_tile(num_tokens, num_heads, group, keys_stride, num_threads,
                         [&](int64_t head, int64_t kv_head, int64_t first_row, int64_t rows, float* scores) {
        const float* kt_head = kt.data() + kv_head * head_dim * keys_stride;
        auto run = [&](auto tile_fn) {
            tile_fn(query, kt_head, value, out, first_row, rows, head, kv_head, num_heads, num_kv_heads, head_dim,
                    keys_stride, scale, scores);
        };
        switch (head_dim) {
            case 32: run(causal_tile<32, T>); break;
            case 64: run(causal_tile<64, T>); break;
            case 128: run(causal_tile<128, T>); break;
            default: run(causal_tile<0, T>); break;
        }
    });
}


// query, out: [num_rows, num_heads, head_dim] float32, contiguous.
// k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim] float32, contiguous.
// block_tables: [num_rows, table_stride] int64; seq_lens: [num_rows] int64 (keys visible to each row).
// Query heads per kv head (num_heads / num_kv_heads) must be at most 64; head_dim a multiple of 16 up to 256
// (the caller checks: other sizes return without writing). window > 0: each row sees its last ``window`` keys only
// (the walk starts at the window's first block; blocks before it are never read); softcap > 0: scores capped.
template <class T>
static void paged_decode_attention(const T* query, const T* k_cache, const T* v_cache,
                                const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                T* out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                                int num_threads, int64_t window = 0, float softcap = 0.f) {
    if (head_dim <= 0 || head_dim > 256 || head_dim % 16 != 0) return;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_tasks = num_rows * num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim;  // one kv head's whole cache

#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;  // [group, seq_len], reused across this thread's tasks
        std::vector<float> acc(group * head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            const int64_t row = task / num_kv_heads;
            const int64_t kv_head = task % num_kv_heads;
            int64_t seq_len = seq_lens[row];
            const int64_t* table = block_tables + row * table_stride;
            int64_t hidden = 0;  // keys of the window's first block before the window
            if (window > 0 && seq_len > window) {
                const int64_t skipped = (seq_len - window) / block_size;  // whole blocks before the window
                table += skipped;
                seq_len -= skipped * block_size;
                hidden = seq_len - window;
            }
            const int64_t offset = (row * num_heads + kv_head * group) * head_dim;  // the group's first head
            if (seq_len <= 0) {  // nothing visible (the engine never sends such a row): a zero output, not UB
                std::fill_n(out + offset, group * head_dim, T{});
                continue;
            }
            scores.resize(group * seq_len);
            const T* k_head = k_cache + kv_head * head_stride;
            const T* v_head = v_cache + kv_head * head_stride;
            auto run = [&](auto task_fn) {
                task_fn(query + offset, k_head, v_head, table, seq_len, out + offset, group, head_dim, block_size,
                        scale, scores.data(), acc.data(), hidden, softcap);
            };
            switch (head_dim) {
                case 32: run(decode_task<32, T>); break;
                case 64: run(decode_task<64, T>); break;
                case 128: run(decode_task<128, T>); break;
                default: run(decode_task<0, T>); break;
            }
        }
    }
}

// The per-token work between the matmuls, one pass each instead of 3-9 PyTorch ops: at decode batch
// sizes every op costs more in dispatch than in arithmetic. Parallel only when there is enough work.

// GCC leaves a loop it finds inlined in an OpenMP region's outlined body scalar (silu_and_mul took 1.7 ms
// for 425 x 688 against 0.15 ms outside one, measured on the 2-core Sapphire Rapids VM): so the work per
// row of these passes is a function of its own, never inlined into the parallel loop.
#define ROW_FN static __attribute__((noinline))

template <class S, class T>
static inline __attribute__((always_inline)) void norm_of(const S* __restrict src, const T* __restrict weight,
                                                          T* __restrict ot, int64_t hidden, float eps) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += to_float(src[i]) * to_float(src[i]);
    const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) ot[i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
}

// R: the residual stream's type. bf16 (T's, as transformers keeps it: the sum is rounded as it is stored) or
// float32 under a bf16 layer (the stream then keeps every layer's contribution unrounded; the norm reads it so).
template <class T, class R>
ROW_FN void rms_norm_row(const T* __restrict xt, R* __restrict rt, const T* __restrict weight,
                         T* __restrict ot, int64_t hidden, float eps) {
    if (rt == nullptr) {
        norm_of(xt, weight, ot, hidden, eps);
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) rt[i] = from_float<R>(to_float(rt[i]) + to_float(xt[i]));
    norm_of(rt, weight, ot, hidden, eps);
}

// out = rms_norm(x (+ residual)) * weight; with residual, residual <- x + residual first (the next
// residual stream). x, residual, out: [num_tokens, hidden] with row strides; weight: [hidden].
template <class T, class R = T>
static void rms_norm(const T* x, R* residual, const T* weight, T* out, int64_t num_tokens,
                  int64_t hidden, int64_t stride_x, int64_t stride_r, int64_t stride_o, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_tokens * hidden))
    for (int64_t t = 0; t < num_tokens; ++t)
        rms_norm_row(x + t * stride_x, residual != nullptr ? residual + t * stride_r : nullptr, weight,
                     out + t * stride_o, hidden, eps);
}

template <class T>
ROW_FN void silu_and_mul_row(const T* __restrict gate, const T* __restrict up, T* __restrict o, int64_t width) {
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate[i]);
        o[i] = from_float<T>(g / (1.f + exp_approx(-g)) * to_float(up[i]));
    }
}

// out[t] = silu(gate_up[t, :width]) * gate_up[t, width:]
template <class T>
static void silu_and_mul(const T* gate_up, T* out, int64_t num_tokens, int64_t width, int64_t stride_in,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_tokens * width))
    for (int64_t t = 0; t < num_tokens; ++t)
        silu_and_mul_row(gate_up + t * stride_in, gate_up + t * stride_in + width, out + t * width, width);
}

template <class T>
ROW_FN void rope_token(const T* __restrict x, const float* __restrict c, const float* __restrict s,
                       T* __restrict out, int64_t num_heads, int64_t half, int64_t stride_xh) {
    for (int64_t h = 0; h < num_heads; ++h) {
        const T* a = x + h * stride_xh;
        T* o = out + h * 2 * half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float lo = to_float(a[i]), hi = to_float(a[half + i]);
            o[i] = from_float<T>(lo * c[i] - hi * s[i]);
            o[half + i] = from_float<T>(hi * c[i] + lo * s[i]);
        }
    }
}

// Rotary embedding, rotate-half layout: x [num_tokens, num_heads, head_dim] (token and head strides, last
// dim contiguous) -> out, contiguous; cos, sin: float32 [num_tokens, head_dim / 2] (in either storage type).
template <class T>
static void rope(const T* x, const float* cos, const float* sin, T* out, int64_t num_tokens, int64_t num_heads,
              int64_t head_dim, int64_t stride_xt, int64_t stride_xh, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_tokens * num_heads * head_dim))
    for (int64_t t = 0; t < num_tokens; ++t)
        rope_token(x + t * stride_xt, cos + t * half, sin + t * half, out + t * num_heads * head_dim, num_heads, half,
                   stride_xh);
}

// The step's new K and V into the head-major paged cache: cache[h, slot / block_size, slot % block_size, :]
// = key[t, h, :]. key, value: [num_tokens, num_kv_heads, head_dim] with token and head strides.
template <class T>
static void store_kv(const T* key, const T* value, T* k_cache, T* v_cache, const int64_t* slots,
                  int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                  int64_t stride_kt, int64_t stride_kh, int64_t stride_vt, int64_t stride_vh, int num_threads) {
    const int64_t head_stride = num_blocks * block_size * head_dim;
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_tokens * num_kv_heads * head_dim))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t offset = slots[t] * head_dim;  // slot = block * block_size + offset in block
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            std::copy_n(key + t * stride_kt + h * stride_kh, head_dim, k_cache + h * head_stride + offset);
            std::copy_n(value + t * stride_vt + h * stride_vh, head_dim, v_cache + h * head_stride + offset);
        }
    }
}

// y [num_rows, n] (contiguous) = x [num_rows, k] (row stride stride_x) W^T + bias (nullptr: none), W packed as
// [ceil(n / 64)][k][64] with the columns past n zero (kernels/cpu_kernels.py's pack_linear). Column blocks split over threads when there is enough work.
template <class T>
static void linear(const T* x, const T* packed, const T* bias, T* y, int64_t num_rows, int64_t n,
                   int64_t k, int64_t stride_x, int num_threads) {
    const int64_t num_blocks = (n + LINEAR_COLS - 1) / LINEAR_COLS;
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_rows * n * k / 8))
    for (int64_t b = 0; b < num_blocks; ++b)
        linear_block(x, packed + b * k * LINEAR_COLS, bias != nullptr ? bias + b * LINEAR_COLS : nullptr,
                     y + b * LINEAR_COLS, num_rows, k, n, stride_x, std::min(LINEAR_COLS, n - b * LINEAR_COLS));
}

#if INFLIGHT_BF16_DOT
// -- bf16 linears on dot products ---------------------------------------------------------------------------
//
// y = x W^T (+ bias), W [n, k] bf16 packed once as [ceil(n / 16)][ceil(k / 2)][16][2] (kernels/cpu_kernels.py's
// pack_linear_pairs): a block of 16 output columns is k / 2 vectors, each 16 columns' pair of weights for two
// consecutive inputs, read in order. One vdpbf16ps multiplies a vector by a row's pair of inputs (broadcast) and adds
// both products to the 16 sums: half the instructions of float32 multiply-adds and no widening. Rows in groups of
// DOT_ROWS, DOT_BLOCKS column blocks per pass: 24 accumulators in registers, each weight vector loaded once per
// group. Sums in float32, rounded once on store.
// Measured on Zen 4, 2 threads, the model's layer linears with cold weights (2026-12-07, benchmarks.md): three
// blocks beat two by 5-10% at 8-32 rows (fewer loads per dot product; 48 columns also split the model's widths
// evenly); 16 rows of one block was 25-35% slower than 8 x 2 at 16-512 rows, and prefetching the weights a fixed
// distance ahead within one pass changed nothing.
constexpr int DOT_ROWS = 8;
constexpr int DOT_BLOCKS = 3;
// With several row groups (up to DOT_CHUNKED_GROUPS), the inputs go in chunks of DOT_CHUNK pairs: every group over
// a chunk before the next, the sums kept in memory between chunks, and the next chunk's weights prefetched into L2
// a share by each group's pass. Each group over the whole input in turn read the weights from memory for the
// first group (bandwidth-bound) and from L2 for the rest (compute-bound), the two times added: 16 rows took 1.45x
// the time of 8. Chunked, 12-24 rows of the model's linears take 10-20% less; above 64 rows the weights are
// reused enough that one pass per group is as fast, without the sums' round trips.
constexpr int64_t DOT_CHUNK = 64;
constexpr int64_t DOT_CHUNKED_GROUPS = 8;

// ROWS rows' sums over input pairs [i0, i1), continued from acc (rows x B x 16 floats; zeros when i0 is 0) and
// stored back there. With groups > 0, the weight vectors DOT_CHUNK pairs ahead of every pair i with i % groups ==
// phase are prefetched into L2 (the groups of a chunk share the next chunk's lines; a prefetch past the weight's
// end is harmless: it never faults).
template <int ROWS, int B>
static inline __attribute__((always_inline)) void linear_dot_rows(const bf16* __restrict x, int64_t stride_x,
                                                                  const bf16* __restrict w, int64_t block_stride,
                                                                  float* __restrict acc_io, int64_t i0, int64_t i1,
                                                                  int64_t k, int64_t phase, int64_t groups) {
    __m512 acc[ROWS][B];
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < B; ++c)
            acc[r][c] = i0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + (r * B + c) * 16);
    const int64_t full = std::min(i1, k / 2);  // pairs of two real inputs
    for (int64_t i = i0; i < full; ++i) {
        __m512bh wv[B];
        for (int c = 0; c < B; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * block_stride + i * 32);
        if (groups > 0 && i % groups == phase)
            for (int c = 0; c < B; ++c)
                _mm_prefetch(reinterpret_cast<const char*>(w + c * block_stride + (i + DOT_CHUNK) * 32), _MM_HINT_T1);
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
            uint32_t pair;
            std::memcpy(&pair, x + r * stride_x + 2 * i, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            for (int c = 0; c < B; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
        }
    }
    if (i1 > full) {  // an odd k's last input pairs with zero (x is not read past its row)
        __m512bh wv[B];
        for (int c = 0; c < B; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * block_stride + full * 32);
        for (int r = 0; r < ROWS; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * stride_x + k - 1]));
            for (int c = 0; c < B; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < B; ++c) _mm512_storeu_ps(acc_io + (r * B + c) * 16, acc[r][c]);
}

// The last rows (fewer than DOT_ROWS), unrolled for their count.
template <int B, int R = DOT_ROWS - 1>
static inline void linear_dot_tail(int64_t rows, const bf16* x, int64_t stride_x, const bf16* w, int64_t block_stride,
                                   float* acc, int64_t i0, int64_t i1, int64_t k, int64_t phase, int64_t groups) {
    if constexpr (R > 0) {
        if (rows == R) linear_dot_rows<R, B>(x, stride_x, w, block_stride, acc, i0, i1, k, phase, groups);
        else linear_dot_tail<B, R - 1>(rows, x, stride_x, w, block_stride, acc, i0, i1, k, phase, groups);
    }
}

// B column blocks (16 columns each) for every row: in chunks of inputs (DOT_CHUNK) for a few row groups, else one
// pass per group.
template <int B, class O>
static __attribute__((noinline)) void linear_dot_block(const bf16* x, const bf16* w, int64_t block_stride,
                                                       const bf16* bias, O* y, int64_t num_rows, int64_t k,
                                                       int64_t n, int64_t stride_x, int64_t cols) {
    thread_local std::vector<float> sums;
    sums.resize(num_rows * B * 16);
    const int64_t pairs = (k + 1) / 2;
    const int64_t num_groups = (num_rows + DOT_ROWS - 1) / DOT_ROWS;
    // (one group reads the weights once whatever the order: the hardware prefetcher streams them)
    const bool chunked = num_groups > 1 && num_groups <= DOT_CHUNKED_GROUPS;
    const int64_t chunk = chunked ? DOT_CHUNK : pairs;
    for (int64_t i0 = 0; i0 < pairs; i0 += chunk) {
        const int64_t i1 = std::min(pairs, i0 + chunk);
        const int64_t groups = i1 < pairs ? num_groups : 0;  // 0: nothing to prefetch
        int64_t r = 0, g = 0;
        for (; r + DOT_ROWS <= num_rows; r += DOT_ROWS, ++g)
            linear_dot_rows<DOT_ROWS, B>(x + r * stride_x, stride_x, w, block_stride, sums.data() + r * B * 16, i0, i1,
                                         k, g, g < groups ? groups : 0);
        linear_dot_tail<B>(num_rows - r, x + r * stride_x, stride_x, w, block_stride, sums.data() + r * B * 16, i0,
                           i1, k, g, g < groups ? groups : 0);
    }
    for (int64_t r = 0; r < num_rows; ++r) {
        const float* out = sums.data() + r * B * 16;
        O* dst = y + r * n;
        for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<O>(bias != nullptr ? out[c] + to_float(bias[c]) : out[c]);
    }
}

template <class O>
static void linear_pairs(const bf16* x, const bf16* packed, const bf16* bias, O* y, int64_t num_rows, int64_t n,
                         int64_t k, int64_t stride_x, int num_threads) {
    const int64_t num_blocks = (n + 15) / 16;
    const int64_t block_stride = (k + 1) / 2 * 32;  // bf16 values in one block of 16 columns
    const int64_t num_tasks = (num_blocks + DOT_BLOCKS - 1) / DOT_BLOCKS;  // DOT_BLOCKS column blocks per task
#pragma omp parallel for num_threads(num_threads) if (worth_threads(num_rows * n * k / 8))
    for (int64_t t = 0; t < num_tasks; ++t) {
        const int64_t b = DOT_BLOCKS * t;
        const bf16* block_bias = bias != nullptr ? bias + b * 16 : nullptr;
        const int64_t cols = std::min<int64_t>(16 * DOT_BLOCKS, n - b * 16);
        if (b + DOT_BLOCKS <= num_blocks)
            linear_dot_block<DOT_BLOCKS>(x, packed + b * block_stride, block_stride, block_bias, y + b * 16, num_rows, k,
                                         n, stride_x, cols);
        else  // the last blocks: one at a time (the packed weight ends there)
            for (int64_t j = b; j < num_blocks; ++j)
                linear_dot_block<1>(x, packed + j * block_stride, block_stride,
                                    bias != nullptr ? bias + j * 16 : nullptr, y + j * 16, num_rows, k, n, stride_x,
                                    std::min<int64_t>(16, n - j * 16));
    }
}
#endif

#include "quant_linear.h"
#include "shm_reduce.h"
#include "moe_experts.h"

extern "C" {

// y [num_rows, n] (contiguous, bf16) = x [num_rows, k] (bf16, row stride stride_x) W^T + bias (bf16 or nullptr),
// W packed by pack_linear_pairs; only where the build has AVX-512 BF16 (bf16_dot_products()), else it does nothing.
void linear_pairs_bf16(const bf16* x, const bf16* packed, const bf16* bias, bf16* y, int64_t num_rows, int64_t n,
                       int64_t k, int64_t stride_x, int num_threads) {
#if INFLIGHT_BF16_DOT
    linear_pairs(x, packed, bias, y, num_rows, n, k, stride_x, num_threads);
#endif
}

// The same with y float32: the sums unrounded (logits: bf16's 8 bits tie candidates an eighth apart at 25).
void linear_pairs_bf16_f32(const bf16* x, const bf16* packed, const bf16* bias, float* y, int64_t num_rows, int64_t n,
                           int64_t k, int64_t stride_x, int num_threads) {
#if INFLIGHT_BF16_DOT
    linear_pairs(x, packed, bias, y, num_rows, n, k, stride_x, num_threads);
#endif
}

// The most rows ``linear_*`` should take: 0 without FMA instructions (software FMA is ~60x slower, and oneDNN
// multiplies and adds apart there, so the bits would differ too).
int linear_max_rows() { return INFLIGHT_HARDWARE_FMA ? LINEAR_MAX_ROWS : 0; }

// 1 when the bf16 kernels use AVX-512 BF16's dot products (causal attention), 0 when they widen to float32.
int bf16_dot_products() { return INFLIGHT_BF16_DOT; }

// Each kernel for both storage types: NAME_f32 on float, NAME_bf16 on bfloat16 (kernels/cpu_kernels.py's
// signatures; cos and sin stay float32 in both).
#define INFLIGHT_EXPORTS(T, SUFFIX)                                                                                 \
    void causal_attention_##SUFFIX(const T* query, const T* key, const T* value, T* out, int64_t num_tokens,       \
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,         \
                                   int num_threads) {                                                              \
        causal_attention<T>(query, key, value, out, num_tokens, num_heads, num_kv_heads, head_dim, scale,          \
                            num_threads);                                                                          \
    }                                                                                                              \
    void paged_decode_attention_##SUFFIX(const T* query, const T* k_cache, const T* v_cache,                       \
                                         const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens, \
                                         T* out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,        \
                                         int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,    \
                                         int num_threads, int64_t window, float softcap) {                         \
        paged_decode_attention<T>(query, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_rows,    \
                                  num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale, num_threads,   \
                                  window, softcap);                                                                \
    }                                                                                                              \
    void rms_norm_##SUFFIX(const T* x, T* residual, const T* weight, T* out, int64_t num_tokens, int64_t hidden,   \
                           int64_t stride_x, int64_t stride_r, int64_t stride_o, float eps, int num_threads) {     \
        rms_norm<T, T>(x, residual, weight, out, num_tokens, hidden, stride_x, stride_r, stride_o, eps,            \
                       num_threads);                                                                               \
    }                                                                                                              \
    void silu_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t num_tokens, int64_t width, int64_t stride_in,     \
                               int num_threads) {                                                                  \
        silu_and_mul<T>(gate_up, out, num_tokens, width, stride_in, num_threads);                                  \
    }                                                                                                              \
    void rope_##SUFFIX(const T* x, const float* cos, const float* sin, T* out, int64_t num_tokens,                 \
                       int64_t num_heads, int64_t head_dim, int64_t stride_xt, int64_t stride_xh, int num_threads) {\
        rope<T>(x, cos, sin, out, num_tokens, num_heads, head_dim, stride_xt, stride_xh, num_threads);             \
    }                                                                                                              \
    void store_kv_##SUFFIX(const T* key, const T* value, T* k_cache, T* v_cache, const int64_t* slots,             \
                           int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,         \
                           int64_t block_size, int64_t stride_kt, int64_t stride_kh, int64_t stride_vt,            \
                           int64_t stride_vh, int num_threads) {                                                   \
        store_kv<T>(key, value, k_cache, v_cache, slots, num_tokens, num_kv_heads, head_dim, num_blocks,           \
                    block_size, stride_kt, stride_kh, stride_vt, stride_vh, num_threads);                          \
    }                                                                                                              \
    void linear_##SUFFIX(const T* x, const T* packed, const T* bias, T* y, int64_t num_rows, int64_t n, int64_t k, \
                         int64_t stride_x, int num_threads) {                                                      \
        linear<T>(x, packed, bias, y, num_rows, n, k, stride_x, num_threads);                                      \
    }

INFLIGHT_EXPORTS(float, f32)
INFLIGHT_EXPORTS(bf16, bf16)

// One layer's weights for decode_layers_bf16 (kernels/cpu_kernels.py's DecodeLayer): the norms' weights, the
// linears (each packed by pack_linear_pairs or kept quantized, with its bias or nullptr), the layer's K and V caches.
struct DecodeLayer {
    const bf16* input_norm;
    LinearWeight qkv;
    LinearWeight o;
    const bf16* post_norm;
    LinearWeight gate_up;
    LinearWeight down;
    bf16* k_cache;
    bf16* v_cache;
};

// A decode step's decoder layers (every row one token), bf16 under a float32 residual stream: the kernels
// engine/models/llama.py calls one by one from Python (norm, qkv, RoPE, store, attention, o, norm, gate/up,
// SiLU-and-mul, down), in the same order with the same arguments, so the same bits; one call instead of ~300.
// x [num_rows, hidden] (the embeddings in, the last layer's MLP output out) and residual (zeros in, the stream
// before the last MLP out), contiguous; cos, sin [num_rows, head_dim / 2]; slots, block_tables, seq_lens as
// store_kv and paged_decode_attention take them.
void decode_layers_bf16(const DecodeLayer* layers, int64_t num_layers, bf16* x, float* residual, const float* cos,
                        const float* sin, const int64_t* slots, const int64_t* block_tables, int64_t table_stride,
                        const int64_t* seq_lens, int64_t num_rows, int64_t hidden, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, int64_t num_blocks,
                        int64_t block_size, float eps, float scale, int num_threads) {
#if INFLIGHT_BF16_DOT
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qk_size = q_size + kv_size, qkv_size = qk_size + kv_size;
    thread_local std::vector<bf16> h, qkv, qk, q, attn, gate_up, act;
    h.resize(num_rows * hidden);
    qkv.resize(num_rows * qkv_size);
    qk.resize(num_rows * qk_size);
    q.resize(num_rows * q_size);
    attn.resize(num_rows * q_size);
    gate_up.resize(num_rows * 2 * intermediate);
    act.resize(num_rows * intermediate);
    for (int64_t l = 0; l < num_layers; ++l) {
        const DecodeLayer& w = layers[l];
        rms_norm<bf16, float>(x, residual, w.input_norm, h.data(), num_rows, hidden, hidden, hidden, hidden, eps,
                              num_threads);
        any_linear(w.qkv, h.data(), qkv.data(), num_rows, qkv_size, hidden, hidden, num_threads);
        rope<bf16>(qkv.data(), cos, sin, qk.data(), num_rows, num_heads + num_kv_heads, head_dim, qkv_size, head_dim,
                   num_threads);
        store_kv<bf16>(qk.data() + q_size, qkv.data() + qk_size, w.k_cache, w.v_cache, slots, num_rows, num_kv_heads,
                       head_dim, num_blocks, block_size, qk_size, head_dim, qkv_size, head_dim, num_threads);
        for (int64_t r = 0; r < num_rows; ++r)  // the query heads, contiguous (as the Python path's .contiguous())
            std::copy_n(qk.data() + r * qk_size, q_size, q.data() + r * q_size);
        paged_decode_attention<bf16>(q.data(), w.k_cache, w.v_cache, block_tables, table_stride, seq_lens,
                                     attn.data(), num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                                     scale, num_threads);
        any_linear(w.o, attn.data(), x, num_rows, hidden, q_size, q_size, num_threads);
        rms_norm<bf16, float>(x, residual, w.post_norm, h.data(), num_rows, hidden, hidden, hidden, hidden, eps,
                              num_threads);
        any_linear(w.gate_up, h.data(), gate_up.data(), num_rows, 2 * intermediate, hidden, hidden, num_threads);
        silu_and_mul<bf16>(gate_up.data(), act.data(), num_rows, intermediate, 2 * intermediate, num_threads);
        any_linear(w.down, act.data(), x, num_rows, hidden, intermediate, intermediate, num_threads);
    }
#endif
}

// rms_norm_bf16 with a float32 residual stream.
void rms_norm_bf16_f32res(const bf16* x, float* residual, const bf16* weight, bf16* out, int64_t num_tokens,
                          int64_t hidden, int64_t stride_x, int64_t stride_r, int64_t stride_o, float eps,
                          int num_threads) {
    rms_norm<bf16, float>(x, residual, weight, out, num_tokens, hidden, stride_x, stride_r, stride_o, eps, num_threads);
}

// Quantized linears (quant_linear.h): y [num_rows, n] (row stride ldy) = x W^T + bias, W packed as q4 or q8 by
// kernels/quantized.py; NAME_f32 and NAME_bf16 on x, bias and y of that type, NAME_bf16_f32 with y float32 (logits).
// quant_rows_*: rows `ids` of such a W dequantized (an embedding).
#define INFLIGHT_QUANT_EXPORTS(FORMAT, NAME)                                                                        \
    void quant_linear_##NAME##_f32(const float* x, const uint8_t* w, const float* bias, float* y, int64_t num_rows, \
                                   int64_t n, int64_t k, int64_t stride_x, int64_t ldy, int num_threads) {          \
        quant_linear<FORMAT>(x, w, bias, y, num_rows, n, k, stride_x, ldy, num_threads);                           \
    }                                                                                                              \
    void quant_linear_##NAME##_bf16(const bf16* x, const uint8_t* w, const bf16* bias, bf16* y, int64_t num_rows,  \
                                    int64_t n, int64_t k, int64_t stride_x, int64_t ldy, int num_threads) {         \
        quant_linear<FORMAT>(x, w, bias, y, num_rows, n, k, stride_x, ldy, num_threads);                           \
    }                                                                                                              \
    void quant_linear_##NAME##_bf16_f32(const bf16* x, const uint8_t* w, const bf16* bias, float* y,                \
                                        int64_t num_rows, int64_t n, int64_t k, int64_t stride_x, int64_t ldy,     \
                                        int num_threads) {                                                         \
        quant_linear<FORMAT>(x, w, bias, y, num_rows, n, k, stride_x, ldy, num_threads);                           \
    }                                                                                                              \
    void quant_rows_##NAME##_f32(const uint8_t* w, const int64_t* ids, int64_t num_ids, int64_t k, float* out,     \
                                 int num_threads) {                                                                \
        quant_rows<FORMAT>(w, ids, num_ids, k, out, num_threads);                                                  \
    }                                                                                                              \
    void quant_rows_##NAME##_bf16(const uint8_t* w, const int64_t* ids, int64_t num_ids, int64_t k, bf16* out,     \
                                  int num_threads) {                                                               \
        quant_rows<FORMAT>(w, ids, num_ids, k, out, num_threads);                                                  \
    }

INFLIGHT_QUANT_EXPORTS(FORMAT_Q4, q4)
INFLIGHT_QUANT_EXPORTS(FORMAT_Q8, q8)

// 1 when the quantized linears run on AVX-512 VNNI, 0 on the scalar code (the same bits, far slower).
int quant_vnni() { return INFLIGHT_QUANT_VNNI; }

#define INFLIGHT_SHM_EXPORTS(T, SUFFIX)                                                                             \
    int shm_all_reduce_##SUFFIX(uint8_t* slots, uint64_t* flags, int64_t stride_words, int64_t rank, int64_t size,  \
                                uint64_t round, T* data, int64_t numel, int64_t chunk_bytes, int64_t spin_ns) {     \
        return shm_all_reduce<T>(slots, flags, stride_words, rank, size, round, data, numel, chunk_bytes, spin_ns); \
    }                                                                                                              \
    void shm_sum_##SUFFIX(const uint8_t* slots, int64_t size, T* data, int64_t numel, int64_t chunk_bytes) {       \
        shm_sum<T>(slots, size, data, numel, chunk_bytes);                                                         \
    }
INFLIGHT_SHM_EXPORTS(float, f32)
INFLIGHT_SHM_EXPORTS(bf16, bf16)

// A MoE layer's experts (moe_experts.h); does nothing without AVX-512 BF16 (bf16_dot_products() says).
void moe_experts_bf16(const bf16* rows, const int64_t* offsets, int64_t num_experts, const bf16* gate_up,
                      int64_t gate_up_stride, const bf16* down, int64_t down_stride, bf16* scratch, bf16* act,
                      bf16* out, int64_t hidden, int64_t inter, int num_threads) {
#if INFLIGHT_BF16_DOT
    moe_experts(rows, offsets, num_experts, gate_up, gate_up_stride, down, down_stride, scratch, act, out, hidden,
                inter, num_threads);
#endif
}

}  // extern "C"
