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

from collections.abc import Callable, Sequence

import torch

from specedge import noise
from specedge.server.sampling import sample_weights
from specedge.server.verify import VerifyResult
from specedge.types import SparseDist


def acceptance_uniform(seed: int, position: int) -> float:
    """U(0, 1) for accepting the draft at `position`; independent of the target's sampling noise."""
    return noise.uniform(seed, position, noise.ACCEPT_STREAM)


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
    _check_inputs(draft_token_ids, draft_dists, target_probs.shape, positions)
    num_drafts = len(draft_token_ids)
    rows = torch.arange(num_drafts, device=target_probs.device)  # [n]
    drafted = torch.tensor(list(draft_token_ids), dtype=torch.long, device=target_probs.device)  # [n]
    return decide_chain(
        draft_token_ids, draft_dists, target_probs[rows, drafted].tolist(), positions, seed,
        target_row=lambda i: target_probs[i],
        bonus=lambda: sample_weights(target_probs[num_drafts], seed, positions[num_drafts]),
    )  # fmt: skip


def decide_chain(
    draft_token_ids: Sequence[int],  # [n]
    draft_dists: Sequence[SparseDist],  # [n]
    target_draft_probs: Sequence[float],  # [n] p_i(x_i): the target's probability of each draft token
    positions: Sequence[int],  # [n + 1]
    seed: int,
    *,
    target_row: Callable[[int], torch.Tensor],  # i -> [V] p_i, asked for only at a rejection
    bonus: Callable[[], int],  # the target's own sample after the last draft, asked for when all are accepted
) -> VerifyResult:
    """The accept/reject walk, given p at the draft tokens; the server's batched path and
    `verify_chain_by_rejection` both run it, so they decide alike."""
    for i, (token, dist) in enumerate(zip(draft_token_ids, draft_dists)):
        # u < p / q, written without the division: accepted with probability min(1, p / q).
        if acceptance_uniform(seed, positions[i]) * dist.prob_of(token) < target_draft_probs[i]:
            continue
        p_row = target_row(i).double()  # [V]
        residual = (p_row - _dense(dist, p_row)).clamp_min(0)  # [V]
        if not residual.sum() > 0:
            # Only float rounding can reject when p <= q everywhere (e.g. p == q);
            # then the residual is empty and p itself is the right fallback.
            residual = p_row
        return VerifyResult(accepted_nodes=tuple(range(1, i + 1)), next_token=sample_weights(residual, seed, positions[i]))
    return VerifyResult(accepted_nodes=tuple(range(1, len(draft_token_ids) + 1)), next_token=bonus())


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
