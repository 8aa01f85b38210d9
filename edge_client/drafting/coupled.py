"""Coupled drafting: each draft token raced with the noise the target samples its position with.

A seeded request's target token at sequence index i is the exponential race
argmax_j((logit_j - max) / T + G_j) over the tokens its top-k and top-p keep,
with G_j = noise.gumbel(seed, i, TARGET_STREAM, j) (server/sampling.py). The
edge runs the same race on the draft's logits: where draft and target agree,
so do their winners, and the server, matching its own sample, accepts the
draft. The acceptance is the coupling's agreement probability, and the answer
is the seeded server-only answer whatever the drafts, the load or the batch.

    target scores  [2.0, 1.0] + G = [2.0 + 0.1, 1.0 + 1.5] -> token 1
    draft  scores  [1.8, 1.1] + G = [1.8 + 0.1, 1.1 + 1.5] -> token 1: accepted

Only the edge's choice depends on this file; the server's match keeps the
answer exact whatever it draws, so the edge's float rounding only costs (rare)
acceptance, never correctness. numpy, no torch: the llama.cpp edge uses it.
"""

from __future__ import annotations

import numpy as np

from specedge import noise
from specedge.edge_client.drafting.base import CoupledSampling


def draw_coupled(logits: np.ndarray, sampling: CoupledSampling, position: int) -> int:
    """The token the target's race at sequence index `position` picks, run on these [V] logits."""
    params = sampling.params
    logits = np.asarray(logits, dtype=np.float32)  # [V]
    top = int(np.argmax(logits))
    best = float(logits[top])
    key = noise.row_key(sampling.seed, position, noise.TARGET_STREAM)
    # The argmax's score is reached, so a token more than GUMBEL_MAX below it cannot win.
    reach = best + params.temperature * (float(gumbel(key, np.array([top]))[0]) - noise.GUMBEL_MAX)
    floor = _top_k_floor(logits, params.top_k)
    ids = np.flatnonzero(logits >= max(reach, floor))  # [C] ascending: a tie goes to the lowest id, as on the server
    if params.top_p < 1:
        ids = _in_nucleus(logits, ids, floor, params.temperature, params.top_p)
    scores = (logits[ids] - np.float32(best)).astype(np.float64) / params.temperature + gumbel(key, ids)  # [C]
    return int(ids[np.argmax(scores)])


def gumbel(key: int, token_ids: np.ndarray) -> np.ndarray:
    """[C] float32 Gumbel noise of `token_ids` under one position's key, as server/sampling.py computes it."""
    bits = noise.token_bits(key, token_ids.astype(np.int64))
    u = (noise.token_uniform(bits).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-noise.UNIFORM_BITS)
    return -np.log(-np.log(u))


def _top_k_floor(logits: np.ndarray, top_k: int) -> float:
    """The k-th largest logit (tokens tied with it are kept too); -inf without top-k."""
    if not 0 < top_k < len(logits):
        return -np.inf
    return float(np.partition(logits, -top_k)[-top_k])


def _in_nucleus(logits: np.ndarray, ids: np.ndarray, floor: float, temperature: float, top_p: float) -> np.ndarray:
    """The candidates `ids` that top-p keeps: those at least as likely as the nucleus' last token.

    Every candidate is likelier than every token outside `ids`, so the nucleus
    either ends among them or keeps them all.
    """
    kept = logits[logits >= floor].astype(np.float64)  # top-p acts on what top-k kept
    shifted = (kept - kept.max()) / temperature
    log_norm = np.log(np.exp(shifted).sum())
    candidate_logits = logits[ids].astype(np.float64)  # [C]
    order = np.argsort(-candidate_logits, kind="stable")
    probs = np.exp((candidate_logits[order] - kept.max()) / temperature - log_norm)
    num_kept = int(((np.cumsum(probs) - probs) < top_p).sum())  # >= 1: the likeliest is always kept
    if num_kept == len(ids):
        return ids
    return ids[candidate_logits >= candidate_logits[order[num_kept - 1]]]
