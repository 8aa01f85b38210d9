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
                dot_4x2(x, m, m + 1, w, o, 1, y, o)
                m += 2
            if m < m_rows:
                dot_4x1(x, m, w, o, 1, y, o)
        else:  # the last 1-3 weight rows
            for j in range(o, n):
                for m in range(m_rows):
                    acc = _ZERO
                    for i in range(k):
                        acc += x[m, i] * w[j, i]
                    y[m, j] = acc


@njit(inline="always", fastmath=True)
def dot_4x2(x, m0, m1, w, o, step, out, column):
    """Rows m0 and m1 of x [M, K] against rows o, o + step, o + 2 step, o + 3 step of w [N, K], into
    out[m0 and m1, column:column + 4]: eight dot products, kept in registers (numba keeps scalars there,
    not arrays), each w row read once for both."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _ZERO
    for i in range(x.shape[1]):
        u, v = x[m0, i], x[m1, i]
        p0, p1, p2, p3 = w[o, i], w[o + step, i], w[o + 2 * step, i], w[o + 3 * step, i]
        a0 += u * p0
        a1 += u * p1
        a2 += u * p2
        a3 += u * p3
        b0 += v * p0
        b1 += v * p1
        b2 += v * p2
        b3 += v * p3
    out[m0, column], out[m0, column + 1], out[m0, column + 2], out[m0, column + 3] = a0, a1, a2, a3
    out[m1, column], out[m1, column + 1], out[m1, column + 2], out[m1, column + 3] = b0, b1, b2, b3


@njit(inline="always", fastmath=True)
def dot_4x1(x, m, w, o, step, out, column):
    """Row m of x against four rows of w, into out[m, column:column + 4], as dot_4x2."""
    a0 = a1 = a2 = a3 = _ZERO
    for i in range(x.shape[1]):
        u = x[m, i]
        a0 += u * w[o, i]
        a1 += u * w[o + step, i]
        a2 += u * w[o + 2 * step, i]
        a3 += u * w[o + 3 * step, i]
    out[m, column], out[m, column + 1], out[m, column + 2], out[m, column + 3] = a0, a1, a2, a3
