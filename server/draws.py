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
same pass also decides rejection sampling's drafts while each row is still in
cache: it sums p's log-normaliser at each chain's first draft (always reached)
and at every other draft whose row is peaked (few tokens within reach: cheap),
tests the draft against it, and races a rejected draft's residual there. A
second pass over the rows took 2x the time of reading the logits once (64 rows
x 5 tokens, 152k vocabulary, peaked). What is left (later drafts on flat rows,
and everything on the eager path) is decided here, once per draft depth, over
the chains still walking, and every residual left is drawn in one more race.
Nothing here commits tokens or touches KV: server/postprocess.py does.
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
from specedge.server.rejection import acceptance_uniforms, accepts, residual_tokens, sparse_drafts
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
    # The pass decides the drafts whose normaliser it sums: the first always, the others where
    # that is cheap (race_kernel's codes). The rest are decided below.
    racing = setting.sampled.clone()
    norming = torch.zeros(len(racing), dtype=torch.uint8)
    chains = [(i, row) for i, row in enumerate(rows) if row.by_rejection]
    for i, row in chains:
        racing[starts[i] : starts[i] + len(row.draft_token_ids)] = False
        norming[starts[i] : starts[i] + len(row.draft_token_ids)] = race_kernel.NORM_IF_FEW
        norming[starts[i]] = race_kernel.NORM_ALWAYS
    drafts = _drafts(chains, starts, len(racing)) if chains and race_kernel.covers(logits) else None
    top, finite_mask, winners, _, verdicts = argmax_and_race(
        logits, racing, setting.temperature, setting.floors, setting.keys, norming if chains else None, drafts
    )
    drawn_tokens, finite = winners.tolist(), finite_mask.tolist()
    decided = [race_kernel.UNDECIDED] * len(racing) if verdicts is None else verdicts.tolist()
    walks = {i: row for i, row in chains if all(finite[starts[i] : starts[i + 1]])}
    verdicts_of = _verify_chains(logits, walks, starts, top, drawn_tokens, decided, setting) if walks else {}

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
    """Every chain's drafts at their logit rows, each with u q(token), the p it must pass (rejection.accepts)."""
    lengths = np.fromiter((len(row.draft_token_ids) for _, row in chains), np.int64, len(chains))
    total = int(lengths.sum())
    firsts = np.fromiter((starts[i] for i, _ in chains), np.int64, len(chains))
    index = np.repeat(firsts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)  # [D] logit rows
    dists = [dist for _, row in chains for dist in row.draft_dists]
    tokens = [token for _, row in chains for token in row.draft_token_ids]
    seed_keys = np.repeat(np.fromiter((noise.seed_key(row.seed) for _, row in chains), np.int64, len(chains)), lengths)
    positions = np.fromiter(
        itertools.chain.from_iterable(row.positions[: len(row.draft_token_ids)] for _, row in chains), np.int64, total
    )
    uniforms = acceptance_uniforms(seed_keys, positions)
    q_of_tokens = np.fromiter(map(SparseDist.prob_of, dists, tokens), np.float64, len(dists))
    packed = sparse_drafts(dists, tokens, uniforms * q_of_tokens)
    # Spread over the step's logit rows: a row without a draft has none, and an empty q.
    token_ids = np.full(num_logits, race_kernel.NO_TOKEN, np.int64)
    thresholds, sizes = np.zeros(num_logits), np.zeros(num_logits, np.int64)
    token_ids[index], thresholds[index], sizes[index] = packed.token_ids, packed.thresholds, np.diff(packed.q_starts)
    q_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return race_kernel.Drafts(token_ids, thresholds, q_starts, packed.q_ids, packed.q_probs)


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
    drawn: Sequence[int],  # [L] the pass's draws: the race's winner at each bonus, the residual at a rejection
    decided: Sequence[int],  # [L] the pass's verdict on each draft (race_kernel's codes)
    setting: _Setting,
) -> dict[int, VerifyResult]:
    """Rejection sampling of every chain, draft by draft: the pass's verdicts where it gave one, else
    p at the drafts the walk reaches (and its log-normaliser there), decided here."""
    values = logits.gather(1, top.to(logits.device)[:, None])[:, 0]  # [L] each row's max logit
    num_accepted = dict.fromkeys(chains, 0)
    next_tokens: dict[int, int] = {}
    walking = list(chains)
    rejected: list[tuple[int, float]] = []  # (row index, log normaliser at its rejected draft): residuals to draw
    while walking:
        # The drafts the pass left undecided, decided together: p at each, from its normaliser.
        undecided = [i for i in walking if decided[starts[i] + num_accepted[i]] == race_kernel.UNDECIDED]
        here: dict[int, tuple[bool, float]] = {}
        if undecided:
            index = [starts[i] + num_accepted[i] for i in undecided]
            log_norms = _log_norms(logits, index, values, setting)
            tokens = [chains[i].draft_token_ids[num_accepted[i]] for i in undecided]
            probs = _probs_at(logits, index, tokens, values, log_norms, setting)
            for i, log_norm, prob in zip(undecided, log_norms, probs):
                row, j = chains[i], num_accepted[i]
                here[i] = (
                    accepts(row.draft_token_ids[j], row.draft_dists[j], prob, row.seed, row.positions[j]),
                    log_norm,
                )
        still = []
        for i in walking:
            row, j = chains[i], num_accepted[i]
            verdict = decided[starts[i] + j]
            if verdict == race_kernel.REJECTED:
                next_tokens[i] = drawn[starts[i] + j]  # the pass drew its residual
            elif verdict == race_kernel.UNDECIDED and not here[i][0]:
                rejected.append((i, here[i][1]))
            elif j + 1 < len(row.draft_token_ids):
                num_accepted[i] += 1
                still.append(i)
            else:
                num_accepted[i] += 1
                next_tokens[i] = drawn[starts[i] + j + 1]  # every draft accepted: the bonus
        walking = still
    residuals = residual_tokens(
        logits,
        [starts[i] + num_accepted[i] for i, _ in rejected],
        setting.temperature,
        setting.floors,
        [log_norm for _, log_norm in rejected],
        [chains[i].draft_dists[num_accepted[i]] for i, _ in rejected],
        [chains[i].seed for i, _ in rejected],
        [chains[i].positions[num_accepted[i]] for i, _ in rejected],
    )
    next_tokens |= {i: token for (i, _), token in zip(rejected, residuals)}
    return {i: VerifyResult(tuple(range(1, num_accepted[i] + 1)), next_tokens[i]) for i in chains}


def _log_norms(
    logits: torch.Tensor,  # [L, V]
    index: Sequence[int],  # [D] rows
    values: torch.Tensor,  # [L] max logits
    setting: _Setting,
) -> list[float]:  # [D] log sum exp((logit - max) / T) over each row's kept tokens
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
