"""Pure-Python scheduling: which work runs in the next batched forward, and where its KV lives.

No torch, no sockets: queues, slots and budgets only, so the tests run in
milliseconds.
"""

from specedge.scheduler.batcher import Batcher, BatcherConfig, WorkItem
from specedge.scheduler.slots import NoFreeSlot, SlotAllocator

__all__ = ["Batcher", "BatcherConfig", "NoFreeSlot", "SlotAllocator", "WorkItem"]
