"""The numba kernels' one loading seam: each compiled once per process, or None where it cannot be.

Every compiled path (server/_*_numba.py) has a plain path beside it, so a missing numba or a compiler
failure costs speed, never service: the caller says what runs instead, in one log line.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import numpy as np
import torch

log = logging.getLogger(__name__)


def load_kernel(name: str, instead: str, warm_up: str = "warm_up") -> ModuleType | None:
    """specedge.server.<name> imported and its `warm_up` run (the kernels it calls compiled, or loaded from
    numba's cache), or None. A caller names the warm-up of just the kernels it runs, so that one kernel's
    compiler failure does not take the others' speed with it."""
    try:
        module = importlib.import_module(f"specedge.server.{name}")
    except ImportError as error:
        log.warning("numba unavailable (%s): %s", error, instead)
        return None
    try:
        getattr(module, warm_up)()
    except Exception as error:  # noqa: BLE001 - any compiler failure means: the plain path
        log.warning("numba could not compile %s.%s (%s): %s", name, warm_up, error, instead)
        return None
    return module


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the kernels read it, in place: float32 as itself, bfloat16 as its int16 bits
    (numpy has no bfloat16; the kernels widen the bits as they load them)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()
