// How well this CPU overlaps a memory stream with arithmetic: the best case for a small-M product.
//
//     gcc -O2 -mavx2 -mfma -fopenmp scripts/overlap_probe.c -o /tmp/overlap_probe && /tmp/overlap_probe [offset]
//     gcc -O2 -march=x86-64-v4 -fopenmp ...   (AVX-512: 16-float vectors, as the kernels use there)
//
// Each OpenMP thread walks its share of a buffer one vector (8 floats, 16 with AVX-512) at a time and does F
// FMAs per vector into 8 registers. That is the shape of a product with F rows of x, minus every load but the weight's.
// Each F is timed over a 1 GiB buffer (memory) and over a 16 KiB one walked as many times (the same FMAs from
// L1), in turn with F = 1 over the 1 GiB (the stream), medians of 7. "mem/max" is the memory time over
// max(stream, this F's cache time): 1.00x is a perfect overlap. `offset` places the buffers that many bytes past a 64-byte boundary.
// docs/engine-cpu.md's 8 x 1 paragraph quotes its figures; `specedge-bench engine` measures the real kernels.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#ifdef __AVX512F__
#define LANES 16
#define VEC __m512
#define LOAD _mm512_loadu_ps
#define SET1 _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define STORE _mm512_storeu_ps
#else
#define LANES 8
#define VEC __m256
#define LOAD _mm256_loadu_ps
#define SET1 _mm256_set1_ps
#define ZERO _mm256_setzero_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define STORE _mm256_storeu_ps
#endif

#define KERNEL(F)                                                                            \
    static float fma_##F(const float *data, size_t vectors, size_t reps) {                   \
        float total = 0;                                                                     \
        _Pragma("omp parallel reduction(+ : total)") {                                       \
            size_t t = omp_get_thread_num(), n = omp_get_num_threads();                      \
            size_t lo = vectors * t / n, hi = vectors * (t + 1) / n;                         \
            VEC c = SET1(1.0001f), acc[8];                                                   \
            for (int j = 0; j < 8; j++) acc[j] = ZERO();                                     \
            for (size_t r = 0; r < reps; r++)                                                \
                for (size_t i = lo; i < hi; i++) {                                           \
                    VEC w = LOAD(data + LANES * i);                                          \
                    _Pragma("GCC unroll 64") for (int j = 0; j < F; j++)                     \
                        acc[j & 7] = FMA(w, c, acc[j & 7]);                                  \
                }                                                                            \
            VEC s = acc[0];                                                                  \
            for (int j = 1; j < 8; j++) s = ADD(s, acc[j]);                                  \
            float lanes[LANES];                                                              \
            STORE(lanes, s);                                                                 \
            for (int k = 0; k < LANES; k++) total += lanes[k];                               \
        }                                                                                    \
        return total;                                                                        \
    }
KERNEL(1) KERNEL(4) KERNEL(8) KERNEL(16) KERNEL(24) KERNEL(32)

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t offset = argc > 1 ? (size_t)atoi(argv[1]) : 0;
    size_t big_bytes = (size_t)1 << 30, small_bytes = 16 << 10;
    float *big = (float *)((char *)aligned_alloc(64, big_bytes + 64) + offset);
    float *small = (float *)((char *)aligned_alloc(64, small_bytes + 64) + offset);
    for (size_t i = 0; i < big_bytes / 4; i++) big[i] = (float)(i & 1023) * 1e-3f;
    for (size_t i = 0; i < small_bytes / 4; i++) small[i] = (float)(i & 1023) * 1e-3f;
    float (*kernels[])(const float *, size_t, size_t) = {fma_1, fma_4, fma_8, fma_16, fma_24, fma_32};
    int fmas[] = {1, 4, 8, 16, 24, 32};
    volatile float sink = 0;
    printf("%d threads, %d-float vectors, 1 GiB, buffers %zu B past a 64-byte boundary\n", omp_get_max_threads(), LANES,
           offset);
    printf("%3s %10s %9s %10s %13s %8s %9s\n", "F", "memory ms", "cache ms", "stream ms", "cache/stream", "mem/max",
           "GFLOP/s");
    for (int k = 1; k < 6; k++) {  // each F beside its own stream (F = 1), so drift between rows cancels
        double memory[7], cache[7], stream[7];
        for (int r = 0; r < 7; r++) {
            double start = now();
            sink += kernels[0](big, big_bytes / (4 * LANES), 1);
            stream[r] = (now() - start) * 1e3;
            start = now();
            sink += kernels[k](big, big_bytes / (4 * LANES), 1);
            memory[r] = (now() - start) * 1e3;
            start = now();
            sink += kernels[k](small, small_bytes / (4 * LANES), big_bytes / small_bytes);
            cache[r] = (now() - start) * 1e3;
        }
        qsort(memory, 7, sizeof(double), by_value);
        qsort(cache, 7, sizeof(double), by_value);
        qsort(stream, 7, sizeof(double), by_value);
        double m = memory[3], c = cache[3], s = stream[3];
        printf("%3d %10.1f %9.1f %10.1f %13.2f %7.2fx %9.0f\n", fmas[k], m, c, s, c / s, m / (s > c ? s : c),
               big_bytes / 4.0 * fmas[k] * 2 / c / 1e6);
    }
    return sink == 12345.0f;  // keeps the sums alive
}
