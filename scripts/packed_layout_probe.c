// Would weights packed along N (oneDNN's layout) make a small-M product cheaper than the plain rows the numba
// kernel reads? docs/engine-cpu.md's 8 x 1 paragraph quotes this probe.
//
//     gcc -O3 -mavx2 -mfma -fopenmp scripts/packed_layout_probe.c -o /tmp/packed_probe -lm && /tmp/packed_probe
//
// Two layouts of the same float32 weight W [N, K], each with its best kernel we know:
// - plain: W's rows as loaded. A C twin of server/_forward_numba.py's product: blocks of four weight rows, dot
//   products along K, x taken three rows at a time then two (4 x 3 and 4 x 2 tiles), each pass prefetching its
//   share of the next block's lines, spread over its steps.
// - packed: 16-column panels [N / 16][K][16], x transposed to [K][8] and broadcast, as oneDNN's AVX2 kernels
//   read it. M = 8 runs two 4 x 16 tiles (eight sums each) over each 128-step chunk of a panel, so that the second
//   reads the chunk from L1, and prefetches the next chunk; M = 1 walks a panel with four sums.
// Each product is timed in turn with a read of the same bytes (medians of 11), over the two shapes that hold most
// of the 1.5B's bytes (K = 1536: q/k/v, o, gate/up, the LM head; K = 8960: down). Then each M = 8 product from
// cache (64 weight rows, 2,000 times): the arithmetic alone, which the packed tile does faster.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define FMA _mm256_fmadd_ps
#define BROADCAST _mm256_broadcast_ss
#define ROUNDS 11

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static float read_all(const float *w, size_t n) {  // the floor: every byte read once, eight sums
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        size_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        size_t lo = n / 64 * t / threads * 64, hi = n / 64 * (t + 1) / threads * 64;
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (size_t i = lo; i < hi; i += 64)
            for (int j = 0; j < 8; j++) a[j] = _mm256_add_ps(a[j], _mm256_load_ps(w + i + 8 * j));
        for (int j = 1; j < 8; j++) a[0] = _mm256_add_ps(a[0], a[j]);
        total += hsum(a[0]);
    }
    return total;
}

// ---- plain rows: y[0, o .. o + 3], the kernel's M = 1 (dot_4x1: one pass, the hardware prefetchers alone)
static inline void plain_4x1(const float *x, const float *w, int o, int k, float *y) {
    const float *w0 = w + (size_t)o * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < k; i += 8) {
        __m256 u = _mm256_loadu_ps(x + i);
        a0 = FMA(u, _mm256_loadu_ps(w0 + i), a0), a1 = FMA(u, _mm256_loadu_ps(w1 + i), a1);
        a2 = FMA(u, _mm256_loadu_ps(w2 + i), a2), a3 = FMA(u, _mm256_loadu_ps(w3 + i), a3);
    }
    y[o] = hsum(a0), y[o + 1] = hsum(a1), y[o + 2] = hsum(a2), y[o + 3] = hsum(a3);
}

// y[m0 .. m0 + c - 1, o .. o + 3] for c = 2 or 3 x rows, prefetching `lines` lines of pf
static inline void plain_tile(int c, const float *x, int m0, const float *w, int o, int k, float *y, int n,
                              const char *pf, int lines) {
    const float *xr[3], *wr[4];
    for (int j = 0; j < 3; j++) xr[j] = x + (size_t)(m0 + (j < c ? j : 0)) * k;
    for (int j = 0; j < 4; j++) wr[j] = w + (size_t)(o + j) * k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    int steps = k / 8, per = lines ? (lines << 16) / steps : 0;
    for (int s = 0; s < steps; s++) {
        int i = 8 * s;
        if (lines) _mm_prefetch(pf + ((s * per) >> 16) * 64, _MM_HINT_T1);
        __m256 u0 = _mm256_loadu_ps(xr[0] + i), u1 = _mm256_loadu_ps(xr[1] + i), u2 = _mm256_loadu_ps(xr[2] + i), p;
        p = _mm256_loadu_ps(wr[0] + i), a0 = FMA(u0, p, a0), a1 = FMA(u1, p, a1), a2 = FMA(u2, p, a2);
        p = _mm256_loadu_ps(wr[1] + i), a3 = FMA(u0, p, a3), a4 = FMA(u1, p, a4), a5 = FMA(u2, p, a5);
        p = _mm256_loadu_ps(wr[2] + i), a6 = FMA(u0, p, a6), a7 = FMA(u1, p, a7), a8 = FMA(u2, p, a8);
        p = _mm256_loadu_ps(wr[3] + i), a9 = FMA(u0, p, a9), a10 = FMA(u1, p, a10), a11 = FMA(u2, p, a11);
    }
    __m256 sums[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < c; r++) y[(size_t)(m0 + r) * n + o + j] = hsum(sums[3 * j + r]);
}

