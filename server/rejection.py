"""Verification of a sampled chain by rejection sampling (Leviathan et al. 2023): pure.

Draft token x_i was sampled from q_i. Accept it with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection, sample the token from
the residual normalize(max(p_i - q_i, 0)) instead and end the round. If all n
drafts are accepted, the bonus token is sampled from p_n. Every committed
token is then an exact sample from the target's p, and when q is close to p
far more drafts are accepted than by matching the target's own sample.

    p_0 = {a: 0.4, b: 0.6}   q_0 = {a: 0.5, b: 0.5}   draft a
    -> accept a with probability 0.4 / 0.5 = 0.8; else the residual
       max(p_0 - q_0, 0) = {b: 0.1} gives b.

Randomness is keyed by (seed, position) as in server/sampling.py, in two
streams of specedge/noise.py: the acceptance uniform (ACCEPT_STREAM) and the
noise of the residual or bonus sample (TARGET_STREAM, the noise `sample`
itself uses; so an empty draft yields the target's seeded sample). Each
position is decided once, so each stream's value at a position is used at
most once and a seeded session is reproducible token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specedge import noise
from specedge.server.sampling import probs_with_floors, sample_weights
from specedge.server.verify import VerifyResult
from specedge.types import SparseDist


def acceptance_uniform(seed: int, position: int) -> float:
    """U(0, 1) for accepting the draft at `position`; independent of the target's sampling noise."""
    return noise.uniform(seed, position, noise.ACCEPT_STREAM)


def acceptance_uniforms(seed_keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[N] float64 acceptance_uniform at many positions at once (seed_keys: each seed's noise.seed_key), bit for bit."""
    return noise.key_uniform(noise.position_key(seed_keys, positions, noise.ACCEPT_STREAM))


def accepts(token: int, dist: SparseDist, target_prob: float, seed: int, position: int) -> bool:
    """Whether draft `token`, sampled from `dist` at `position`, is accepted given p(token)."""
    # u < p / q, written without the division: accepted with probability min(1, p / q).
    return acceptance_uniform(seed, position) * dist.prob_of(token) < target_prob


def verify_chain_by_rejection(
    draft_token_ids: Sequence[int],  # [n]
    draft_dists: Sequence[SparseDist],  # [n] the q each draft token was sampled from
    target_probs: torch.Tensor,  # [n + 1, V] target distribution at the root and after each draft token
    positions: Sequence[int],  # [n + 1] sequence index of the token decided at each row
    seed: int,
) -> VerifyResult:
    """Accepted chain nodes (1..m, node i is draft token i-1) and the token after them.

    The dense reference: the server's batched path (server/draws.py) decides alike from logits.
    Raises ValueError for inconsistent inputs, e.g. a draft token that its own
    distribution gives probability 0 (it cannot have been sampled from it).
    """
    _check_inputs(draft_token_ids, draft_dists, target_probs.shape, positions)
    for i, (token, dist) in enumerate(zip(draft_token_ids, draft_dists)):
        if not accepts(token, dist, float(target_probs[i, token]), seed, positions[i]):
            next_token = residual_token(target_probs[i], dist, seed, positions[i])
            return VerifyResult(accepted_nodes=tuple(range(1, i + 1)), next_token=next_token)
    num_drafts = len(draft_token_ids)
    bonus = sample_weights(target_probs[num_drafts], seed, positions[num_drafts])
    return VerifyResult(accepted_nodes=tuple(range(1, num_drafts + 1)), next_token=bonus)


def residual_token(p_row: torch.Tensor, dist: SparseDist, seed: int, position: int) -> int:
    """The token after a rejection: a sample of normalize(max(p - q, 0)) from [V] p."""
    p_row = p_row.double()
    residual = (p_row - _dense(dist, p_row)).clamp_min(0)  # [V]
    if not residual.sum() > 0:
        # Only float rounding can reject when p <= q everywhere (e.g. p == q);
        # then the residual is empty and p itself is the right fallback.
        residual = p_row
    return sample_weights(residual, seed, position)


def residual_tokens(
    logits: torch.Tensor,  # [L, V]
    rows: Sequence[int],  # [R] the logit row of each rejection: p there is the target's distribution
    temperature: torch.Tensor,  # [L] float64
    floors: torch.Tensor,  # [L] float64
    dists: Sequence[SparseDist],  # [R] the q each rejected draft was sampled from
    seeds: Sequence[int],  # [R]
    positions: Sequence[int],  # [R]
) -> list[int]:
    """`residual_token` for many rejections at once: the eager path's (on CPU in float32 the argmax pass
    draws them, server/race_kernel.py)."""
    if not rows:
        return []
    index = torch.tensor(list(rows), device=logits.device)
    p_rows = probs_with_floors(logits[index], temperature[index], floors[index])  # [R, V]
    return [residual_token(p, d, s, pos) for p, d, s, pos in zip(p_rows, dists, seeds, positions)]


def _dense(dist: SparseDist, like: torch.Tensor) -> torch.Tensor:
    """[V] q as a dense vector (renormalised), with `like`'s dtype and device."""
    probs = torch.tensor(dist.probs, dtype=like.dtype, device=like.device)  # [k]
    token_ids = torch.tensor(dist.token_ids, dtype=torch.long, device=like.device)  # [k]
    return torch.zeros_like(like).index_put_((token_ids,), probs / probs.sum())


def _check_inputs(
    draft_token_ids: Sequence[int],  # [n]
    draft_dists: Sequence[SparseDist],  # [n]
    target_shape: Sequence[int],  # [n + 1, V]
    positions: Sequence[int],  # [n + 1]
) -> None:
    num_drafts = len(draft_token_ids)
    if len(draft_dists) != num_drafts:
        raise ValueError(f"got {len(draft_dists)} draft distributions for {num_drafts} draft tokens")
    if len(target_shape) != 2 or target_shape[0] != num_drafts + 1:
        raise ValueError(f"target_probs must be [{num_drafts + 1}, vocab], got {list(target_shape)}")
    if len(positions) != num_drafts + 1:
        raise ValueError(f"got {len(positions)} positions for {num_drafts + 1} rows")
    num_vocab = target_shape[1]
    for i, (token, dist) in enumerate(zip(draft_token_ids, draft_dists)):
        if not 0 <= token < num_vocab or max(dist.token_ids) >= num_vocab:
            raise ValueError(f"draft token {i} or its distribution is outside the target vocabulary [0, {num_vocab})")
        if dist.prob_of(token) <= 0:
            raise ValueError(
                f"draft token {i} (id {token}) has probability 0 under the distribution it was sampled from"
            )
