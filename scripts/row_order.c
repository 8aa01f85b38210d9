// In what order should a small-M product read its weights when the memory streams fast? On a 2-core Zen 4 EPYC
// whose stream moves between 30 and 60 GB/s, the numba kernel's lone pass (M = 1-6) kept up with a read at the
// slow hours only. docs/engine-cpu.md's "M = 1 a row at a time" paragraph quotes this probe.
//
//     gcc -O3 -march=x86-64-v4 -fopenmp scripts/row_order.c -o /tmp/row_order && /tmp/row_order [rounds]
//
// y [M, N] = x [M, K] . W [N, K]^T, float32, at M = 1 and 5, over 24 copies of a 220 MB weight (K = 1536), each
// way timed in turn with a read of the same bytes (medians of 7, as multiples of the read):
// - rows, L lines: C twins of server/_forward_numba.py's lone pass: blocks of four weight rows as loaded, four
//   streams at once, prefetching L lines a step of the next block into L2 (4: all of it, as the kernel does on
//   Zen 4);
// - rows, 32 ahead: the same tile prefetching each of its four rows' line 32 steps on (past a row's end, the same
//   row of the next block): what the kernel's lone passes of five and six rows now do on Zen 4 (_LONE_AHEAD);
// - packed, L lines: the same tile over each block packed into one run ([K / 16][4][16]);
// - row by row (M = 1): one weight row after another, one sum vector over K, so that a thread's share of W is one
//   stream in memory order; what the kernel now does at M = 1 on Zen 4 (_row_by_row).
// Each round prints the read's GB/s first: compare ways within a round, never across rounds.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef K
#define K 1536  // -DK=...: another shape of the same 220 MB
#endif
#define N (55050240L / K / 4 * 4)  // 220 MB of float32, a multiple of four rows
#define COPIES 24
#define ROUNDS 7

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// One block of four weight rows against M x rows (M = 1 or 5), prefetching `lines` lines a step from `next`.
#define TILE(M)                                                                                                   \
    static void tile_##M(const float *x, const float *block, int packed, float *y, long o, const float *next,     \
                         int lines, int ahead) {                                                                  \
        __m512 sums[4][M];                                                                                        \
        for (int r = 0; r < 4; r++)                                                                               \
            for (int m = 0; m < M; m++) sums[r][m] = _mm512_setzero_ps();                                         \
        for (long i = 0; i < K / 16; i++) {                                                                       \
            __m512 w[4];                                                                                          \
            for (int r = 0; r < 4; r++) w[r] = _mm512_loadu_ps(packed ? block + 64 * i + 16 * r : block + r * K + 16 * i); \
            for (int p = 0; p < lines; p++) _mm_prefetch((const char *)(next + (lines * i + p) * 16), _MM_HINT_T1); \
            for (int r = 0; r < 4 && ahead; r++) {                                                                \
                long j = i + ahead;                                                                               \
                const float *line = j < K / 16 ? block + r * K + 16 * j : next + r * K + 16 * (j - K / 16);       \
                _mm_prefetch((const char *)line, _MM_HINT_T1);                                                    \
            }                                                                                                     \
            for (int m = 0; m < M; m++) {                                                                         \
                __m512 u = _mm512_loadu_ps(x + m * K + 16 * i);                                                   \
                for (int r = 0; r < 4; r++) sums[r][m] = _mm512_fmadd_ps(w[r], u, sums[r][m]);                    \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < M; m++)                                                                               \
            for (int r = 0; r < 4; r++) y[m * N + o + r] = _mm512_reduce_add_ps(sums[r][m]);                      \
    }
TILE(1)
TILE(5)

static void blocks(int m, const float *x, const float *w, int packed, float *y, int lines, int ahead) {
    long count = N / 4;
#pragma omp parallel for schedule(static)
    for (long b = 0; b < count; b++) {
        const float *next = w + (b + 1 < count ? b + 1 : b) * 4 * K;  // the last block prefetches itself
        if (m == 1)
            tile_1(x, w + b * 4 * K, packed, y, 4 * b, next, lines, ahead);
        else
            tile_5(x, w + b * 4 * K, packed, y, 4 * b, next, lines, ahead);
    }
}

static void row_by_row(const float *x, const float *w, float *y) {
#pragma omp parallel for schedule(static)
    for (long j = 0; j < N; j++) {
        __m512 sum = _mm512_setzero_ps();
        for (long i = 0; i < K; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + j * K + i), sum);
        y[j] = _mm512_reduce_add_ps(sum);
    }
}