static void plain_product(int m, const float *x, const float *w, float *y, int n, int k) {
    int blocks = n / 4, passes = m == 8 ? 3 : 1, share = k / 4 / passes;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const char *ahead = (const char *)(w + (size_t)(b + 1 < blocks ? b + 1 : b) * 4 * k);
        if (m == 1) {
            plain_4x1(x, w, 4 * b, k, y);
            continue;
        }
        plain_tile(3, x, 0, w, 4 * b, k, y, n, ahead, share);
        plain_tile(3, x, 3, w, 4 * b, k, y, n, ahead + 64 * share, share);
        plain_tile(2, x, 6, w, 4 * b, k, y, n, ahead + 128 * share, share);
    }
}

// ---- packed panels: acc[r][16] += x rows m0 .. m0 + 3 (from xt [K][8]) against steps [s0, s1) of one panel
static inline void packed_4x16(const float *xt, int m0, const float *panel, int s0, int s1, float *acc, int ahead) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_load_ps(acc + 8 * j);
    __m256 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7];
    for (int i = s0; i < s1; i++) {
        if (ahead) _mm_prefetch((const char *)(panel + 16 * (i + ahead)), _MM_HINT_T0);
        __m256 v = _mm256_load_ps(panel + 16 * i), u = _mm256_load_ps(panel + 16 * i + 8), s;
        const float *xr = xt + 8 * i + m0;
        s = BROADCAST(xr + 0), a0 = FMA(v, s, a0), a1 = FMA(u, s, a1);
        s = BROADCAST(xr + 1), a2 = FMA(v, s, a2), a3 = FMA(u, s, a3);
        s = BROADCAST(xr + 2), a4 = FMA(v, s, a4), a5 = FMA(u, s, a5);
        s = BROADCAST(xr + 3), a6 = FMA(v, s, a6), a7 = FMA(u, s, a7);
    }
    __m256 out[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int j = 0; j < 8; j++) _mm256_store_ps(acc + 8 * j, out[j]);
}

static void packed_product(int m, const float *xt, const float *wp, float *y, int n, int k) {
    enum { CHUNK = 128 };
#pragma omp parallel for schedule(static)
    for (int p = 0; p < n / 16; p++) {
        const float *panel = wp + (size_t)p * k * 16;
        if (m == 1) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
            for (int i = 0; i < k; i += 2) {
                __m256 s = BROADCAST(xt + 8 * i), t = BROADCAST(xt + 8 * i + 8);
                a0 = FMA(_mm256_load_ps(panel + 16 * i), s, a0), a1 = FMA(_mm256_load_ps(panel + 16 * i + 8), s, a1);
                b0 = FMA(_mm256_load_ps(panel + 16 * i + 16), t, b0);
                b1 = FMA(_mm256_load_ps(panel + 16 * i + 24), t, b1);
            }
            _mm256_storeu_ps(y + 16 * p, _mm256_add_ps(a0, b0)), _mm256_storeu_ps(y + 16 * p + 8, _mm256_add_ps(a1, b1));
            continue;
        }
        float acc[8 * 16] __attribute__((aligned(32))) = {0};
        for (int c = 0; c < k; c += CHUNK) {
            int end = c + CHUNK < k ? c + CHUNK : k;
            packed_4x16(xt, 0, panel, c, end, acc, CHUNK);
            packed_4x16(xt, 4, panel, c, end, acc + 64, 0);
        }
        for (int r = 0; r < 8; r++)
            for (int j = 0; j < 16; j++) y[(size_t)r * n + 16 * p + j] = acc[16 * r + j];
    }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *t) {
    qsort(t, ROUNDS, sizeof(double), by_value);
    return t[ROUNDS / 2];
}

