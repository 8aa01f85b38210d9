"""The compiled loop behind server/attention.py's `numba` path (imported only where numba is installed).

Every short row of a step (a decode token, a verify chain or tree) attends to its
own KV slot in one call: one parallel task per (row, KV head), reading the slot in
place. A task scores each visible key against the G query heads that share the KV
head while the key is in cache, takes a softmax per query head, and sums the
values the same way. On a CPU this replaces one scaled-dot-product call per row
and layer (about 0.1 ms each on the 2-core EPYC of bench/results, whatever the
row's size) with a few microseconds of arithmetic.

A query at new position t sees every cached key and its row's new keys j <= t:
all of them in a chain, its ancestors in a tree (tree_masks). Keys past t are
never read.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from specedge.server._race_numba import set_threads  # noqa: F401 - the one thread setting for every kernel

# Dot products and sums may be reassociated (vectorized); infinities and NaNs keep their IEEE meaning.
_FAST = {"reassoc", "contract", "nsz"}
NO_TREE = -1  # tree_offsets' value for a chain row
_ZERO = np.float32(0.0)


# cache=True: numba keeps the compiled kernel on disk (it takes ~8 s to compile, once per process otherwise). Its
# cache watches this file only, so everything it calls is defined here; dot_4x2 and dot_4x1 serve the matrix
# kernel too (server/_matmul_numba.py, compiled afresh in each process).
@njit(parallel=True, fastmath=_FAST, cache=True)
def attend(q, k_cache, v_cache, starts, num_new, slots, num_cached, tree_offsets, tree_masks, out):
    """out[starts[r] + t, h] = softmax(q . keys / sqrt(D)) . values over the keys row r's token t sees.

    q, out [N, H, D]; k_cache, v_cache [num_slots, max_len, KVH, D] (C-contiguous); per row r: starts,
    num_new, slots, num_cached, tree_offsets (NO_TREE, or where its [num_new, num_new] ancestor mask
    begins in tree_masks).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for task in prange(slots.shape[0] * num_kv_heads):
        r, kv_head = task // num_kv_heads, task % num_kv_heads
        slot, cached, new, tree = slots[r], num_cached[r], num_new[r], tree_offsets[r]
        num_queries, num_keys = new * group, cached + new
        # The row's queries for this KV head, scaled: query i is token i // G, head kv_head * G + i % G.
        queries = np.empty((num_queries, head_dim), np.float32)
        for i in range(num_queries):
            for d in range(head_dim):
                queries[i, d] = q[starts[r] + i // group, kv_head * group + i % group, d] * scale
        scores = np.empty((num_queries, num_keys), np.float32)
        powers = np.empty(num_keys, np.int32)
        _scores(queries, k_cache, slot, kv_head, num_keys, scores)
        for i in range(num_queries):
            t = i // group
            seen = cached + t + 1  # a chain's and a tree's keys both end at the query's own
            for key in range(seen, num_keys):
                scores[i, key] = 0.0
            if tree != NO_TREE:
                for j in range(t + 1):
                    if not tree_masks[tree + t * new + j]:
                        scores[i, cached + j] = -np.inf
            top = -np.inf
            for key in range(seen):
                top = max(top, scores[i, key])
            _exp_minus(scores[i], seen, top, powers)
            if tree != NO_TREE:  # exactly nothing from the keys the tree hides
                for j in range(t + 1):
                    if not tree_masks[tree + t * new + j]:
                        scores[i, cached + j] = 0.0
            total = np.float32(0.0)
            for key in range(seen):
                total += scores[i, key]
            inverse = np.float32(1.0) / total
            for key in range(seen):
                scores[i, key] *= inverse
        sums = np.zeros((num_queries, head_dim), np.float32)
        _weighted_values(scores, v_cache, slot, kv_head, num_keys, sums)
        for i in range(num_queries):
            for d in range(head_dim):
                out[starts[r] + i // group, kv_head * group + i % group, d] = sums[i, d]


# Cephes' expf: exp(x) = 2**n * e**r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e**r by a
# degree-6 polynomial; within 2 ulp in float32. Written out so that LLVM vectorizes it: numba's math.exp is a
# scalar libm call per key.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2))
_EXP_POLY_TAIL = (np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))
_EXP_FLOOR = np.float32(-87.0)  # e**-87 is a normal float32; below it a weight is as good as zero


@njit(fastmath=_FAST)
def _exp_minus(row, count, top, powers):
    """row[:count] = exp(row[:count] - top) for values <= top (-inf gives e**-87, not 0); powers: scratch [count]."""
    c0, c1, c2, c3 = _EXP_POLY
    c4, c5 = _EXP_POLY_TAIL
    for k in range(count):
        x = max(row[k] - top, _EXP_FLOOR)
        n = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - n * _LN2_HI - n * _LN2_LO
        row[k] = ((((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5) * r * r) + r + np.float32(1.0)
        powers[k] = (np.int32(n) + np.int32(127)) << np.int32(23)
    scale = powers[:count].view(np.float32)
    for k in range(count):
        row[k] *= scale[k]


@njit(fastmath=_FAST)
def _scores(queries, k_cache, slot, kv_head, num_keys, scores):
    """scores[i, key] = queries[i] . k_cache[slot, key, kv_head]: two queries by four keys at a time (the
    matrix kernel's blocking), so each key is read from memory once and each pair of queries from cache."""
    num_queries = queries.shape[0]
    max_len, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[slot].reshape(max_len * num_kv_heads, head_dim)  # key k of this head: row k * KVH + kv_head
    key = 0
    while key + 4 <= num_keys:
        row = key * num_kv_heads + kv_head
        i = 0
        while i + 1 < num_queries:
            dot_4x2(queries, i, i + 1, keys, row, num_kv_heads, scores, key)
            i += 2
        if i < num_queries:
            dot_4x1(queries, i, keys, row, num_kv_heads, scores, key)
        key += 4
    for k in range(key, num_keys):  # the last 1-3 keys
        for i in range(num_queries):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += queries[i, d] * keys[k * num_kv_heads + kv_head, d]
            scores[i, k] = dot


@njit(fastmath=_FAST)
def _weighted_values(weights, v_cache, slot, kv_head, num_keys, sums):
    """sums[i] += sum over keys of weights[i, key] * v_cache[slot, key, kv_head], four keys at a time."""
    num_queries, head_dim = sums.shape
    key = 0
    while key + 4 <= num_keys:
        for i in range(num_queries):
            w0, w1, w2, w3 = weights[i, key], weights[i, key + 1], weights[i, key + 2], weights[i, key + 3]
            for d in range(head_dim):
                sums[i, d] += (
                    w0 * v_cache[slot, key, kv_head, d]
                    + w1 * v_cache[slot, key + 1, kv_head, d]
                    + w2 * v_cache[slot, key + 2, kv_head, d]
                    + w3 * v_cache[slot, key + 3, kv_head, d]
                )
        key += 4
    for k in range(key, num_keys):
        for i in range(num_queries):
            weight = weights[i, k]
            for d in range(head_dim):
                sums[i, d] += weight * v_cache[slot, k, kv_head, d]


def warm_up() -> None:
    """Compile now (a few seconds), not in the first step; check one known answer."""
    q = np.zeros((2, 2, 4), np.float32)  # two tokens of a chain, two heads sharing one KV head
    keys = np.zeros((1, 4, 1, 4), np.float32)
    values = np.arange(16, dtype=np.float32).reshape(1, 4, 1, 4)
    out = np.empty_like(q)
    one = np.ones(1, np.int64)
    attend(
        q, keys, values, np.zeros(1, np.int64), 2 * one, np.zeros(1, np.int64), 2 * one, -one, np.ones(0, np.bool_), out
    )
    # Equal scores: token 0 averages keys 0-2, token 1 keys 0-3.
    expected = np.stack([values[0, :3, 0].mean(0), values[0, :4, 0].mean(0)])[:, None].repeat(2, 1)
    if not np.allclose(out, expected):
        raise RuntimeError(f"the compiled attention is wrong: {out}")


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