static float sink;

static void read_all(float **w) {
    for (int c = 0; c < COPIES; c++) {
        __m512 total = _mm512_setzero_ps();
#pragma omp parallel
        {
            __m512 a = _mm512_setzero_ps(), b = a, d = a, e = a;
#pragma omp for schedule(static)
            for (long i = 0; i < (long)N * K / 64; i++) {
                a = _mm512_add_ps(a, _mm512_loadu_ps(w[c] + 64 * i));
                b = _mm512_add_ps(b, _mm512_loadu_ps(w[c] + 64 * i + 16));
                d = _mm512_add_ps(d, _mm512_loadu_ps(w[c] + 64 * i + 32));
                e = _mm512_add_ps(e, _mm512_loadu_ps(w[c] + 64 * i + 48));
            }
#pragma omp critical
            total = _mm512_add_ps(total, _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(d, e)));
        }
        sink += _mm512_reduce_add_ps(total);
    }
}

static int compare(const void *a, const void *b) { return (*(const double *)a > *(const double *)b) - (*(const double *)a < *(const double *)b); }

static double median(double *v) {
    qsort(v, ROUNDS, sizeof *v, compare);
    return v[ROUNDS / 2];
}

enum { READ, ROWS0, ROWS4, ROWS_AHEAD, PACKED0, PACKED4, ROW_BY_ROW, WAYS };
static const char *names[WAYS] = {"read",           "rows, 0 lines",   "rows, 4 lines", "rows, 32 ahead",
                                  "packed, 0 lines", "packed, 4 lines", "row by row"};

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 3;
    float *plain[COPIES], *packed[COPIES], *x = malloc(5 * K * sizeof(float)), *y = malloc(5L * N * sizeof(float));
    srand(0);
    for (int i = 0; i < 5 * K; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    for (int c = 0; c < COPIES; c++) {
        plain[c] = aligned_alloc(64, (size_t)N * K * sizeof(float));
        packed[c] = aligned_alloc(64, (size_t)N * K * sizeof(float));
        for (long i = 0; i < (long)N * K; i++) plain[c][i] = rand() / (float)RAND_MAX - 0.5f;
        for (long b = 0; b < N / 4; b++)  // packed[b][s][r][l] = plain[4 b + r][16 s + l]
            for (long s = 0; s < K / 16; s++)
                for (int r = 0; r < 4; r++)
                    memcpy(packed[c] + b * 4 * K + s * 64 + r * 16, plain[c] + (4 * b + r) * K + 16 * s, 64);
    }
    for (int round = 0; round < rounds; round++) {
        for (int m = 1; m <= 5; m += 4) {
            double times[WAYS][ROUNDS];
            for (int repeat = 0; repeat <= ROUNDS; repeat++) {  // the first is untimed (page faults)
                for (int way = 0; way < WAYS; way++) {
                    if (way == ROW_BY_ROW && m != 1) continue;
                    double start = now();
                    if (way == READ) read_all(plain);
                    for (int c = 0; c < COPIES && way != READ; c++) {
                        if (way == ROW_BY_ROW) row_by_row(x, plain[c], y);
                        else {
                            int lines = way == ROWS4 || way == PACKED4 ? 4 : 0, ahead = way == ROWS_AHEAD ? 32 : 0;
                            blocks(m, x, way <= ROWS_AHEAD ? plain[c] : packed[c], way >= PACKED0, y, lines, ahead);
                        }
                    }
                    if (repeat) times[way][repeat - 1] = now() - start;
                }
            }
            double read = median(times[READ]);
            printf("M = %d, read at %.1f GB/s:", m, COPIES * (double)N * K * 4 / read / 1e9);
            for (int way = 1; way < WAYS; way++)
                if (way != ROW_BY_ROW || m == 1) printf("  %s %.2fx", names[way], median(times[way]) / read);
            printf("\n");
            fflush(stdout);
        }
    }
    return 0;
}
