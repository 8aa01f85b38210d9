"""KV slot bookkeeping: a fixed pool, handed out and given back."""

from __future__ import annotations


class NoFreeSlot(Exception):
    pass


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise NoFreeSlot(f"all {self.num_slots} session slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)


def slots_within_budget(*, requested: int, bytes_per_slot: int, budget_bytes: int | None) -> int:
    """How many of the `requested` KV slots fit in `budget_bytes` (None: no budget).

    Raises ValueError, naming the numbers, when not even one slot fits.
    """
    if budget_bytes is None:
        return requested
    fitting = budget_bytes // bytes_per_slot
    if fitting < 1:
        raise ValueError(
            f"one KV slot needs {bytes_per_slot / 2**30:.2f} GiB but the KV budget is {budget_bytes / 2**30:.2f} GiB; "
            "lower --max-context or raise --kv-cache-gb"
        )
    return min(requested, fitting)
