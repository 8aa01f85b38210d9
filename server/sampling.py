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
    -> only tokens with logit >= 5.0 + 0.3 - 16.75 can win; the -30 ones are skipped

Filters (top-k, top-p) become one logit floor per row: a token is kept when
its logit is at least the floor, so filtering never materialises a new
vocabulary-sized tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from specedge import noise
from specedge.server import race_kernel
from specedge.types import SamplingParams

# Top-p's boundary is looked for among this many most likely tokens first; a
# row whose nucleus is wider is sorted whole.
_TOP_P_WINDOW = 1024
_NO_FLOOR = -math.inf


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[N] float32 Gumbel noise of token_ids[i] under keys[i] (see specedge/noise.py)."""
    u = (noise.token_uniform(_token_bits_int32(keys, token_ids)).float() + 0.5) * 2.0**-noise.UNIFORM_BITS
    return -torch.log(-torch.log(u))


def token_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """specedge/noise.py's token_bits, in int32 lanes: several times faster than int64 on CPU.

    The same bits: xor and the low 32 bits of a product do not care whether a lane is read as
    signed or unsigned, and a logical shift is an arithmetic one masked to the bits shifted in.
    """
    return _token_bits_int32(keys, token_ids).long() & noise.MASK32


def _token_bits_int32(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    hashed = noise.token_hash(token_ids) if token_ids.numel() < 4096 else _token_hash_table(token_ids)
    return _mix32_int32(_as_int32(keys) ^ _as_int32(hashed))


def _token_hash_table(token_ids: torch.Tensor) -> torch.Tensor:
    """noise.token_hash of token_ids, looked up in a table of whole 64k blocks of ids."""
    size = (int(token_ids.max()) // 65536 + 1) * 65536
    return _hash_table(token_ids.device, size)[token_ids]


@functools.lru_cache(maxsize=4)
def _hash_table(device: torch.device, size: int) -> torch.Tensor:
    return noise.token_hash(torch.arange(size, device=device))


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2**32) as int32 lanes holding the same 32 bits."""
    return (x - ((x >> 31) << 32)).int() if x.dtype == torch.long else x


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ ((x >> 16) & 0xFFFF)) * noise.MIX_MULTIPLIER
    x = (x ^ ((x >> 16) & 0xFFFF)) * noise.MIX_MULTIPLIER
    return x ^ ((x >> 16) & 0xFFFF)


def row_keys(
    seed: int, positions: Sequence[int], device: torch.device, stream: int = noise.TARGET_STREAM
) -> torch.Tensor:
    """[N] int64 noise keys of `positions` under `seed`."""
    keys = noise.position_key(noise.seed_key(seed), np.asarray(positions, dtype=np.int64), stream)
    return torch.from_numpy(keys).to(device)


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
    return probs_with_floors(logits, *_one_setting(logits, params))


def _one_setting(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] float64 temperatures and logit floors for rows that all sample with `params`."""
    num_rows = logits.shape[0]
    temperature = torch.full((num_rows,), params.temperature, dtype=torch.float64, device=logits.device)
    return temperature, logit_floors(logits, temperature, [params.top_k] * num_rows, [params.top_p] * num_rows)


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


def argmax_and_race(
    logits: torch.Tensor,  # [N, V]
    racing: torch.Tensor,  # [N] bool: rows that sample; the others take their argmax
    temperature: torch.Tensor,  # [N] float64 > 0
    floors: torch.Tensor,  # [N] float64
    keys: torch.Tensor,  # [N] int64 noise keys
    drafts: race_kernel.Drafts | None = None,  # the chains rejection sampling walks, where compiled
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every row's argmax, whether its max is finite, and every racing row's sample, in one pass over the
    logits where compiled; there `drafts`' chains are walked in the same pass, and the fourth value holds
    each draft's verdict (race_kernel.argmax_and_race: a rejected draft's draw is its residual's, and a
    bonus row is raced only where its chain's drafts were all accepted). Else None: the eager path leaves
    rejection sampling to the caller."""
    if race_kernel.covers(logits):
        top, finite, drawn, _, verdicts = race_kernel.argmax_and_race(
            logits, None, racing.numpy(), temperature, floors, keys, drafts
        )
        return top, finite, drawn, verdicts
    values, top = logits.max(dim=-1)  # [N]: NaN and +inf propagate into the max
    finite = torch.isfinite(values)
    if not bool(racing.any()):
        return top, finite, top, None
    # A row out of the race has no candidates (floor +inf) and keeps its argmax.
    floors = floors.masked_fill(~racing.to(floors.device), math.inf)
    return top, finite, _race_eager(logits, temperature, floors, keys, (values, top)), None


def race(
    logits: torch.Tensor,  # [N, V] float logits, or log-weights (-inf: excluded)
    temperature: torch.Tensor,  # [N] float64 > 0: score = (logit - max) / T + noise
    floors: torch.Tensor,  # [N] float64: tokens below the floor are excluded
    keys: torch.Tensor,  # [N] int64 noise keys
) -> torch.Tensor:  # [N] int64: each row's winner, ties to the lowest token id
    """The exponential race on every row at once: compiled (server/race_kernel.py) for float32
    logits on CPU, else in torch ops. Both compute the same scores and pick the same winner."""
    if race_kernel.covers(logits):
        racing = np.ones(logits.shape[0], np.bool_)
        return race_kernel.argmax_and_race(logits, None, racing, temperature, floors, keys)[2]
    return _race_eager(logits, temperature, floors, keys)


