"""The compiled decoder layer behind server/layer_kernel.py (imported only where numba is installed).

One call runs a whole layer over a step's packed tokens, in place on the residual
stream x [N, hidden]: RMSNorm, the fused q/k/v product (server/_matmul_numba.py),
Qwen3's per-head norms, RoPE, the KV writes, every row's attention
(server/_attention_numba.py), o_proj, RMSNorm, gate/up, SiLU, down_proj. The
products and the attention are the kernels the module path calls one by one; what
this adds is the glue between them, so the step returns to Python once a layer
instead of after every product and every torch op. Each of those returns ran cold:
a product streams tens of megabytes of weights through the caches, and the
interpreter and torch's dispatcher then missed on their own code and data.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from specedge.server._attention_numba import attend
from specedge.server._matmul_numba import matmul
from specedge.server._race_numba import _exp, set_threads  # noqa: F401 - the one thread setting for every kernel

# As the attention kernel's: sums may be reassociated (vectorized); infinities and NaNs keep their meaning.
_FAST = {"reassoc", "contract", "nsz"}
_ONE = np.float32(1.0)
_EXP_FLOOR = np.float32(-80.0)  # _exp's domain; e**-80 is 1.8e-35, nothing next to 1
_SILU_CHUNK = 2048  # columns per parallel task


@njit(fastmath=_FAST)
def _rms_norm(x, weight, eps, out):
    """out = weight * x / sqrt(mean(x ** 2) + eps), for one vector x [D]."""
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        total += x[j] * x[j]
    scale = _ONE / np.sqrt(total / np.float32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = weight[j] * (x[j] * scale)


@njit(fastmath=_FAST)
def _rms_norm_rows(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rms_norm(x[t], weight, eps, out[t])


@njit(fastmath=_FAST)
def _rope_head(head, cos, sin, out):
    """RoPE on one head's [D] vector: head * cos + rotate_half(head) * sin (transformers' layout)."""
    half = head.shape[0] // 2
    for d in range(half):
        out[d] = head[d] * cos[d] - head[d + half] * sin[d]
        out[d + half] = head[d + half] * cos[d + half] + head[d] * sin[d + half]


@njit(fastmath=_FAST)
def _positions(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, kv_slots, kv_positions, q):
    """Split qkv [N, (H + 2 KVH) D] into q [N, H, D] (normed per head where q_norm is given, rotated) and
    each token's key (likewise) and value, written to its KV slot and position."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    normed = np.empty(head_dim, np.float32)
    for t in range(qkv.shape[0]):
        slot, position = kv_slots[t], kv_positions[t]
        for head in range(num_heads + num_kv_heads):
            vector = qkv[t, head * head_dim : (head + 1) * head_dim]
            weights = q_norm if head < num_heads else k_norm
            out = q[t, head] if head < num_heads else k_cache[slot, position, head - num_heads]
            if weights.shape[0]:
                _rms_norm(vector, weights, eps, normed)
                _rope_head(normed, cos[t], sin[t], out)
            else:
                _rope_head(vector, cos[t], sin[t], out)
        values = (num_heads + num_kv_heads) * head_dim
        for head in range(num_kv_heads):
            for d in range(head_dim):
                v_cache[slot, position, head, d] = qkv[t, values + head * head_dim + d]


@njit(parallel=True, fastmath=_FAST)
def _silu_mul(gate_up, out):
    """out = silu(gate) * up for gate_up [N, 2 I] = [gate | up], vectorized (libm's exp is a call per value)."""
    num, inner = out.shape
    chunks = (inner + _SILU_CHUNK - 1) // _SILU_CHUNK
    for task in prange(num * chunks):
        t, start = task // chunks, (task % chunks) * _SILU_CHUNK
        for j in range(start, min(start + _SILU_CHUNK, inner)):
            gate = gate_up[t, j]
            small = _exp(max(-abs(gate), _EXP_FLOOR))  # e**-|gate|: sigmoid(gate) is 1 / (1 + it), or it / (1 + it)
            sigmoid = (_ONE if gate >= 0 else small) / (_ONE + small)
            out[t, j] = gate * sigmoid * gate_up[t, inner + j]


