"""Continuous batching with chunked prefill: what goes into the next forward.

Every step takes whatever is waiting; nothing waits for a quorum of edges
(the research code's static batches and 5 s timeout). Two kinds of work:
rounds (a verify round or a decode step: the pending token plus its draft)
and prefills (a prompt, cut into chunks). A session has at most one piece of
work queued at a time (the engine enforces it), so its rounds are served in
the order it sent them.

**Fair shares** (the default). Each step carries at most a token budget: the
knee of the measured cost curve (step time ~ a + b * tokens, knee a / b: up
to there a step costs at most twice a one-token step, past it every token
costs its full compute), never below `min_step_tokens`, `default_step_tokens`
until the curve is measured; and never below one full round (`round_tokens`)
for each identity with work queued, so that many equal edges are batched as
before and only an identity asking for more than its share is ever cut; and
while no session is mid-answer (`answering`, kept by the engine: only prompts
wait), steps take `max_batch_tokens`, shared the same way, since no one's next
token waits on them. A budget fixed with `step_tokens` is the operator's cap
and does not grow.
When the queued work exceeds it, the budget is
shared max-min fairly across identities, then within each identity across its
sessions (scheduler/fairness.py, deficits carried from step to step). A round
granted fewer tokens than it carries is cut: it is verified on its first
nodes (a prefix of a chain, a subtree closed under parents: children come
after their parents), which keeps every lossless guarantee. A prefill's grant
is its next chunk. A row granted nothing this step waits, owed, for the next.

    budget 32 (step_tokens); A: one round of 1 token; B: four rounds of 65 (64 draft nodes each)
    identities: A 1, B 31   ->   B's sessions: 8, 8, 8, 7 (a deficit moves the odd token round)
    every B round is cut to its first 7 or 6 nodes; the step carries 32 tokens, not 261

Each row also gets its share if it asked for everything (`StepPlan.shares`):
the speculation advice follows it, so a well-behaved edge never drafts what
would be cut.

Shares need someone to be fair to: while the sessions open on the server all
belong to one identity (`open_identities`, kept by the engine) and the budget
is the measured knee (no fixed `step_tokens`), steps are planned by arrival
order below, so a lone user's prompt is prefilled in full chunks and its
rounds are never cut.

**Arrival order** (`fair_shares=False`, the old planner, for comparison; and
the plan whenever a single identity holds every open session).
Rounds go first, oldest first, until `max_batch_tokens` or the row budget is
spent; a single round larger than the budget runs alone, uncut. While a
prefill waits, `prefill_reserve` tokens and one row of each step are kept for
it; a step that carries rounds takes chunks only up to the knee.

    budget 64, reserve 16, no knee known; queued: round A (5), round B (40), prefill P (300)
    step 1: A, B (45 <= 64 - 16), then P[0:19]   (what is left: 64 - 45)
    step 2: P[19:83]                             (no rounds waiting)
    with a knee of 50 tokens, step 1 is A, B, then P[0:16] (the reserve: 50 - 45 < 16)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable

from specedge.scheduler.fairness import max_min_shares, share_if_unbounded


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    max_batch_tokens: int = 512  # new tokens per forward, summed over rows (with fair shares: the budget's ceiling)
    max_batch_rows: int = 64  # sessions per forward
    prefill_reserve: int = 64  # tokens per step kept for a waiting prefill (arrival order only)
    fair_shares: bool = True  # a per-step token budget shared max-min across identities (False: arrival order)
    step_tokens: int | None = None  # a fixed step budget; None: the measured cost curve's knee
    min_step_tokens: int = 8  # the budget's floor, whatever the curve says
    # Every identity with work queued may fill one full round a step: the pending token and the most
    # drafts the advice asks for (scheduler/speculation.py's max_draft_tokens, 16). The budget grows to that,
    # so equal edges are never cut below a round: only an identity asking for more than its share is.
    round_tokens: int = 17
    default_step_tokens: int = 64  # the budget until the curve is measured
    # Hold a step, at most the cost curve's fixed cost, for rounds due back from edges (scheduler/gather.py).
    gather: bool = True

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.max_batch_rows < 1:
            raise ValueError("max_batch_tokens and max_batch_rows must be >= 1")
        if not 0 < self.prefill_reserve <= self.max_batch_tokens:
            raise ValueError("prefill_reserve must be in 1..max_batch_tokens")
        if min(self.step_tokens or 1, self.min_step_tokens, self.default_step_tokens, self.round_tokens) < 1:
            raise ValueError("step_tokens, min_step_tokens, default_step_tokens and round_tokens must be >= 1")


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    key: Hashable
    start: int  # prompt tokens already prefilled (the chunk's first KV position)
    num_tokens: int
    is_last: bool


@dataclasses.dataclass(frozen=True)
class StepPlan:
    rounds: list[Hashable]
    prefills: list[PrefillChunk]
    # Rounds granted fewer tokens than they carry: key -> tokens to run (the pending token and that many - 1 nodes).
    cuts: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    # Every row's share of this step had it asked for everything, in tokens (fair shares only).
    shares: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    budget: int | None = None  # the step's token budget (fair shares only)

    @property
    def num_rows(self) -> int:
        return len(self.rounds) + len(self.prefills)

    def __bool__(self) -> bool:
        return self.num_rows > 0


@dataclasses.dataclass
class _Queued:
    key: Hashable
    owner: Hashable  # the identity whose share it draws on
    total: int  # a round's tokens, or the prompt's end
    arrival: int
    is_prefill: bool = False
    done: int = 0  # prompt tokens prefilled

    @property
    def remaining(self) -> int:
        return self.total - self.done


class Batcher:
    def __init__(self, config: BatcherConfig = BatcherConfig()):
        self.config = config
        self._queue: dict[Hashable, _Queued] = {}  # in arrival order
        self._arrivals = itertools.count()
        # The engine's measured step cost, seconds ~ a + b * tokens (scheduler/speculation.py); None: unknown.
        self.curve: tuple[float, float] | None = None
        self._identity_deficits: dict[Hashable, float] = {}
        # Identities holding open sessions, as the engine counts them; None: unknown (plan fairly).
        self.open_identities: int | None = None
        # Whether any session is mid-answer (its tokens wait on each step), as the engine sees it; None: unknown.
        # With none, nobody's latency is at stake: prompts are prefilled in steps of max_batch_tokens.
        self.answering: bool | None = None
        self._session_deficits: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def knee_tokens(self) -> int | None:
        """Tokens where a step's per-token cost b * tokens reaches its fixed cost a; None while unknown
        or when tokens are free (b = 0)."""
        if self.curve is None or self.curve[1] <= 0:
            return None
        a, b = self.curve
        return max(1, round(a / b))

    def step_budget(self) -> int:
        """The most tokens a step carries: with fair shares the knee, within [min_step_tokens, max_batch_tokens]."""
        config = self.config
        if not config.fair_shares:
            return config.max_batch_tokens
        if config.step_tokens is not None:
            budget = config.step_tokens
        elif self.curve is None:
            budget = config.default_step_tokens
        else:
            knee = self.knee_tokens  # None: extra tokens cost nothing measurable
            budget = config.max_batch_tokens if knee is None else max(knee, config.min_step_tokens)
        return min(budget, config.max_batch_tokens)

    def add_round(self, key: Hashable, num_tokens: int, owner: Hashable | None = None) -> None:
        """Queue a round of `num_tokens` (pending token + drafts) for `owner` (default: its own identity)."""
        self._add(_Queued(key, key if owner is None else owner, num_tokens, next(self._arrivals)))

    def add_prefill(self, key: Hashable, num_tokens: int, start: int = 0, owner: Hashable | None = None) -> None:
        """Queue prompt tokens start .. start + num_tokens (start > 0: a later turn, the rest is cached)."""
        owner = key if owner is None else owner
        self._add(_Queued(key, owner, start + num_tokens, next(self._arrivals), is_prefill=True, done=start))

    def _add(self, queued: _Queued) -> None:
        if queued.key in self._queue:
            raise ValueError(f"{queued.key!r} already has work queued")
        self._queue[queued.key] = queued

    def remove(self, key: Hashable) -> None:
        """Forget a session's queued work (closed or cancelled); a no-op if none."""
        self._queue.pop(key, None)

    def plan_step(self) -> StepPlan:
        """Take the next step's work out of the queue."""
        # A fixed budget is the operator's cap on every step; the knee's only purpose is sharing.
        shared = self.config.step_tokens is not None or self.open_identities is None or self.open_identities > 1
        plan = self._plan_fair() if self.config.fair_shares and shared else self._plan_by_arrival()
        for key in plan.rounds:
            del self._queue[key]
        for chunk in plan.prefills:
            self._queue[chunk.key].done += chunk.num_tokens
            if chunk.is_last:
                del self._queue[chunk.key]
        return plan

    def _plan_fair(self) -> StepPlan:
        waiting = list(self._queue.values())[: self.config.max_batch_rows]
        by_owner: dict[Hashable, dict[Hashable, int]] = {}
        for queued in waiting:
            by_owner.setdefault(queued.owner, {})[queued.key] = queued.remaining
        budget = self.step_budget()
        if self.config.step_tokens is None:  # a fixed budget is the operator's cap; the knee is not
            floor = (
                self.config.max_batch_tokens if self.answering is False else len(by_owner) * self.config.round_tokens
            )
            budget = min(max(budget, floor), self.config.max_batch_tokens)
        owner_demands = {owner: sum(demands.values()) for owner, demands in by_owner.items()}
        owner_grants, self._identity_deficits = max_min_shares(owner_demands, budget, self._identity_deficits)
        grants: dict[Hashable, int] = {}
        session_deficits: dict[Hashable, float] = {}
        shares: dict[Hashable, int] = {}
        for owner, demands in by_owner.items():
            owner_session_grants, deficits = max_min_shares(demands, owner_grants[owner], self._session_deficits)
            grants.update(owner_session_grants)
            session_deficits.update(deficits)
            owner_share = share_if_unbounded(owner_demands, owner, budget)
            shares.update({key: share_if_unbounded(demands, key, owner_share) for key in demands})
        self._session_deficits = session_deficits

        rounds: list[Hashable] = []
        prefills: list[PrefillChunk] = []
        cuts: dict[Hashable, int] = {}
        for queued in waiting:
            granted = grants[queued.key]
            if granted == 0:
                continue
            if queued.is_prefill:
                prefills.append(PrefillChunk(queued.key, queued.done, granted, granted == queued.remaining))
                continue
            rounds.append(queued.key)
            if granted < queued.total:
                cuts[queued.key] = granted
        ran = set(rounds) | {chunk.key for chunk in prefills}
        return StepPlan(rounds, prefills, cuts, {key: shares[key] for key in ran}, budget)

    def _plan_by_arrival(self) -> StepPlan:
        config = self.config
        rounds_queued = [queued for queued in self._queue.values() if not queued.is_prefill]
        prefills_queued = [queued for queued in self._queue.values() if queued.is_prefill]
        reserve = config.prefill_reserve if prefills_queued else 0
        max_round_rows = config.max_batch_rows - (1 if prefills_queued and config.max_batch_rows > 1 else 0)
        rounds: list[Hashable] = []
        tokens = 0
        for queued in rounds_queued:
            if len(rounds) == max_round_rows:
                break
            if rounds and tokens + queued.total > config.max_batch_tokens - reserve:
                break
            rounds.append(queued.key)
            tokens += queued.total

        prefills: list[PrefillChunk] = []
        budget = max(config.max_batch_tokens - tokens, reserve)
        knee = self.knee_tokens
        if rounds and knee is not None:
            budget = min(budget, max(knee - tokens, reserve))
        for queued in prefills_queued:
            if budget <= 0 or len(rounds) + len(prefills) == config.max_batch_rows:
                break
            size = min(queued.remaining, budget)
            prefills.append(PrefillChunk(queued.key, queued.done, size, size == queued.remaining))
            budget -= size
        return StepPlan(rounds, prefills)
