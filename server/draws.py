"""Every row's draws from the target's logits in one vectorized pass: the step's postprocess math.

After a forward, each row needs something from its logits:

- a prefill chunk before the prompt's last: nothing;
- the last prefill chunk, a greedy round, a tree, or a sampled chain sent
  without q: the target's own token after each position (argmax, or the
  seeded race of server/sampling.py), which verification then matches;
- a sampled chain sent with q: rejection sampling (server/rejection.py), which
  needs p at each draft token and the target's own sample after the last.

One max over all rows' logits gives every argmax (and catches NaN and inf);
one race gives every sampled token; one log-normaliser pass gives p at every
draft token. Only a rejected draft's residual looks at a row on its own.
Nothing here commits tokens or touches KV: server/postprocess.py does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specedge.server.isolation import NonFiniteLogits
from specedge.server.rejection import decide_chain
from specedge.server.sampling import logit_floors, probs_with_floors, race, row_keys
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

    @property
    def by_rejection(self) -> bool:
        return bool(self.draft_dists) and self.params is not None and not self.params.greedy


# What a row gets: the target's tokens at its positions, a rejection verdict, nothing, or its failure.
Drawn = list[int] | VerifyResult | None | Exception


def draw_rows(logits: torch.Tensor, rows: Sequence[RowDraw]) -> list[Drawn]:
    """logits: [sum of num_logits, V], rows in order. Each row's draws, or NonFiniteLogits for a broken row."""
    device = logits.device
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + row.num_logits)
    values, top = logits.max(dim=-1)  # [L]: every argmax; NaN and +inf propagate into the max
    finite = torch.isfinite(values).tolist()

    # Per packed logit row: T, filters and noise key (greedy rows take no part in the race).
    sampled_rows = [i for i, row in enumerate(rows) if row.params is not None and not row.params.greedy]
    winners = top
    probs_of_drafts: dict[int, list[float]] = {}
    if sampled_rows:
        num_logits = logits.shape[0]
        temperature = torch.ones(num_logits, dtype=torch.float64)
        top_k, top_p = [0] * num_logits, [1.0] * num_logits
        keys = torch.zeros(num_logits, dtype=torch.long)
        racing = torch.zeros(num_logits, dtype=torch.bool)
        for i in sampled_rows:
            row, span = rows[i], slice(starts[i], starts[i + 1])
            temperature[span] = row.params.temperature
            top_k[span] = [row.params.top_k] * row.num_logits
            top_p[span] = [row.params.top_p] * row.num_logits
            keys[span] = row_keys(row.seed, row.positions, keys.device)
            racing[span] = True
        temperature, keys, racing = temperature.to(device), keys.to(device), racing.to(device)
        floors = logit_floors(logits, temperature, top_k, top_p)
        floors = floors.masked_fill(~racing, float("inf"))  # no candidates: a greedy row keeps its argmax
        winners = race(logits, temperature, floors, keys, row_max=(values, top))
        probs_of_drafts = _draft_probs(logits, rows, starts, values, temperature, floors)
    targets = winners.tolist()

    drawn: list[Drawn] = []
    for i, row in enumerate(rows):
        span = slice(starts[i], starts[i + 1])
        if not all(finite[span]):
            drawn.append(NonFiniteLogits("non-finite logits"))
        elif row.params is None:
            drawn.append(None)
        elif row.by_rejection:
            start, n = starts[i], len(row.draft_token_ids)
            drawn.append(
                decide_chain(
                    row.draft_token_ids, row.draft_dists, probs_of_drafts[i], row.positions, row.seed,
                    target_row=lambda j, start=start: probs_with_floors(
                        logits[start + j : start + j + 1], temperature[start + j : start + j + 1],
                        floors[start + j : start + j + 1],
                    )[0],
                    bonus=lambda start=start, n=n: targets[start + n],
                )  # fmt: skip
            )
        else:
            drawn.append(targets[span])
    return drawn


def _draft_probs(
    logits: torch.Tensor,  # [L, V]
    rows: Sequence[RowDraw],
    starts: Sequence[int],
    values: torch.Tensor,  # [L] each row's max logit
    temperature: torch.Tensor,  # [L] float64
    floors: torch.Tensor,  # [L] float64
) -> dict[int, list[float]]:
    """p at each draft token of every rejection row, from one log-normaliser pass over just those rows."""
    chains = [i for i, row in enumerate(rows) if row.by_rejection]
    if not chains:
        return {}
    # Logit row starts[i] + j holds p before draft token j.
    index = [starts[i] + j for i in chains for j in range(len(rows[i].draft_token_ids))]
    tokens = [t for i in chains for t in rows[i].draft_token_ids]
    index_t = torch.tensor(index, device=logits.device)
    tokens_t = torch.tensor(tokens, device=logits.device)
    sub = logits.index_select(0, index_t)  # [D, V]
    # float32, like the dense p the rejection walk falls back to; (logit - max) / T stays finite for any T.
    scale = temperature[index_t, None].float().clamp_min(torch.finfo(torch.float32).tiny)
    shifted = (sub.float() - values[index_t, None].float()) / scale
    shifted = shifted.masked_fill(sub < floors[index_t, None].to(sub.dtype), float("-inf"))
    log_norm = shifted.logsumexp(dim=-1).double()  # [D]
    picked = logits[index_t, tokens_t]  # [D]
    log_p = (picked.double() - values[index_t].double()) / temperature[index_t] - log_norm
    probs = torch.where(picked.double() >= floors[index_t], log_p.exp(), torch.zeros_like(log_p)).tolist()
    out, at = {}, 0
    for i in chains:
        n = len(rows[i].draft_token_ids)
        out[i] = probs[at : at + n]
        at += n
    return out
