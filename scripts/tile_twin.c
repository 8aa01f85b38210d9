// A C twin of server/_forward_numba.py's 3 x 8 tile (AVX-512): y[8, N] = x[8, K] . w[N, K]^T in blocks of three
// weight rows, each block in one pass that keeps 24 sums in registers and prefetches `lines` lines a step of the
// next block into L2. It sums in the kernel's order, so its bits equal the kernel's.
//
//     gcc -O3 -march=x86-64-v4 -fopenmp -shared -fPIC scripts/tile_twin.c -o /tmp/tile_twin.so
//     python scripts/tile_twin.py
//
// GCC keeps the tile in registers; LLVM, compiling the kernel's IR, spilled sums to the stack every step until
// the kernel fenced its steps (docs/engine-cpu.md). tile_twin.py times the two in turn.
#include <immintrin.h>
#include <omp.h>

static void tile(const float *x, long k, const float *w, float *y, long n, long o, const float *next, int lines) {
    __m512 sums[3][8];
    for (int r = 0; r < 3; r++)
        for (int m = 0; m < 8; m++) sums[r][m] = _mm512_setzero_ps();
    const float *w0 = w + o * k, *w1 = w0 + k, *w2 = w1 + k;
    for (long i = 0; i < k / 16; i++) {
        __m512 a = _mm512_loadu_ps(w0 + 16 * i), b = _mm512_loadu_ps(w1 + 16 * i), c = _mm512_loadu_ps(w2 + 16 * i);
        for (int p = 0; p < lines; p++) _mm_prefetch((const char *)(next + (lines * i + p) * 16), _MM_HINT_T1);
        for (int m = 0; m < 8; m++) {
            __m512 u = _mm512_loadu_ps(x + m * k + 16 * i);
            sums[0][m] = _mm512_fmadd_ps(a, u, sums[0][m]);
            sums[1][m] = _mm512_fmadd_ps(b, u, sums[1][m]);
            sums[2][m] = _mm512_fmadd_ps(c, u, sums[2][m]);
        }
    }
    for (int m = 0; m < 8; m++)
        for (int r = 0; r < 3; r++) y[m * n + o + r] = _mm512_reduce_add_ps(sums[r][m]);
}

// n a multiple of 3, k of 16; the last block prefetches itself, as the kernel's does.
void product(const float *x, const float *w, float *y, long n, long k, int lines) {
    long blocks = n / 3;
#pragma omp parallel for schedule(static)
    for (long b = 0; b < blocks; b++) tile(x, k, w, y, n, 3 * b, w + (b + 1 < blocks ? b + 1 : b) * 3 * k, lines);
}
