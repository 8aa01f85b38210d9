"""The target's sampler, keyed by sequence position so speculation cannot change it.

Every sampled token draws its randomness from (seed, index in the sequence)
alone, never from a shared stream. The target's choice at a position then
depends only on the prefix and the seed, not on how many drafts were verified
around it, so a seeded speculative run reproduces a seeded server-only run
token for token, and each token is still an exact sample from the target's
(tempered, filtered) distribution.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks
token i with probability p_i.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from specedge.types import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens more likely than it already reach top_p;
        # the most likely token is therefore always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def position_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[V] Exp(1) noise for the token at `position`, a pure function of (seed, position)."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))
    return torch.empty(vocab_size).exponential_(generator=generator)


def sample(
    logits: torch.Tensor,  # [N, V]
    positions: Sequence[int],  # [N] sequence index each sampled token will occupy
    params: SamplingParams,
    seed: int,
) -> list[int]:
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = target_probs(logits, params)
    noise = torch.stack([position_noise(seed, p, probs.shape[-1]) for p in positions]).to(probs.device)
    return (probs / noise).argmax(dim=-1).tolist()
