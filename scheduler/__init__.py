"""Pure-Python scheduling: which work runs in the next batched forward, where its KV lives,
and how much drafting pays.

No torch, no sockets: queues, slots and budgets only, so the tests run in
milliseconds.
"""

from specedge.scheduler.batcher import Batcher, BatcherConfig, PrefillChunk, StepPlan
from specedge.scheduler.slots import NoFreeSlot, SlotAllocator, slots_within_budget

__all__ = ["Batcher", "BatcherConfig", "NoFreeSlot", "PrefillChunk", "SlotAllocator", "StepPlan", "slots_within_budget"]
