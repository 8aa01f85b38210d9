"""Python's cyclic garbage collection, run on the GUI thread only while a window is open.

Left automatic, the collector runs in whichever thread happens to allocate past
its threshold: the edge worker's thread, say, importing llama_cpp. Whatever
garbage is pending is then finalized there, and Qt objects must not be deleted
off the GUI thread. CI saw `Fatal Python error: Segmentation fault` under
"Garbage-collecting" in that import, in two runs of three.

So while a window is open, automatic collection is off and a timer on the GUI
thread collects instead, generation by generation, when the collector's own
thresholds say it would have. pyqtgraph's GarbageCollector does the same for
the same reason.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 250


class GuiThreadCollector:
    """Collects on a timer of `parent`'s thread until `close()`. Several may be open at once:
    automatic collection is off from the first one opened until the last one closed."""

    _open = 0
    _was_enabled = True

    def __init__(self, parent: QObject, interval_ms: int = INTERVAL_MS):
        if GuiThreadCollector._open == 0:
            GuiThreadCollector._was_enabled = gc.isenabled()
            gc.disable()
        GuiThreadCollector._open += 1
        self._closed = False
        self._timer = QTimer(parent, interval=interval_ms)
        self._timer.timeout.connect(self.collect_due)
        self._timer.start()

    @staticmethod
    def collect_due() -> int:
        """Collect the oldest generation past its threshold, as automatic collection would; the number found."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        due = [generation for generation in range(3) if counts[generation] > thresholds[generation]]
        return gc.collect(max(due)) if due else 0  # a generation's collection includes the younger ones

    def close(self) -> None:
        """Stop the timer and collect everything pending, here; the last one open restores automatic collection."""
        if self._closed:
            return
        self._closed = True
        self._timer.stop()
        GuiThreadCollector._open -= 1
        gc.collect()
        if GuiThreadCollector._open == 0 and GuiThreadCollector._was_enabled:
            gc.enable()
