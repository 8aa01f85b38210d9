"""Every row's draws from the target's logits in one vectorized pass: the step's postprocess math.

After a forward, each row needs something from its logits:

- a prefill chunk before the prompt's last: nothing;
- the last prefill chunk, a greedy round, a tree, or a sampled chain sent
  without q: the target's own token after each position (argmax, or the
  seeded race of server/sampling.py), which verification then matches;
- a sampled chain sent with q: rejection sampling (server/rejection.py), which
  needs p at each draft token and the target's own sample after the last.

One pass over all rows' logits gives every argmax (and catches NaN and inf)
and every sampled token (compiled on CPU: server/race_kernel.py). On CPU that
same pass walks each chain sent with q, its rows in order, while each row is
still in cache: p's log-normaliser and p at each draft it reaches, the draft's
verdict, a rejected draft's residual raced there, and the bonus raced only
where every draft was accepted. So no row is read twice, and nothing is
computed for the rows past a rejection: on 64 chains of real text that took
0.68x the time of deciding later drafts after the pass, which re-read their
rows. On the eager
path (CUDA, other dtypes) the chains are walked here in torch ops, once per
draft depth over the chains still walking, with every residual drawn from
dense p. Nothing here commits tokens or touches KV: server/postprocess.py does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from specedge import noise
from specedge.server import race_kernel
from specedge.server.isolation import NonFiniteLogits
from specedge.server.rejection import acceptance_uniforms, accepts, residual_tokens
from specedge.server.sampling import argmax_and_race, logit_floors
from specedge.server.verify import VerifyResult
from specedge.types import SamplingParams, SparseDist


@dataclasses.dataclass(frozen=True)
class RowDraw:
    """What one row asks of its logits."""

    num_logits: int  # the row's rows in the packed logits
    params: SamplingParams | None  # None: nothing to draw (a prefill chunk before the prompt's last)
    seed: int = 0
    positions: tuple[int, ...] = ()  # [num_logits] sequence index of the token decided at each
    draft_token_ids: tuple[int, ...] = ()  # with draft_dists: a sampled chain, verified by rejection
    draft_dists: tuple[SparseDist, ...] = ()

    def __post_init__(self) -> None:
        if self.params is not None and not self.params.greedy and len(self.positions) != self.num_logits:
            raise ValueError(f"a sampled row needs a position per logit: {len(self.positions)} for {self.num_logits}")

    @property
    def by_rejection(self) -> bool:
        return bool(self.draft_dists) and self.params is not None and not self.params.greedy


# What a row gets: the target's tokens at its positions, a rejection verdict, nothing, or its failure.
Drawn = list[int] | VerifyResult | None | Exception


def draw_rows(logits: torch.Tensor, rows: Sequence[RowDraw]) -> list[Drawn]:
    """logits: [sum of num_logits, V], rows in order. Each row's draws, or NonFiniteLogits for a broken row."""
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + row.num_logits)
    setting = _Setting.of(rows, starts, logits)
    # A chain verified by rejection races only after its last draft (its bonus); its other
    # positions are decided by p at the draft tokens, or a residual.
    racing = setting.sampled.clone()
    chains = [(i, row) for i, row in enumerate(rows) if row.by_rejection]
    for i, row in chains:
        racing[starts[i] : starts[i] + len(row.draft_token_ids)] = False
    drafts = _drafts(chains, starts, len(racing)) if chains and race_kernel.covers(logits) else None
    top, finite_mask, winners, verdicts = argmax_and_race(
        logits, racing, setting.temperature, setting.floors, setting.keys, drafts
    )
    drawn_tokens, finite = winners.tolist(), finite_mask.tolist()
    walks = {i: row for i, row in chains if all(finite[starts[i] : starts[i + 1]])}
    if verdicts is not None:  # compiled: the pass walked every chain
        verdicts_of = _read_walks(walks, starts, drawn_tokens, verdicts.tolist())
    else:
        verdicts_of = _walk_eagerly(logits, walks, starts, top, drawn_tokens, setting) if walks else {}

    drawn: list[Drawn] = []
    for i, row in enumerate(rows):
        span = slice(starts[i], starts[i + 1])
        if not all(finite[span]):
            drawn.append(NonFiniteLogits("non-finite logits"))
        elif row.params is None:
            drawn.append(None)
        elif row.by_rejection:
            drawn.append(verdicts_of[i])
        else:
            drawn.append(drawn_tokens[span])
    return drawn


