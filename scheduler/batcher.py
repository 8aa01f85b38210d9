"""Continuous batching with chunked prefill: what goes into the next forward.

Every step takes whatever is waiting; nothing waits for a quorum of edges
(the research code's static batches and 5 s timeout). Two kinds of work:

- rounds (a verify round or a decode step): latency-critical and small, so
  they go first, oldest first, until the step's token or row budget is spent;
- prefills: a new prompt, cut into chunks that fill what the rounds left.
  While a prefill waits, `prefill_reserve` tokens and one row of each step
  are kept for it, so a stream of rounds cannot starve it. A step that
  carries rounds stays near the cost curve's knee (`knee_tokens`, measured
  by the engine: past it every token costs its full compute), so rounds
  never wait behind a large chunk; a step with no rounds takes the whole
  budget.

A single round larger than the budget still runs, alone. A session has at
most one piece of work queued at a time (the engine enforces it), so its
rounds are served in the order it sent them.

    budget 64, reserve 16, no knee known; queued: round A (5), round B (40), prefill P (300)
    step 1: A, B (45 <= 64 - 16), then P[0:19]   (what is left: 64 - 45)
    step 2: P[19:83]                             (no rounds waiting)
    with a knee of 50 tokens, step 1 is A, B, then P[0:16] (the reserve: 50 - 45 < 16)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    max_batch_tokens: int = 512  # new tokens per forward, summed over rows
    max_batch_rows: int = 64  # sessions per forward
    prefill_reserve: int = 64  # tokens per step kept for a waiting prefill

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.max_batch_rows < 1:
            raise ValueError("max_batch_tokens and max_batch_rows must be >= 1")
        if not 0 < self.prefill_reserve <= self.max_batch_tokens:
            raise ValueError("prefill_reserve must be in 1..max_batch_tokens")


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

    @property
    def num_rows(self) -> int:
        return len(self.rounds) + len(self.prefills)

    def __bool__(self) -> bool:
        return self.num_rows > 0


@dataclasses.dataclass
class _Prefill:
    key: Hashable
    total: int
    done: int = 0


class Batcher:
    def __init__(self, config: BatcherConfig = BatcherConfig()):
        self.config = config
        self._rounds: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # key -> tokens
        self._prefills: collections.OrderedDict[Hashable, _Prefill] = collections.OrderedDict()
        # Tokens where a step's cost turns compute-bound (the engine's measured cost curve); None: unknown.
        self.knee_tokens: int | None = None

    def __len__(self) -> int:
        return len(self._rounds) + len(self._prefills)

    def add_round(self, key: Hashable, num_tokens: int) -> None:
        if key in self._rounds or key in self._prefills:
            raise ValueError(f"{key!r} already has work queued")
        self._rounds[key] = num_tokens

    def add_prefill(self, key: Hashable, num_tokens: int, start: int = 0) -> None:
        """Queue prompt tokens start .. start + num_tokens (start > 0: a later turn, the rest is cached)."""
        if key in self._rounds or key in self._prefills:
            raise ValueError(f"{key!r} already has work queued")
        self._prefills[key] = _Prefill(key, total=start + num_tokens, done=start)

    def remove(self, key: Hashable) -> None:
        """Forget a session's queued work (closed or cancelled); a no-op if none."""
        self._rounds.pop(key, None)
        self._prefills.pop(key, None)

    def plan_step(self) -> StepPlan:
        """Take the next step's work out of the queues."""
        config = self.config
        reserve = config.prefill_reserve if self._prefills else 0
        max_round_rows = config.max_batch_rows - (1 if self._prefills and config.max_batch_rows > 1 else 0)
        rounds: list[Hashable] = []
        tokens = 0
        for key, num_tokens in self._rounds.items():
            if len(rounds) == max_round_rows:
                break
            if rounds and tokens + num_tokens > config.max_batch_tokens - reserve:
                break
            rounds.append(key)
            tokens += num_tokens
        for key in rounds:
            del self._rounds[key]

        prefills: list[PrefillChunk] = []
        budget = max(config.max_batch_tokens - tokens, reserve)
        if rounds and self.knee_tokens is not None:
            budget = min(budget, max(self.knee_tokens - tokens, reserve))
        for prefill in self._prefills.values():
            if budget <= 0 or len(rounds) + len(prefills) == config.max_batch_rows:
                break
            size = min(prefill.total - prefill.done, budget)
            prefills.append(PrefillChunk(prefill.key, prefill.done, size, prefill.done + size == prefill.total))
            prefill.done += size
            budget -= size
        for chunk in prefills:
            if chunk.is_last:
                del self._prefills[chunk.key]
        return StepPlan(rounds, prefills)