def _race_eager(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float64 > 0
    floors: torch.Tensor,  # [N] float64
    keys: torch.Tensor,  # [N] int64
    row_max: tuple[torch.Tensor, torch.Tensor] | None = None,  # logits.max(-1), when already known
) -> torch.Tensor:  # [N] int64
    """The race in torch ops, computing noise only where it can matter.

    A row with few tokens in reach of its argmax scores just those (gathered); a flat row
    (high temperature) scores every token in place, which beats gathering most of them.
    Both compute the same scores, so a row's winner does not depend on the path taken.
    """
    values, top = row_max if row_max is not None else logits.max(dim=-1)  # [N], [N]
    # The argmax is always kept by the filters, so its score, (max - max) / T + g = g, is reached;
    # a token can only beat it when logit >= max + T * (g - GUMBEL_MAX).
    reach = values.double() + temperature * (gumbel(keys, top).double() - noise.GUMBEL_MAX)
    in_reach = logits >= torch.maximum(reach, floors).to(logits.dtype)[:, None]  # [N, V]
    # float32 scores: float32 logits and 24-bit noise carry no more precision than that.
    values, temperature = values.float(), temperature.float().clamp_min(torch.finfo(torch.float32).tiny)
    flat = in_reach.sum(dim=-1) > logits.shape[-1] // _FLAT_SHARE  # [N]
    winners = top.clone()
    peaked_rows = (~flat).nonzero().squeeze(1)
    if len(peaked_rows):
        winners[peaked_rows] = _race_gathered(
            logits[peaked_rows],
            in_reach[peaked_rows],
            values[peaked_rows],
            temperature[peaked_rows],
            keys[peaked_rows],
            top[peaked_rows],
        )
    flat_rows = flat.nonzero().squeeze(1)
    for chunk in flat_rows.split(_DENSE_CHUNK_ROWS):
        scores = _scores(logits[chunk], values[chunk], temperature[chunk], keys[chunk])  # [C, V]
        winners[chunk] = scores.masked_fill(~in_reach[chunk], -math.inf).argmax(dim=-1)  # first max: lowest id
    return winners


# A row is scored in place once more than 1/_FLAT_SHARE of its tokens are in reach.
_FLAT_SHARE = 32
_DENSE_CHUNK_ROWS = 16  # bounds the scores in flight: 16 x 152k x 4 bytes


def _scores(
    logits: torch.Tensor,  # [C, V]
    values: torch.Tensor,  # [C] float32 max logits
    temperature: torch.Tensor,  # [C] float32
    keys: torch.Tensor,  # [C] int64
) -> torch.Tensor:  # [C, V] float32: (logit - max) / T + Gumbel noise of every token
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    return (logits.float() - values[:, None]) / temperature[:, None] + gumbel(keys[:, None], vocab[None])


def _race_gathered(
    logits: torch.Tensor,  # [R, V]
    in_reach: torch.Tensor,  # [R, V] bool
    values: torch.Tensor,  # [R] float32
    temperature: torch.Tensor,  # [R] float32
    keys: torch.Tensor,  # [R] int64
    top: torch.Tensor,  # [R] int64 argmax: the answer of a row with nothing in reach (a greedy row)
) -> torch.Tensor:  # [R] int64
    rows, tokens = in_reach.nonzero(as_tuple=True)  # row-major: tokens ascending within a row
    scores = (logits[rows, tokens].float() - values[rows]) / temperature[rows] + gumbel(keys[rows], tokens)
    best = torch.full_like(values, -math.inf).scatter_reduce(0, rows, scores, "amax")
    is_best = scores == best[rows]
    winner_rows, winner_tokens = rows[is_best], tokens[is_best]
    first = torch.ones_like(winner_rows, dtype=torch.bool)
    first[1:] = winner_rows[1:] != winner_rows[:-1]
    winners = top.clone()
    winners[winner_rows[first]] = winner_tokens[first]
    return winners


def sample(
    logits: torch.Tensor,  # [N, V]
    positions: Sequence[int],  # [N] sequence index each sampled token will occupy
    params: SamplingParams,
    seed: int,
) -> list[int]:
    """One session's tokens at `positions`: the argmax, or its seeded sample."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    temperature, floors = _one_setting(logits, params)
    return race(logits, temperature, floors, row_keys(seed, positions, logits.device)).tolist()


def sample_weights(weights: torch.Tensor, seed: int, position: int) -> int:
    """A token drawn from unnormalised [V] `weights` with the same noise `sample` uses at `position`."""
    # [1, V]; zero weights -> -inf, never drawn. float32 scores either way (see `race`), so float32
    # log-weights draw the same token, and take the compiled race.
    log_weights = weights.double().log().float()[None]
    one = torch.ones(1, dtype=torch.float64, device=weights.device)
    floors = torch.full((1,), _NO_FLOOR, dtype=torch.float64, device=weights.device)
    return int(race(log_weights, one, floors, row_keys(seed, [position], weights.device))[0])
