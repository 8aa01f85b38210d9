"""The numba kernels' one loading seam: each compiled once per process, or None where it cannot be.

Every compiled path (server/_*_numba.py) has a plain path beside it, so a missing numba or a compiler
failure costs speed, never service: the caller says what runs instead, in one log line.

Where the kernel has two forms of one computation (on AVX-512: the panel product or the plain one,
the attention tiles or the loops), a process times both at its start and keeps one (timed_choice).
"""

from __future__ import annotations

import importlib
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import numpy as np
import torch

log = logging.getLogger(__name__)


def load_kernel(name: str, instead: str, warm_up: str = "warm_up", *args: object) -> ModuleType | None:
    """specedge.server.<name> imported and its `warm_up(*args)` run (the kernels it calls compiled, or loaded
    from numba's cache), or None. A caller names the warm-up of just the kernels it runs, so that one kernel's
    compiler failure does not take the others' speed with it."""
    try:
        module = importlib.import_module(f"specedge.server.{name}")
    except ImportError as error:
        log.warning("numba unavailable (%s): %s", error, instead)
        return None
    try:
        getattr(module, warm_up)(*args)
    except Exception as error:  # noqa: BLE001 - any compiler failure means: the plain path
        log.warning("numba could not compile %s.%s (%s): %s", name, warm_up, error, instead)
        return None
    return module


FLUSH_BYTES = 256 * 2**20  # read before each call timed_choice times: what it reads leaves a 32 MB L3 (EPYC)
SWITCH = 0.95  # a form other than the default runs only where it took at most this fraction of the default's time


def timed_choice(
    subject: str,
    default: str,
    other: str,
    cases: Sequence[Mapping[str, Callable[[], object]]],
    repeats: int = 5,
    flush_bytes: int = FLUSH_BYTES,
) -> str:
    """Which of two forms of one computation this process runs: `default` (the one timed faster where it was
    timed) unless `other` took at most SWITCH its time, summed over `cases` (each: the two forms' calls by name,
    medians of `repeats`, taken in turn, with flush_bytes read before each call, as a forward's products read
    their weights after others flushed the cache). Noise within the margin keeps the default; one log line says
    what was chosen and why."""
    flush = torch.ones(flush_bytes // 4).sum if flush_bytes else None
    total = {default: 0.0, other: 0.0}
    for calls in cases:
        for name, times in in_turn_ms(calls, repeats, flush).items():
            total[name] += statistics.median(times)
    ratio = total[other] / total[default]
    chosen = other if ratio <= SWITCH else default
    log.info(
        "%s: %s (%s took %.2fx the time of %s at start; the default, %s, gives way at %.2fx or less)",
        subject,
        chosen,
        other,
        ratio,
        default,
        default,
        SWITCH,
    )
    return chosen


def in_turn_ms(
    calls: Mapping[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None
) -> dict[str, list[float]]:
    """`repeats` timings of each call, the calls taken in turn so that drift hits all alike (one untimed round);
    `before` runs untimed ahead of each call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats + 1):
        for name, call in calls.items():
            if before is not None:
                before()
            start = time.perf_counter()
            call()
            if repeat:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the kernels read it, in place: float32 as itself, bfloat16 as its int16 bits
    (numpy has no bfloat16; the kernels widen the bits as they load them)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()
