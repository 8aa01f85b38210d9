"""The compiled loop behind server/matmul.py's `numba` path (imported only where numba is installed).

y = x @ w.T for float32 x [M, K] and w [N, K], both row-major: the layout the
checkpoint already has, so no packed copy is made. Each thread takes blocks of
four weight rows and walks x two rows at a time, so a weight row is read from
memory once per pair of x rows and then from cache. At M = 1-40 this reads the
weights at the machine's memory speed, where oneDNN and MKL reach 50-85% of it
(`specedge-bench engine`'s kernel table). Larger M are left to oneDNN, whose
blocked GEMM reuses each weight over many more rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from specedge.server._race_numba import set_threads  # noqa: F401 - the one thread setting for both kernels

_ZERO = np.float32(0.0)


def warm_up() -> None:
    """Compile now (about a second), not in the first step."""
    x, w = np.ones((3, 5), np.float32), np.ones((6, 5), np.float32)
    y = np.empty((3, 6), np.float32)
    matmul(x, w, y)
    if not np.array_equal(y, np.full((3, 6), 5.0, np.float32)):
        raise RuntimeError(f"the compiled product is wrong: {y}")


@njit(parallel=True, fastmath=True)
def matmul(x, w, y):
    m_rows, k = x.shape
    n = w.shape[0]
    for block in prange((n + 3) // 4):
        o = block * 4
        if o + 4 <= n:
            m = 0
            while m + 1 < m_rows:
                a0 = _ZERO
                a1 = _ZERO
                a2 = _ZERO
                a3 = _ZERO
                b0 = _ZERO
                b1 = _ZERO
                b2 = _ZERO
                b3 = _ZERO
                for i in range(k):
                    u = x[m, i]
                    v = x[m + 1, i]
                    p0 = w[o, i]
                    p1 = w[o + 1, i]
                    p2 = w[o + 2, i]
                    p3 = w[o + 3, i]
                    a0 += u * p0
                    a1 += u * p1
                    a2 += u * p2
                    a3 += u * p3
                    b0 += v * p0
                    b1 += v * p1
                    b2 += v * p2
                    b3 += v * p3
                y[m, o] = a0
                y[m, o + 1] = a1
                y[m, o + 2] = a2
                y[m, o + 3] = a3
                y[m + 1, o] = b0
                y[m + 1, o + 1] = b1
                y[m + 1, o + 2] = b2
                y[m + 1, o + 3] = b3
                m += 2
            if m < m_rows:
                a0 = _ZERO
                a1 = _ZERO
                a2 = _ZERO
                a3 = _ZERO
                for i in range(k):
                    u = x[m, i]
                    a0 += u * w[o, i]
                    a1 += u * w[o + 1, i]
                    a2 += u * w[o + 2, i]
                    a3 += u * w[o + 3, i]
                y[m, o] = a0
                y[m, o + 1] = a1
                y[m, o + 2] = a2
                y[m, o + 3] = a3
        else:  # the last 1-3 weight rows
            for j in range(o, n):
                for m in range(m_rows):
                    acc = _ZERO
                    for i in range(k):
                        acc += x[m, i] * w[j, i]
                    y[m, j] = acc