static float *floats(size_t count) {
    float *f = aligned_alloc(64, (count * 4 + 63) / 64 * 64);
    unsigned state = 12345;
    for (size_t i = 0; i < count; i++) state = state * 1664525u + 1013904223u, f[i] = (state >> 9) * 0x1p-23f - 0.5f;
    return f;
}

static void probe(int n, int k) {
    float *w = floats((size_t)n * k), *wp = floats((size_t)n * k), *x = floats(8 * (size_t)k);
    float *xt = floats(8 * (size_t)k + 16), *y = floats(8 * (size_t)n);
    for (size_t p = 0; p < (size_t)n / 16; p++)  // the packing: a copy at load, in a server
        for (size_t i = 0; i < (size_t)k; i++)
            for (int j = 0; j < 16; j++) wp[(p * k + i) * 16 + j] = w[(p * 16 + j) * k + i];
    for (int i = 0; i < k; i++)
        for (int r = 0; r < 8; r++) xt[8 * i + r] = x[(size_t)r * k + i];
    for (int m = 1; m <= 8; m += 7) {  // both layouts give every output; check a few against double sums
        for (int layout = 0; layout < 2; layout++) {
            layout ? packed_product(m, xt, wp, y, n, k) : plain_product(m, x, w, y, n, k);
            for (int r = 0; r < m; r++)
                for (int col = 0; col < n; col += n / 7) {
                    double exact = 0;
                    for (int i = 0; i < k; i++) exact += (double)x[(size_t)r * k + i] * w[(size_t)col * k + i];
                    if (fabs(y[(size_t)r * n + col] - exact) > 1e-3 * sqrt(k)) printf("WRONG: layout %d m %d\n", layout, m);
                }
        }
    }
    double t[5][ROUNDS];
    volatile float sink = 0;
    for (int r = 0; r < ROUNDS; r++) {
        double start = now();
        sink += read_all(w, (size_t)n * k);
        t[0][r] = now() - start;
        for (int c = 1; c < 5; c++) {
            int m = c <= 2 ? 8 : 1;
            start = now();
            c % 2 ? plain_product(m, x, w, y, n, k) : packed_product(m, xt, wp, y, n, k);
            t[c][r] = now() - start;
        }
    }
    double read = median(t[0]);
    printf("[M, %d] x [%d, %d], %.0f MB: read %.1f ms (%.1f GB/s)\n", k, k, n, n * (double)k * 4e-6, read * 1e3,
           n * (double)k * 4e-9 / read);
    const char *names[] = {"", "M = 8 plain", "M = 8 packed", "M = 1 plain", "M = 1 packed"};
    for (int c = 1; c < 5; c++) {
        double ms = median(t[c]);
        printf("  %-13s %7.1f ms  %.2fx the read\n", names[c], ms * 1e3, ms / read);
    }
    free(w), free(wp), free(x), free(xt), free(y);
    (void)sink;
}

static void from_cache(int k) {  // 64 weight rows (4 panels), M = 8, 2,000 times
    int n = 64, reps = 2000;
    float *w = floats((size_t)n * k), *x = floats(8 * (size_t)k), *xt = floats(8 * (size_t)k + 16), *y = floats(8 * n);
    for (int layout = 0; layout < 2; layout++) {
        double start = now();
        for (int r = 0; r < reps; r++) layout ? packed_product(8, xt, w, y, n, k) : plain_product(8, x, w, y, n, k);
        double each = (now() - start) / reps;
        printf("  K = %d, %s tile from cache: %.0f GFLOP/s\n", k, layout ? "packed 4 x 16" : "plain 4 x 3 ",
               2.0 * 8 * n * k / each * 1e-9);
    }
    free(w), free(x), free(xt), free(y);
}

int main(void) {
    printf("%d threads\n", omp_get_max_threads());
    probe(143360, 1536);
    probe(16384, 8960);
    from_cache(1536);
    from_cache(8960);
    return 0;
}
