"""Every row's draws from the target's logits in one vectorized pass: the step's postprocess math.

After a forward, each row needs something from its logits:

- a prefill chunk before the prompt's last: nothing;
- the last prefill chunk, a greedy round, a tree, or a sampled chain sent
  without q: the target's own token after each position (argmax, or the
  seeded race of server/sampling.py), which verification then matches;
- a sampled chain sent with q: rejection sampling (server/rejection.py), which
  needs p at each draft token and the target's own sample after the last.

One pass over all rows' logits gives every argmax (and catches NaN and inf)
and every sampled token (compiled on CPU: server/race_kernel.py). A chain
verified by rejection then needs p at the drafts its walk reaches, and so the
log-normaliser there. On CPU that same pass sums it while the row is still
in cache, at each chain's first draft (always reached) and at every other
draft whose row is peaked (few tokens within reach: cheap); a second pass over
the walked rows took 2x the time of reading the logits once (64 rows x 5
tokens, 152k vocabulary, peaked). What is left, and everything on the eager
path, is summed once per draft depth, over the chains still walking. Every
rejected draft's residual is drawn in one more race. Nothing here commits
tokens or touches KV: server/postprocess.py does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from specedge import noise
from specedge.server import race_kernel
from specedge.server.isolation import NonFiniteLogits
from specedge.server.rejection import accepts, residual_tokens
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
    # positions are decided below, by p at the draft tokens, or a residual.
    # Their drafts need p's log-normaliser where the walk reaches them: the first always, the others
    # summed in the same pass where that is cheap (race_kernel's codes).
    racing = setting.sampled.clone()
    norming = torch.zeros(len(racing), dtype=torch.uint8)
    for i, row in enumerate(rows):
        if row.by_rejection:
            racing[starts[i] : starts[i] + len(row.draft_token_ids)] = False
            norming[starts[i] : starts[i] + len(row.draft_token_ids)] = race_kernel.NORM_IF_FEW
            norming[starts[i]] = race_kernel.NORM_ALWAYS
    top, finite_mask, winners, norms = argmax_and_race(
        logits, racing, setting.temperature, setting.floors, setting.keys, norming if bool(norming.any()) else None
    )
    targets, finite = winners.tolist(), finite_mask.tolist()
    chains = {i: row for i, row in enumerate(rows) if row.by_rejection and all(finite[starts[i] : starts[i + 1]])}
    verdicts = _verify_chains(logits, chains, starts, top, targets, norms, setting) if chains else {}

    drawn: list[Drawn] = []
    for i, row in enumerate(rows):
        span = slice(starts[i], starts[i + 1])
        if not all(finite[span]):
            drawn.append(NonFiniteLogits("non-finite logits"))
        elif row.params is None:
            drawn.append(None)
        elif row.by_rejection:
            drawn.append(verdicts[i])
        else:
            drawn.append(targets[span])
    return drawn


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


def _verify_chains(
    logits: torch.Tensor,  # [L, V]
    chains: dict[int, RowDraw],  # row index -> a sampled chain with q
    starts: Sequence[int],
    top: torch.Tensor,  # [L] argmax
    targets: Sequence[int],  # [L] the race's winner at each bonus position
    norms: torch.Tensor | None,  # [L] float64 log-normalisers at the drafts, where the argmax pass summed them
    setting: _Setting,
) -> dict[int, VerifyResult]:
    """Rejection sampling of every chain, draft by draft: p is computed only at drafts the walk reaches
    (and its log-normaliser there, unless the argmax pass summed them all)."""
    values = logits.gather(1, top.to(logits.device)[:, None])[:, 0]  # [L] each row's max logit
    num_accepted = dict.fromkeys(chains, 0)
    walking = list(chains)
    rejected: list[tuple[int, float]] = []  # (row index, log normaliser at its rejected draft)
    while walking:
        index = [starts[i] + num_accepted[i] for i in walking]
        log_norms = _log_norms(logits, index, values, setting, norms)
        tokens = [chains[i].draft_token_ids[num_accepted[i]] for i in walking]
        probs = _probs_at(logits, index, tokens, values, log_norms, setting)
        still = []
        for i, log_norm, prob in zip(walking, log_norms, probs):
            row, j = chains[i], num_accepted[i]
            if not accepts(row.draft_token_ids[j], row.draft_dists[j], prob, row.seed, row.positions[j]):
                rejected.append((i, log_norm))
            elif j + 1 < len(row.draft_token_ids):
                num_accepted[i] += 1
                still.append(i)
            else:
                num_accepted[i] += 1
        walking = still
    residuals = residual_tokens(
        logits,
        [starts[i] + num_accepted[i] for i, _ in rejected],
        values,
        setting.temperature,
        setting.floors,
        [log_norm for _, log_norm in rejected],
        [chains[i].draft_dists[num_accepted[i]] for i, _ in rejected],
        [chains[i].seed for i, _ in rejected],
        [chains[i].positions[num_accepted[i]] for i, _ in rejected],
    )
    next_tokens = {i: targets[starts[i] + num_accepted[i]] for i in chains} | {
        i: token for (i, _), token in zip(rejected, residuals)
    }
    return {i: VerifyResult(tuple(range(1, num_accepted[i] + 1)), next_tokens[i]) for i in chains}


def _log_norms(
    logits: torch.Tensor,  # [L, V]
    index: Sequence[int],  # [D] rows
    values: torch.Tensor,  # [L] max logits
    setting: _Setting,
    known: torch.Tensor | None,  # [L] float64: those the argmax pass summed (NaN: not summed)
) -> list[float]:  # [D] log sum exp((logit - max) / T) over each row's kept tokens
    if known is not None:
        found = known[index]
        missing = found.isnan().nonzero().squeeze(1)
        if len(missing):
            rest = [index[m] for m in missing.tolist()]
            found[missing] = torch.tensor(_log_norms(logits, rest, values, setting, None), dtype=torch.float64)
        return found.tolist()
    index_t = torch.tensor(index, device=logits.device)
    if race_kernel.covers(logits):
        return race_kernel.log_norms(logits, index_t, setting.temperature[index_t], setting.floors[index_t]).tolist()
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
