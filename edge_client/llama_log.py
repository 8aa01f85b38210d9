"""Send llama.cpp's log lines to Python logging instead of the terminal.

llama-cpp-python (0.3.16, 0.3.36) prints some llama.cpp messages to stderr even with
verbose=False (those logged at level NONE, e.g. the context-size notice of a
vocab-only load), which breaks the edge's contract of one actionable line on
stderr. `llama_log_set` is llama.cpp's own hook for this.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

log = logging.getLogger("llama.cpp")

# ggml_log_level as of the llama.cpp inside llama-cpp-python 0.3.16 and 0.3.36: 0 none,
# 1 debug, 2 info, 3 warn, 4 error, 5 continuation. (llama-cpp-python's own
# callback still maps an older enum, which is why its info lines leak.)
_LEVELS = {2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


@llama_cpp.llama_log_callback
def _to_logging(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    log.log(_LEVELS.get(level, logging.DEBUG), "%s", text.decode("utf-8", "replace").rstrip("\n"))


def route_llama_logs_to_logging() -> None:
    """Idempotent; call before creating a Llama."""
    llama_cpp.llama_log_set(_to_logging, ctypes.c_void_p(0))
