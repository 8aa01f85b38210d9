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

from specedge.server._attention_numba import dot_4x1, dot_4x2
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