def _drafts(chains: Sequence[tuple[int, RowDraw]], starts: Sequence[int], num_logits: int) -> race_kernel.Drafts:
    """Every chain's drafts at their logit rows, each with u q(token), the p it must pass (rejection.accepts),
    and q renormalised as SparseDist.prob_of does (its own sum, in order); a chain's rows are one group."""
    lengths = np.fromiter((len(row.draft_token_ids) for _, row in chains), np.int64, len(chains))
    total = int(lengths.sum())
    firsts = np.fromiter((starts[i] for i, _ in chains), np.int64, len(chains))
    index = np.repeat(firsts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)  # [D] logit rows
    dists = [dist for _, row in chains for dist in row.draft_dists]
    tokens = np.fromiter(itertools.chain.from_iterable(row.draft_token_ids for _, row in chains), np.int64, total)
    seed_keys = np.repeat(np.fromiter((noise.seed_key(row.seed) for _, row in chains), np.int64, len(chains)), lengths)
    positions = np.fromiter(
        itertools.chain.from_iterable(row.positions[: len(row.draft_token_ids)] for _, row in chains), np.int64, total
    )
    sizes = np.fromiter((len(d.token_ids) for d in dists), np.int64, total)
    num_q = int(sizes.sum())
    q_ids = np.fromiter(itertools.chain.from_iterable(d.token_ids for d in dists), np.int64, num_q)
    sums = np.repeat(np.fromiter((sum(d.probs) for d in dists), np.float64, total), sizes)
    q_probs = np.fromiter(itertools.chain.from_iterable(d.probs for d in dists), np.float64, num_q) / sums
    # q(token) of each draft, read off its own q (0 where q lacks it; a q is never empty, and holds a token once).
    at_token = np.where(q_ids == np.repeat(tokens, sizes), q_probs, 0.0)
    q_of_tokens = np.add.reduceat(at_token, np.cumsum(sizes) - sizes)
    # Spread over the step's logit rows: a row without a draft has none, and an empty q.
    token_ids = np.full(num_logits, race_kernel.NO_TOKEN, np.int64)
    thresholds, row_sizes = np.zeros(num_logits), np.zeros(num_logits, np.int64)
    token_ids[index], row_sizes[index] = tokens, sizes
    thresholds[index] = acceptance_uniforms(seed_keys, positions) * q_of_tokens
    q_starts = np.concatenate([[0], np.cumsum(row_sizes)]).astype(np.int64)
    # Groups: each chain's span, and every other row alone.
    chain_start = {starts[i]: starts[i + 1] for i, _ in chains}
    groups, row = [0], 0
    while row < num_logits:
        row = chain_start.get(row, row + 1)
        groups.append(row)
    return race_kernel.Drafts(token_ids, thresholds, q_starts, q_ids, q_probs, np.array(groups, np.int64))


@dataclasses.dataclass(frozen=True)
class _Setting:
    """Per packed logit row: whether it samples, and its temperature, logit floor and noise key."""

    sampled: torch.Tensor  # [L] bool
    temperature: torch.Tensor  # [L] float64 (1 where greedy)
    floors: torch.Tensor  # [L] float64
    keys: torch.Tensor  # [L] int64

    @staticmethod
    def of(rows: Sequence[RowDraw], starts: Sequence[int], logits: torch.Tensor) -> _Setting:
        num_logits, device = logits.shape[0], logits.device
        samplers = [
            (i, row, row.params) for i, row in enumerate(rows) if row.params is not None and not row.params.greedy
        ]
        if not samplers:  # a greedy step: nothing to key or filter
            return _Setting(
                torch.zeros(num_logits, dtype=torch.bool, device=device),
                torch.ones(num_logits, dtype=torch.float64, device=device),
                torch.full((num_logits,), -math.inf, dtype=torch.float64, device=device),
                torch.zeros(num_logits, dtype=torch.long, device=device),
            )
        sampled, temperature = [False] * num_logits, [1.0] * num_logits
        top_k, top_p = [0] * num_logits, [1.0] * num_logits
        seed_keys, positions = [0] * num_logits, [0] * num_logits
        for i, row, params in samplers:
            span, n = slice(starts[i], starts[i + 1]), row.num_logits
            sampled[span], temperature[span] = [True] * n, [params.temperature] * n
            top_k[span], top_p[span] = [params.top_k] * n, [params.top_p] * n
            seed_keys[span], positions[span] = [noise.seed_key(row.seed)] * n, row.positions
        # Every sampled position's key in one vectorized hash; a greedy row's is never read.
        keys = noise.position_key(np.array(seed_keys, np.int64), np.array(positions, np.int64), noise.TARGET_STREAM)
        temperatures = torch.tensor(temperature, dtype=torch.float64, device=device)
        floors = logit_floors(logits, temperatures, top_k, top_p)
        return _Setting(torch.tensor(sampled, device=device), temperatures, floors, torch.from_numpy(keys).to(device))


