"""The process heap: hand the pages of freed blocks back to the system while a model loads.

A load frees gigabytes: the checkpoint's originals once copied, packed or cast, the separate projections once
fused. glibc keeps freed blocks under its mmap threshold in the heap, and after the process has freed a large block
that threshold rises to as much as 32 MB, so most of a layer's tensors land there (a bfloat16 layer's all do). A
block freed there still counts in the private RSS until malloc_trim gives its pages back.

On the 1.5B in bfloat16 (2.88 GiB of weights), once the threshold had risen (as a machine's first start, which
times the kernels' forms, leaves it): the private peak while loading 6.46 GiB and 6.13 at its end, before any
trim, against 4.07 and 3.64 with the trims as it goes (docs/engine-cpu.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): whether any went back (False where the C
    library has no malloc_trim)."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