@njit(fastmath=_FAST)
def _add(x, y):
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] += y[t, j]


@njit(fastmath=_FAST)
def decoder_layer(
    x,
    eps,
    input_norm,
    qkv_weight,
    qkv_bias,
    q_norm,
    k_norm,
    o_weight,
    post_norm,
    gate_up_weight,
    down_weight,
    cos,
    sin,
    k_cache,
    v_cache,
    kv_slots,
    kv_positions,
    starts,
    num_new,
    slots,
    num_cached,
    tree_offsets,
    tree_masks,
    num_heads,
):
    """One layer over x [N, hidden] in place (x += attention(norm(x)); x += mlp(norm(x))).

    Weights as server/matmul.py's PlainLinear holds them ([out, in], q/k/v and gate/up fused); qkv_bias,
    q_norm and k_norm may be empty (none). cos, sin [N, D]; the caches and the rows' arrays as
    _attention_numba.attend takes them, every row of the step among them.
    """
    num, hidden = x.shape
    head_dim = k_cache.shape[3]
    normed = np.empty_like(x)
    _rms_norm_rows(x, input_norm, eps, normed)
    qkv = np.empty((num, qkv_weight.shape[0]), np.float32)
    matmul(normed, qkv_weight, qkv)
    if qkv_bias.shape[0]:
        for t in range(num):
            for j in range(qkv.shape[1]):
                qkv[t, j] += qkv_bias[j]
    q = np.empty((num, num_heads, head_dim), np.float32)
    _positions(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, kv_slots, kv_positions, q)
    attended = np.empty_like(q)
    attend(q, k_cache, v_cache, starts, num_new, slots, num_cached, tree_offsets, tree_masks, attended)
    projected = np.empty_like(x)
    matmul(attended.reshape((num, num_heads * head_dim)), o_weight, projected)
    _add(x, projected)
    _rms_norm_rows(x, post_norm, eps, normed)
    gate_up = np.empty((num, gate_up_weight.shape[0]), np.float32)
    matmul(normed, gate_up_weight, gate_up)
    activated = np.empty((num, down_weight.shape[1]), np.float32)
    _silu_mul(gate_up, activated)
    matmul(activated, down_weight, projected)
    _add(x, projected)


def warm_up() -> None:
    """Compile now (a few seconds), not in the first step; check one known answer."""
    num, hidden, heads, head_dim, inner = 2, 8, 2, 4, 6
    x = np.arange(num * hidden, dtype=np.float32).reshape(num, hidden)
    zeros = np.zeros  # with zero weights the layer adds nothing, and each value is its bias
    caches = zeros((1, 4, 1, head_dim), np.float32), zeros((1, 4, 1, head_dim), np.float32)
    positions = np.arange(num, dtype=np.int64)
    rows = np.zeros(1, np.int64), np.full(1, num, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    before = x.copy()
    decoder_layer(
        x,
        np.float32(1e-6),
        np.ones(hidden, np.float32),
        zeros(((heads + 2) * head_dim, hidden), np.float32),
        np.ones((heads + 2) * head_dim, np.float32),
        zeros(0, np.float32),
        zeros(0, np.float32),
        zeros((hidden, heads * head_dim), np.float32),
        np.ones(hidden, np.float32),
        zeros((2 * inner, hidden), np.float32),
        zeros((hidden, inner), np.float32),
        np.ones((num, head_dim), np.float32),
        zeros((num, head_dim), np.float32),
        *caches,
        zeros(num, np.int64),
        positions,
        *rows,
        np.full(1, -1, np.int64),
        zeros(0, np.bool_),
        heads,
    )
    if not np.array_equal(x, before) or not np.array_equal(caches[1][0, :num], np.ones((num, 1, head_dim))):
        raise RuntimeError(f"the compiled layer is wrong: {x}, {caches[1]}")
