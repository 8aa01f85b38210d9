"""Counter-based sampling noise: a pure function of (seed, position, stream, token id).

Every random number SpecEdge samples with comes from here, on the server and on
the edge alike. Nothing is drawn from a generator's state, so a sampled token
depends only on its seed, its position in the sequence and the distribution
it is drawn from: never on how many drafts were verified around it, which
rows shared its batch, or which device ran it.

The hash is written with nothing but `^`, `>>`, `*` and `&` on non-negative
integers below 2**32, and every product stays below 2**63. The same code
therefore runs, bit for bit, on Python ints, numpy int64 arrays and torch
int64 tensors on any device, so a llama.cpp edge needs neither torch nor this
module's callers' dtypes to reproduce the server's noise.

    key  = row_key(seed, position, stream)        # one per sampled position (Python int; vectorized:
                                                   # position_key(seed_key(seed), positions, stream))
    bits = token_bits(key, token_ids)              # [V] uniform 32-bit integers, vectorized
    u    = (token_uniform(bits) + 0.5) / 2**23     # its top 23 bits, in (0, 1), exact in float32
    gumbel = -log(-log(u))                         # exponential race: argmax(log w + gumbel) ~ w

`GUMBEL_MAX` bounds every value the noise can take, which lets a sampler skip
tokens that cannot win (server/sampling.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeVar, overload

if TYPE_CHECKING:
    import numpy as np
    import torch

MASK32 = 0xFFFFFFFF
# An odd multiplier below 2**31: (x < 2**32) * MIX_MULTIPLIER < 2**63, so int64 arithmetic never overflows.
MIX_MULTIPLIER = 0x45D9F3B
_TOKEN_SALT = 0x6A09E667  # keeps token 0 from hashing like an absent token

# Streams: independent noise for the same (seed, position).
TARGET_STREAM = 0x7A7  # the target's own sample (server/sampling.py), and the bonus or residual token
ACCEPT_STREAM = 0xACC  # the uniform that accepts or rejects a draft token (server/rejection.py)
DRAFT_STREAM = 0xD7A  # an edge's sampled draft token (edge_client/drafting/base.py)

# A token's noise is the top UNIFORM_BITS of its bits: u = (top + 0.5) / 2**23, exact in float32
# (24 significant bits, the largest 1 - 2**-24), so every device and library gets the same u.
UNIFORM_BITS = 23
# The largest Gumbel value that u can give: u = 1 - 2**-24 -> -log(-log(u)) = 16.63.
GUMBEL_MAX = 16.75

# A Python int, a numpy int64 array or a torch int64 tensor (named as strings: numpy and torch are not imported here).
Ints = TypeVar("Ints", int, "np.ndarray", "torch.Tensor")


def mix32(x: Ints) -> Ints:
    """A bijective avalanche mix of 32-bit values (x in [0, 2**32))."""
    x = ((x >> 16) ^ x) * MIX_MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * MIX_MULTIPLIER & MASK32
    return (x >> 16) ^ x


def row_key(seed: int, position: int, stream: int) -> int:
    """The key of one sampled position: its seed (any int), its sequence index and its stream."""
    return position_key(seed_key(seed), position, stream)


def seed_key(seed: int) -> int:
    """The first half of `row_key`, the seed's alone: a sampler keys a row's positions from it."""
    seed &= (1 << 64) - 1
    return mix32(mix32((seed & MASK32) ^ _TOKEN_SALT) ^ (seed >> 32))


def position_key(seed_key: Ints | int, position: Ints, stream: int) -> Ints:
    """The second half of `row_key`: vectorized over positions (and seed keys of the same shape)."""
    return mix32(mix32(seed_key ^ (position & MASK32)) ^ stream)


def token_bits(key: Ints | int, token_ids: Ints) -> Ints:
    """Uniform 32-bit integers, one per token id (both may be arrays of the same shape, or broadcast)."""
    return mix32(key ^ token_hash(token_ids))


def token_hash(token_ids: Ints) -> Ints:
    """The key-independent half of `token_bits`: a sampler may tabulate it once per vocabulary."""
    return mix32((token_ids + _TOKEN_SALT) & MASK32)


def uniform(seed: int, position: int, stream: int) -> float:
    """U(0, 1) for one position of a stream, from all 32 bits (a Python float: exact in float64)."""
    return key_uniform(row_key(seed, position, stream))


@overload
def key_uniform(key: int) -> float: ...
@overload
def key_uniform(key: np.ndarray) -> np.ndarray: ...
def key_uniform(key):
    """`uniform` from a position's key (row_key, or position_key over arrays): a float, or float64 per key."""
    return (mix32(key ^ token_hash(0)) + 0.5) / 2**32


def token_uniform(bits: Ints) -> Ints:
    """A token's u in (0, 1) from its bits, times 2**23 and less 0.5: exact integers in any dtype.

    u = (token_uniform(bits) + 0.5) / 2**23.
    """
    return (bits >> (32 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)


def gumbel(seed: int, position: int, stream: int, token_id: int) -> float:
    """The Gumbel noise of one token at one position, in Python floats (the edge's scalar path)."""
    u = (token_uniform(token_bits(row_key(seed, position, stream), token_id)) + 0.5) / 2**UNIFORM_BITS
    return -math.log(-math.log(u))
