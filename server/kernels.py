"""The numba kernels' one loading seam: each compiled once per process, or None where it cannot be.

Every compiled path (server/_*_numba.py) has a plain path beside it, so a missing numba or a compiler
failure costs speed, never service: the caller says what runs instead, in one log line.

Where the kernel has two forms of one computation (on AVX-512: the panel product or the plain one,
the attention tiles or the loops), the first start on a machine times both and keeps one (chosen_form).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import inspect
import json
import logging
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import numpy as np
import torch
from filelock import FileLock

from specedge.registry import default_cache_dir

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


FLUSH_BYTES = 256 * 2**20  # read before each call a timing takes: what it reads leaves a 32 MB L3 (EPYC)
SWITCH = 0.95  # a form other than the default runs only where it took at most this fraction of the default's time
FORMS_FILE = "kernel-forms.json"  # in the cache dir: each form chosen on this machine, by CPU, threads and kernel


def chosen_form(
    subject: str,
    default: str,
    other: str,
    kernel: ModuleType,
    cases: Callable[[], Sequence[Mapping[str, Callable[[], object]]]],
    repeats: int = 5,
    flush_bytes: int = FLUSH_BYTES,
) -> str:
    """Which of two forms of one computation this process runs: `default` (the one timed faster where it was
    timed) unless `other` took at most SWITCH its time, summed over `cases()` (timed_ms, with `repeats` and
    `flush_bytes`). Timed once per machine: the choice is remembered in the cache dir's FORMS_FILE for this CPU,
    thread count and `kernel`'s source (edited, it is timed again), so that later starts cost nothing and run the
    same form, with the same rounding; a tensor-parallel rank waits while the other times, then reads. Where the
    cache dir cannot be written, every start times. One log line says what runs and why."""
    path = default_cache_dir() / FORMS_FILE
    kernel_key = hashlib.sha256(pathlib.Path(inspect.getfile(kernel)).read_bytes()).hexdigest()[:16]
    key = f"{subject} | {cpu_name()} | {torch.get_num_threads()} threads"

    def timed() -> dict:
        total = timed_ms(cases(), repeats, flush_bytes)
        ratio = total[other] / total[default]
        chosen = other if ratio <= SWITCH else default
        return {"chosen": chosen, "default": default, "ratio": round(ratio, 3), "kernel": kernel_key}

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock"):
            remembered = _remembered(path, kernel_key)
            entry = remembered.get(key)
            if entry is not None and entry.get("chosen") in (default, other):
                when = f"timed on {entry['timed']} with this kernel, CPU and thread count; delete {path} to time again"
            else:
                entry = remembered[key] = timed() | {"timed": datetime.date.today().isoformat()}
                try:
                    path.write_text(json.dumps(remembered, indent=1) + "\n")
                    when = f"timed now, remembered in {path}"
                except OSError as error:
                    when = f"timed now: {error}, so every start times it"
    except OSError as error:  # a cache dir that cannot be made or locked
        entry, when = timed(), f"timed now: {error}, so every start times it"
    log.info(
        "%s: %s (%s took %.2fx the time of %s, %s; the default gives way at %.2fx or less)",
        subject,
        entry["chosen"],
        other,
        entry["ratio"],
        default,
        when,
        SWITCH,
    )
    return str(entry["chosen"])


def _remembered(path: pathlib.Path, kernel: str) -> dict[str, dict]:
    """FORMS_FILE's choices for this kernel file (others are dropped when it is next written); none if absent or
    unreadable."""
    try:
        remembered = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(remembered, dict):
        return {}
    return {
        key: entry for key, entry in remembered.items() if isinstance(entry, dict) and entry.get("kernel") == kernel
    }


def timed_ms(
    cases: Sequence[Mapping[str, Callable[[], object]]], repeats: int = 5, flush_bytes: int = FLUSH_BYTES
) -> dict[str, float]:
    """Each form's time summed over `cases` (each: every form's call by name), medians of `repeats` taken in
    turn, with flush_bytes read before each call, as a forward's products read their weights after others
    flushed the cache."""
    flush = cache_flush(flush_bytes) if flush_bytes else None
    total: dict[str, float] = {}
    for calls in cases:
        for name, times in in_turn_ms(calls, repeats, flush).items():
            total[name] = total.get(name, 0.0) + statistics.median(times)
    return total


def cache_flush(nbytes: int = FLUSH_BYTES) -> Callable[[], object]:
    """A call that reads `nbytes` of its own, so that what a timed call reads next comes from memory."""
    return torch.ones(nbytes // 4).sum


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform says."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
