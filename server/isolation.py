"""Failure isolation for batched work: a request that makes a batch fail, fails alone.

`run_isolated` runs a batch; when it raises, each half is retried on its own,
down to the single items that fail by themselves, so every other item still
gets its result (from a smaller batch):

    items a b c d, where any batch holding c raises:
    [a b c d] raises -> [a b] ok; [c d] raises -> [c] raises, [d] ok
    results: ra rb exc rd        (k bad items among n cost O(k log n) batches)

Retrying is safe for the target's forward: a row writes its KV only past its
session's committed length, and rewrites the same values when run again.

Rows of a batch never read each other (each attends to its own KV slot), so
logits that are not finite (NaN or inf) are the fault of their row alone: that
row fails, with no retry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from specedge.server import errors

Item = TypeVar("Item")
Result = TypeVar("Result")

RETRY_AFTER_OOM_S = 1.0


class NonFiniteLogits(ArithmeticError):
    pass


def run_isolated(run_batch: Callable[[list[Item]], Sequence[Result]], items: list[Item]) -> list[Result | Exception]:
    """`run_batch(items)`'s results; where it raises, the exception of each item that fails alone."""
    try:
        return list(run_batch(items))
    except Exception as exc:
        if len(items) == 1:
            return [exc]
    half = len(items) // 2  # outside the handler: each failure keeps its own traceback, unchained
    return run_isolated(run_batch, items[:half]) + run_isolated(run_batch, items[half:])


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is the device (or host) running out of memory, whatever raised it."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    # oneDNN and some CPU allocators raise a plain RuntimeError that only says so in words.
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def failure_for_client(exc: BaseException) -> errors.ServiceError:
    """What an edge is told when its request failed inside the engine; its session has been closed."""
    if isinstance(exc, errors.ServiceError):
        return exc
    if is_oom(exc):
        return errors.ResourceExhausted(
            "the server ran out of memory on this request and closed its session; retry later or with a shorter prompt",
            retry_after_s=RETRY_AFTER_OOM_S,
        )
    if isinstance(exc, NonFiniteLogits):
        return errors.Internal(
            "the target model produced non-finite logits (NaN or inf) for this request; its session was closed, "
            "open a new one (the operator's log has details)"
        )
    return errors.Internal(
        f"the server failed on this request ({type(exc).__name__}); its session was closed, open a new one "
        "(the operator's log has details)"
    )
