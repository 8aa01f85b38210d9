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
streams: the acceptance uniform ("accept") and the Exp(1) noise of the
residual or bonus sample (`position_noise`, the noise `sample` itself uses;
so an empty draft yields exactly the target's seeded sample). Each position
is decided once, so each stream's value at a position is used at most once
and a seeded session is reproducible token for token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from specedge.server.sampling import position_noise
from specedge.server.verify import VerifyResult
from specedge.types import SparseDist

ACCEPT_STREAM = "accept"


def acceptance_uniform(seed: int, position: int) -> float:
    """U[0, 1) for accepting the draft at `position`; independent of `position_noise`."""
    key = hashlib.blake2b(f"{seed}:{position}:{ACCEPT_STREAM}".encode(), digest_size=8).digest()
    return (int.from_bytes(key, "little") >> 11) / (1 << 53)  # 53 random bits: exact in a float, never 1.0


def verify_chain_by_rejection(
    draft_token_ids: Sequence[int],  # [n]
    draft_dists: Sequence[SparseDist],  # [n] the q each draft token was sampled from
    target_probs: torch.Tensor,  # [n + 1, V] target distribution at the root and after each draft token
    positions: Sequence[int],  # [n + 1] sequence index of the token decided at each row
    seed: int,
) -> VerifyResult:
    """Accepted chain nodes (1..m, node i is draft token i-1) and the token after them.

    Raises ValueError for inconsistent inputs, e.g. a draft token that its own
    distribution gives probability 0 (it cannot have been sampled from it).
    """
    _check_inputs(draft_token_ids, draft_dists, target_probs, positions)
    num_drafts = len(draft_token_ids)
    rows = torch.arange(num_drafts, device=target_probs.device)  # [n]
    drafted = torch.tensor(list(draft_token_ids), dtype=torch.long, device=target_probs.device)  # [n]
    target_draft_probs = target_probs[rows, drafted].tolist()  # [n] p_i(x_i), one device sync for all

    for i, (token, dist) in enumerate(zip(draft_token_ids, draft_dists)):
        # u < p / q, written without the division: accepted with probability min(1, p / q).
        if acceptance_uniform(seed, positions[i]) * dist.prob_of(token) < target_draft_probs[i]:
            continue
        target_row = target_probs[i].double()  # [V]
        residual = (target_row - _dense(dist, target_row)).clamp_min(0)  # [V]
        if not residual.sum() > 0:
            # Only float rounding can reject when p <= q everywhere (e.g. p == q);
            # then the residual is empty and p itself is the right fallback.
            residual = target_row
        accepted = tuple(range(1, i + 1))
        return VerifyResult(accepted_nodes=accepted, next_token=_sample_at(residual, seed, positions[i]))

    bonus = _sample_at(target_probs[num_drafts], seed, positions[num_drafts])
    return VerifyResult(accepted_nodes=tuple(range(1, num_drafts + 1)), next_token=bonus)


def _dense(dist: SparseDist, like: torch.Tensor) -> torch.Tensor:
    """[V] q as a dense vector (renormalised), with `like`'s dtype and device."""
    probs = torch.tensor(dist.probs, dtype=like.dtype, device=like.device)  # [k]
    token_ids = torch.tensor(dist.token_ids, dtype=torch.long, device=like.device)  # [k]
    return torch.zeros_like(like).index_put_((token_ids,), probs / probs.sum())


def _sample_at(weights: torch.Tensor, seed: int, position: int) -> int:
    """Sample from unnormalised [V] `weights` with the exponential race `sample` uses."""
    noise = position_noise(seed, position, weights.shape[-1]).to(device=weights.device, dtype=weights.dtype)  # [V]
    return int((weights / noise).argmax())


def _check_inputs(
    draft_token_ids: Sequence[int],  # [n]
    draft_dists: Sequence[SparseDist],  # [n]
    target_probs: torch.Tensor,  # [n + 1, V]
    positions: Sequence[int],  # [n + 1]
) -> None:
    num_drafts = len(draft_token_ids)
    if len(draft_dists) != num_drafts:
        raise ValueError(f"got {len(draft_dists)} draft distributions for {num_drafts} draft tokens")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_drafts + 1:
        raise ValueError(f"target_probs must be [{num_drafts + 1}, vocab], got {list(target_probs.shape)}")
    if len(positions) != num_drafts + 1:
        raise ValueError(f"got {len(positions)} positions for {num_drafts + 1} rows")
    num_vocab = target_probs.shape[1]
    for i, (token, dist) in enumerate(zip(draft_token_ids, draft_dists)):
        if not 0 <= token < num_vocab or max(dist.token_ids) >= num_vocab:
            raise ValueError(f"draft token {i} or its distribution is outside the target vocabulary [0, {num_vocab})")
        if dist.prob_of(token) <= 0:
            raise ValueError(
                f"draft token {i} (id {token}) has probability 0 under the distribution it was sampled from"
            )
