"""Continuous batching: whatever is queued goes into the next forward, within a token budget.

The engine never waits for a quorum of edges (the research code's static
batches and 5 s timeout): each step takes the queued work in arrival order
until the step's token budget or row budget is spent. A single item larger
than the budget still runs, alone, so nothing starves.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Generic, TypeVar

Payload = TypeVar("Payload")


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    max_batch_tokens: int = 2048  # new tokens per forward, summed over rows
    max_batch_rows: int = 64  # sessions per forward

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.max_batch_rows < 1:
            raise ValueError("max_batch_tokens and max_batch_rows must be >= 1")


@dataclasses.dataclass(frozen=True)
class WorkItem(Generic[Payload]):
    num_tokens: int  # new tokens this item adds to a forward
    payload: Payload


class Batcher(Generic[Payload]):
    def __init__(self, config: BatcherConfig):
        self.config = config
        self._queue: collections.deque[WorkItem[Payload]] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, item: WorkItem[Payload]) -> None:
        self._queue.append(item)

    def take_batch(self) -> list[WorkItem[Payload]]:
        batch: list[WorkItem[Payload]] = []
        tokens = 0
        while self._queue and len(batch) < self.config.max_batch_rows:
            item = self._queue[0]
            if batch and tokens + item.num_tokens > self.config.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += item.num_tokens
        return batch
