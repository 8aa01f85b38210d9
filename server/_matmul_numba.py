"""The compiled loop behind server/matmul.py's `numba` path (imported only where numba is installed).

y = x @ w.T for float32 x [M, K] and w [N, K], both row-major: the layout the
checkpoint already has, so no packed copy is made. Each thread takes blocks of
four weight rows and walks x two rows at a time, so a weight row is read from
memory once per pair of x rows and then from cache. At M = 1-40 this reads the
weights at the machine's memory speed, where oneDNN and MKL reach 50-85% of it
(`specedge-bench engine`'s kernel table). Larger M are left to oneDNN, whose
blocked GEMM reuses each weight over many more rows.

From two row pairs on, the passes that read a block from cache would leave the
memory idle, so each pass also prefetches its share of the next block's lines,
one line every step or two: `_dot_4x2_prefetching`, written in LLVM IR because
a prefetch inside a numba loop stops LLVM from vectorizing it. Prefetching a
whole share at once, between passes, was slower (README.md's 8 x 1 paragraph).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from specedge.server._attention_numba import dot_4x1, dot_4x2
from specedge.server._race_numba import set_threads  # noqa: F401 - the one thread setting for both kernels

_ZERO = np.float32(0.0)
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V8 = ir.VectorType(_F32, 8)
_I8P = ir.IntType(8).as_pointer()
_TO_L2 = 2  # llvm.prefetch's locality: 2 fills L2 (prefetcht1); into L1 (3) was slower at K = 8960


def warm_up() -> None:
    """Compile now (about a second), not in the first step."""
    for rows, columns in ((3, 5), (4, 8)):  # the plain loops, and the prefetching tile
        x, w = np.ones((rows, columns), np.float32), np.ones((6, columns), np.float32)
        y = np.empty((rows, 6), np.float32)
        matmul(x, w, y)
        if not np.array_equal(y, np.full((rows, 6), columns, np.float32)):
            raise RuntimeError(f"the compiled product is wrong: {y}")


@njit(parallel=True, fastmath=True)
def matmul(x, w, y):
    m_rows, k = x.shape
    n = w.shape[0]
    pairs = m_rows // 2
    prefetching = pairs >= 2 and k >= 8 and k % 8 == 0  # the tile divides by k / 8
    full_blocks = n // 4
    share = (k // 4) // max(pairs, 1)  # a pass's share of a block's 4 k / 16 lines: at most k / 8, one a vector
    for block in prange((n + 3) // 4):
        o = block * 4
        if o + 4 <= n:
            ahead = min(block + 1, full_blocks - 1) * 4 * k  # the last block prefetches itself, harmlessly
            for pair in range(pairs):
                if prefetching:
                    _dot_4x2_prefetching(x, 2 * pair, 2 * pair + 1, w, o, y, ahead + pair * share * 16, share)
                else:
                    dot_4x2(x, 2 * pair, 2 * pair + 1, w, o, 1, y, o)
            if m_rows % 2:
                dot_4x1(x, m_rows - 1, w, o, 1, y, o)
        else:  # the last 1-3 weight rows
            for j in range(o, n):
                for m in range(m_rows):
                    acc = _ZERO
                    for i in range(k):
                        acc += x[m, i] * w[j, i]
                    y[m, j] = acc


@intrinsic
def _dot_4x2_prefetching(typingctx, x, m0, m1, w, o, y, ahead, lines):
    """y[m0 and m1, o:o + 4] = rows m0, m1 of x [M, K] . rows o..o + 3 of w [N, K] (float32, C order, K a multiple
    of 8), eight lanes a step, while prefetching `lines` (<= K / 8) 64-byte lines from w.ravel()[ahead:], evenly
    spread over the steps. dot_4x2's loop, written in IR so that the prefetch does not stop it vectorizing."""
    if any(array.layout != "C" for array in (x, w, y)):
        return None  # the IR steps through rows by their length: a strided array fails to type, loudly

    def codegen(context, builder, signature, args):
        xs, ws, ys = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 5))
        m0, m1, o, ahead, lines = args[1], args[2], args[4], args[6], args[7]
        k, n = builder.extract_value(xs.shape, 1), builder.extract_value(ys.shape, 1)
        x_rows = [builder.gep(xs.data, [builder.mul(m, k)]) for m in (m0, m1)]
        w_rows = [builder.gep(ws.data, [builder.mul(builder.add(o, _I64(j)), k)]) for j in range(4)]
        prefetched = builder.gep(ws.data, [ahead])
        steps = builder.lshr(k, _I64(3))
        per_step = builder.sdiv(builder.shl(lines, _I64(16)), steps)  # lines a step, in 1/65536ths
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fmuladd.v8f32")
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]), "llvm.prefetch.p0"
        )
        entry = builder.block
        head, body, done = (builder.append_basic_block(name) for name in ("head", "body", "done"))
        builder.branch(head)
        builder.position_at_end(head)
        step = builder.phi(_I64)
        sums = [builder.phi(_V8) for _ in range(8)]  # row m0 against w rows o..o + 3, then row m1
        builder.cbranch(builder.icmp_signed("<", step, steps), body, done)

        builder.position_at_end(body)
        first = builder.shl(step, _I64(3))

        def load(row):
            return builder.load(builder.bitcast(builder.gep(row, [first]), _V8.as_pointer()), align=4)

        u, v = (load(row) for row in x_rows)
        p = [load(row) for row in w_rows]
        new = [builder.call(fma, [a, b, total]) for a, b, total in zip([u] * 4 + [v] * 4, p + p, sums)]
        line = builder.ashr(builder.mul(step, per_step), _I64(16))
        address = builder.bitcast(builder.gep(prefetched, [builder.shl(line, _I64(4))]), _I8P)
        builder.call(prefetch, [address, _I32(0), _I32(_TO_L2), _I32(1)])
        next_step = builder.add(step, _I64(1))
        builder.branch(head)
        step.add_incoming(_I64(0), entry)
        step.add_incoming(next_step, body)
        for total, updated in zip(sums, new):
            total.add_incoming(ir.Constant(_V8, [0.0] * 8), entry)
            total.add_incoming(updated, body)

        builder.position_at_end(done)
        for index, total in enumerate(sums):
            m, j = (m0, m1)[index // 4], index % 4
            out = builder.gep(ys.data, [builder.add(builder.mul(m, n), builder.add(o, _I64(j)))])
            builder.store(_horizontal_sum(builder, total), out)
        return context.get_dummy_value()

    return types.none(x, m0, m1, w, o, y, ahead, lines), codegen


def _horizontal_sum(builder, vector):
    """The eight lanes' sum: halves added, then quarters, then the last two."""
    for width in (4, 2, 1):
        low = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
        high = builder.shuffle_vector(
            vector, vector, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width)))
        )
        vector = builder.fadd(low, high)
    return builder.extract_element(vector, _I32(0))
