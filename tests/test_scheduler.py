"""The pure-Python scheduler: slots and the token-budget batcher (milliseconds, no torch)."""

import pytest

from specedge.scheduler import Batcher, BatcherConfig, NoFreeSlot, SlotAllocator, WorkItem


def test_slots_are_handed_out_and_given_back():
    slots = SlotAllocator(2)
    first, second = slots.acquire(), slots.acquire()
    assert {first, second} == {0, 1}
    with pytest.raises(NoFreeSlot, match="all 2 session slots are in use"):
        slots.acquire()
    slots.release(first)
    assert slots.acquire() == first
    with pytest.raises(ValueError):
        slots.release(7)


def test_double_release_is_refused():
    slots = SlotAllocator(1)
    slot = slots.acquire()
    slots.release(slot)
    with pytest.raises(ValueError, match="not in use"):
        slots.release(slot)


def test_batches_take_queued_work_in_order_within_the_token_budget():
    batcher = Batcher(BatcherConfig(max_batch_tokens=10, max_batch_rows=3))
    for name, tokens in [("a", 4), ("b", 5), ("c", 2), ("d", 1), ("e", 1)]:
        batcher.submit(WorkItem(tokens, name))
    assert [item.payload for item in batcher.take_batch()] == ["a", "b"]  # c would exceed 10 tokens
    assert [item.payload for item in batcher.take_batch()] == ["c", "d", "e"]  # row budget: 3
    assert batcher.take_batch() == []


def test_an_item_larger_than_the_budget_still_runs_alone():
    batcher = Batcher(BatcherConfig(max_batch_tokens=8))
    batcher.submit(WorkItem(100, "prefill"))
    batcher.submit(WorkItem(1, "decode"))
    assert [item.payload for item in batcher.take_batch()] == ["prefill"]
    assert [item.payload for item in batcher.take_batch()] == ["decode"]
