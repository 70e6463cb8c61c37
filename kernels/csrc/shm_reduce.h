// The tensor-parallel ranks' all-reduce through shared memory (engine/parallel/collectives.py, its protocol): included
// by cpu_kernels.cpp, which exports it. A round in one call instead of ~8 PyTorch and numpy calls (~30 us of Python
// a round, 60 rounds a decode step of the benchmark model).
//
// slots: this round's set of slots, [size][chunk_bytes]; flags: each rank's last published round, stride_words
// apart. The rank copies its part into its slot, publishes the round (a release store: the copy is seen before the
// number), then spins up to spin_ns for every rank's number (acquire loads) and sums the parts in rank order into
// data, in float32, rounded once: every rank gets the same bits. If the others are late it returns 0 with its part
// published; the caller waits for them (napping, checking they live) and calls shm_sum_*.

#include <chrono>

template <class T>
static void shm_sum(const uint8_t* slots, int64_t size, T* data, int64_t numel, int64_t chunk_bytes) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    const T* first = reinterpret_cast<const T*>(slots);
    if (size == 2) {  // the common case, as one loop the compiler vectorises
        const T* second = reinterpret_cast<const T*>(slots + chunk_bytes);
        for (int64_t i = 0; i < numel; ++i) data[i] = from_float<T>(to_float(first[i]) + to_float(second[i]));
        return;
    }
    for (int64_t i = 0; i < numel; ++i) {
        float acc = to_float(first[i]);
        for (int64_t r = 1; r < size; ++r) acc += to_float(reinterpret_cast<const T*>(slots + r * chunk_bytes)[i]);
        data[i] = from_float<T>(acc);
    }
}

template <class T>
static int shm_all_reduce(uint8_t* slots, uint64_t* flags, int64_t stride_words, int64_t rank, int64_t size,
                          uint64_t round, T* data, int64_t numel, int64_t chunk_bytes, int64_t spin_ns) {
    std::memcpy(slots + rank * chunk_bytes, data, numel * sizeof(T));
    __atomic_store_n(flags + rank * stride_words, round, __ATOMIC_RELEASE);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
        bool all = true;
        for (int64_t r = 0; r < size && all; ++r) all = __atomic_load_n(flags + r * stride_words, __ATOMIC_ACQUIRE) >= round;
        if (all) break;
        if ((spins & 255) == 255 &&
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() >
                spin_ns)
            return 0;
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
    }
    shm_sum<T>(slots, size, data, numel, chunk_bytes);
    return 1;
}