def _read_walks(
    chains: dict[int, RowDraw],  # row index -> a sampled chain with q, walked by the pass
    starts: Sequence[int],
    drawn: Sequence[int],  # [L] the pass's draws: the race's winner at each bonus, the residual at a rejection
    verdicts: Sequence[int],  # [L] the pass's verdict on each draft (race_kernel's codes)
) -> dict[int, VerifyResult]:
    """Each chain's outcome from the pass's walk: its drafts accepted in order, then its residual's draw at
    the rejected one, or its bonus."""
    results = {}
    for i, row in chains.items():
        first, num_drafts, num_accepted = starts[i], len(row.draft_token_ids), 0
        while num_accepted < num_drafts and verdicts[first + num_accepted] == race_kernel.ACCEPTED:
            num_accepted += 1
        if num_accepted < num_drafts and verdicts[first + num_accepted] != race_kernel.REJECTED:
            raise AssertionError(f"the pass left draft {num_accepted} of a finite chain undecided")
        results[i] = VerifyResult(tuple(range(1, num_accepted + 1)), drawn[first + num_accepted])
    return results


def _walk_eagerly(
    logits: torch.Tensor,  # [L, V]
    chains: dict[int, RowDraw],  # row index -> a sampled chain with q
    starts: Sequence[int],
    top: torch.Tensor,  # [L] argmax
    drawn: Sequence[int],  # [L] the race's winner at each bonus position
    setting: _Setting,
) -> dict[int, VerifyResult]:
    """Rejection sampling in torch ops, draft by draft: p is computed only at drafts the walk reaches (and its
    log-normaliser there), one depth at a time over the chains still walking."""
    values = logits.gather(1, top.to(logits.device)[:, None])[:, 0]  # [L] each row's max logit
    num_accepted = dict.fromkeys(chains, 0)
    walking = list(chains)
    rejected: list[int] = []
    while walking:
        index = [starts[i] + num_accepted[i] for i in walking]
        log_norms = _log_norms(logits, index, values, setting)
        tokens = [chains[i].draft_token_ids[num_accepted[i]] for i in walking]
        probs = _probs_at(logits, index, tokens, values, log_norms, setting)
        still = []
        for i, prob in zip(walking, probs):
            row, j = chains[i], num_accepted[i]
            if not accepts(row.draft_token_ids[j], row.draft_dists[j], prob, row.seed, row.positions[j]):
                rejected.append(i)
                continue
            num_accepted[i] += 1
            if j + 1 < len(row.draft_token_ids):
                still.append(i)
        walking = still
    residuals = residual_tokens(
        logits,
        [starts[i] + num_accepted[i] for i in rejected],
        setting.temperature,
        setting.floors,
        [chains[i].draft_dists[num_accepted[i]] for i in rejected],
        [chains[i].seed for i in rejected],
        [chains[i].positions[num_accepted[i]] for i in rejected],
    )
    next_tokens = {i: drawn[starts[i] + num_accepted[i]] for i in chains} | dict(zip(rejected, residuals))
    return {i: VerifyResult(tuple(range(1, num_accepted[i] + 1)), next_tokens[i]) for i in chains}


def _log_norms(
    logits: torch.Tensor,  # [L, V]
    index: Sequence[int],  # [D] rows
    values: torch.Tensor,  # [L] max logits
    setting: _Setting,
) -> list[float]:  # [D] log sum exp((logit - max) / T) over each row's kept tokens
    index_t = torch.tensor(index, device=logits.device)
    rows = logits[index_t]  # [D, V]
    scale = setting.temperature[index_t, None].float().clamp_min(torch.finfo(torch.float32).tiny)
    # (logit - max) / T stays finite for any T > 0, and <= 0: the max's term is 1, nothing overflows.
    shifted = (rows.float() - values[index_t, None].float()) / scale
    shifted = shifted.masked_fill(rows < setting.floors[index_t, None].to(rows.dtype), -math.inf)
    return shifted.logsumexp(dim=-1).tolist()


def _probs_at(
    logits: torch.Tensor,  # [L, V]
    index: Sequence[int],  # [D] rows
    tokens: Sequence[int],  # [D] the draft token at each
    values: torch.Tensor,  # [L]
    log_norms: Sequence[float],  # [D]
    setting: _Setting,
) -> list[float]:  # [D] p(token) of each row
    index_t = torch.tensor(index, device=logits.device)
    picked = logits[index_t, torch.tensor(tokens, device=logits.device)]  # [D]
    scale = setting.temperature[index_t].float().clamp_min(torch.finfo(torch.float32).tiny)
    log_p = ((picked.float() - values[index_t].float()) / scale).double() - torch.tensor(
        log_norms, dtype=torch.float64, device=logits.device
    )
    return torch.where(picked.double() >= setting.floors[index_t], log_p.exp(), torch.zeros_like(log_p)).tolist()
