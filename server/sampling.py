"""The target's sampler, keyed by sequence position so speculation cannot change it.

Every sampled token draws its randomness from (seed, index in the sequence)
alone, through the counter-based noise in specedge/noise.py, never from a
generator's state. The target's choice at a position then depends only on the
prefix and the seed, not on how many drafts were verified around it or which
rows shared the batch, so a seeded speculative run reproduces a seeded
server-only run token for token, and each token is still an exact sample from
the target's (tempered, filtered) distribution.

Sampling is the exponential race in log form: with Gumbel noise G_i for each
token, argmax_i(log w_i + G_i) picks token i with probability w_i / sum(w).
Noise is bounded (G_i <= GUMBEL_MAX), so a token whose log-weight is more
than GUMBEL_MAX below a score already reached cannot win: the race computes
noise only for the few tokens that can, in one vectorized pass over all rows.

    logits row [5.0, 4.9, -30, ...], T = 1; argmax a = 0 with noise g_a = 0.3
    -> only tokens with logit >= 5.0 + 0.3 - 23 can win; the -30 ones are skipped

Filters (top-k, top-p) become one logit floor per row: a token is kept when
its logit is at least the floor, so filtering never materialises a new
vocabulary-sized tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specedge import noise
from specedge.types import SamplingParams

# Top-p's boundary is looked for among this many most likely tokens first; a
# row whose nucleus is wider is sorted whole.
_TOP_P_WINDOW = 1024
_NO_FLOOR = -math.inf


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[N] float64 Gumbel noise of token_ids[i] under keys[i] (see specedge/noise.py)."""
    bits = noise.token_bits(keys, token_ids)
    u = (bits.double() + 0.5) * 2.0**-32
    return -torch.log(-torch.log(u))


def row_keys(seed: int, positions: Sequence[int], device: torch.device, stream: int = noise.TARGET_STREAM) -> torch.Tensor:
    """[N] int64 noise keys of `positions` under `seed`."""
    return torch.tensor([noise.row_key(seed, p, stream) for p in positions], dtype=torch.long, device=device)


def logit_floors(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float64, > 0
    top_k: Sequence[int],  # [N] 0: no top-k
    top_p: Sequence[float],  # [N] 1.0: no top-p
) -> torch.Tensor:  # [N] float64: a token is kept when its logit >= the floor (-inf keeps all)
    """Top-k and top-p as one logit floor per row. Tokens tied with the last one kept are kept too."""
    num_rows, vocab_size = logits.shape
    floors = torch.full((num_rows,), _NO_FLOOR, dtype=torch.float64, device=logits.device)
    k_rows = [i for i, k in enumerate(top_k) if 0 < k < vocab_size]
    if k_rows:
        k_index = torch.tensor(k_rows, device=logits.device)
        largest = logits[k_index].topk(max(top_k[i] for i in k_rows), dim=-1).values  # [R, max k]
        kth = torch.tensor([top_k[i] - 1 for i in k_rows], device=logits.device)
        floors[k_index] = largest[torch.arange(len(k_rows), device=logits.device), kth].double()
    for i in (i for i, p in enumerate(top_p) if p < 1):
        floors[i] = max(float(floors[i]), _top_p_floor(logits[i], float(temperature[i]), float(floors[i]), top_p[i]))
    return floors


def _top_p_floor(row: torch.Tensor, temperature: float, floor: float, top_p: float) -> float:
    """The logit of the last token of the nucleus: tokens more likely than it hold < top_p of the mass."""
    kept = row.double().masked_fill(row.double() < floor, -math.inf)  # [V]
    probs = ((kept - kept.max()) / temperature).softmax(dim=-1)  # [V]
    window = min(_TOP_P_WINDOW, probs.shape[-1])
    sorted_probs, order = probs.topk(window)
    if float(sorted_probs.sum()) < top_p and window < probs.shape[-1]:
        sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    last = int((mass_before < top_p).sum()) - 1  # the most likely token is always kept
    return float(kept[order[last]])


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p."""
    num_rows = logits.shape[0]
    temperature = torch.full((num_rows,), params.temperature, dtype=torch.float64, device=logits.device)
    floors = logit_floors(logits, temperature, [params.top_k] * num_rows, [params.top_p] * num_rows)
    return probs_with_floors(logits, temperature, floors)


def probs_with_floors(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float64
    floors: torch.Tensor,  # [N] float64
) -> torch.Tensor:  # [N, V] float32
    # Subtracting the max first keeps (logit - max) / T finite for any T > 0, even 1e-39.
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    scaled = shifted / temperature.float().clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    scaled = scaled.masked_fill(logits < floors.to(logits.dtype)[:, None], -math.inf)
    return scaled.softmax(dim=-1)


def race(
    logits: torch.Tensor,  # [N, V] float logits, or log-weights (-inf: excluded)
    temperature: torch.Tensor,  # [N] float64 > 0: score = (logit - max) / T + noise
    floors: torch.Tensor,  # [N] float64: tokens below the floor are excluded
    keys: torch.Tensor,  # [N] int64 noise keys
    row_max: tuple[torch.Tensor, torch.Tensor] | None = None,  # logits.max(-1), when already known
) -> torch.Tensor:  # [N] int64: each row's winner
    """The exponential race on every row at once, computing noise only where it can matter."""
    values, top = row_max if row_max is not None else logits.max(dim=-1)  # [N], [N]
    values = values.double()
    # The argmax is always kept by the filters, so its score, (max - max) / T + g = g, is reached;
    # a token can only beat it when logit >= max + T * (g - GUMBEL_MAX).
    threshold = torch.maximum(values + temperature * (gumbel(keys, top) - noise.GUMBEL_MAX), floors)
    rows, tokens = (logits >= threshold.to(logits.dtype)[:, None]).nonzero(as_tuple=True)  # row-major
    scores = (logits[rows, tokens].double() - values[rows]) / temperature[rows] + gumbel(keys[rows], tokens)
    best = torch.full_like(values, -math.inf).scatter_reduce(0, rows, scores, "amax")
    # Ties go to the lowest token id: the first winner of each row in row-major order.
    winner_rows, winner_tokens = rows[scores == best[rows]], tokens[scores == best[rows]]
    first = torch.ones_like(winner_rows, dtype=torch.bool)
    first[1:] = winner_rows[1:] != winner_rows[:-1]
    result = top.clone()
    result[winner_rows[first]] = winner_tokens[first]
    return result


def sample(
    logits: torch.Tensor,  # [N, V]
    positions: Sequence[int],  # [N] sequence index each sampled token will occupy
    params: SamplingParams,
    seed: int,
) -> list[int]:
    """One session's tokens at `positions`: the argmax, or its seeded sample."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    num_rows = logits.shape[0]
    temperature = torch.full((num_rows,), params.temperature, dtype=torch.float64, device=logits.device)
    floors = logit_floors(logits, temperature, [params.top_k] * num_rows, [params.top_p] * num_rows)
    return race(logits, temperature, floors, row_keys(seed, positions, logits.device)).tolist()


def sample_weights(weights: torch.Tensor, seed: int, position: int) -> int:
    """A token drawn from unnormalised [V] `weights` with the same noise `sample` uses at `position`."""
    log_weights = weights.double().log()[None]  # [1, V]; zero weights -> -inf, never drawn
    one = torch.ones(1, dtype=torch.float64, device=weights.device)
    floors = torch.full((1,), _NO_FLOOR, dtype=torch.float64, device=weights.device)
    return int(race(log_weights, one, floors, row_keys(seed, [position], weights.device))[0])
