"""Python's cyclic garbage collector, run on the GUI thread only.

Automatic collection runs in whichever thread happens to allocate when a threshold
is crossed — often the core's asyncio thread, which allocates the most. A Qt object
caught in a reference cycle is then deleted on that thread, which Qt does not allow
and which can crash the process (the tests' conftest collects between tests for the
same reason; issue 18 saw "Fatal Python error: bool_dealloc" on quit). So the tray
switches automatic collection off and collects from a GUI-thread timer instead, by
the same thresholds.
"""

from __future__ import annotations

import gc

from app.qt import QObject, QTimer

INTERVAL_MS = 500


class GuiThreadCollector(QObject):
    """While alive (and started), cyclic garbage is collected on this object's thread."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = INTERVAL_MS) -> None:
        super().__init__(parent)
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.check)
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        gc.disable()
        self._timer.start()

    def check(self) -> int:
        """Collect the oldest generation whose threshold was crossed; objects freed."""
        counts, limits = gc.get_count(), gc.get_threshold()
        generation = -1
        for gen in range(3):
            if limits[gen] and counts[gen] > limits[gen]:
                generation = gen
        return gc.collect(generation) if generation >= 0 else 0

    def stop(self) -> None:
        """Collect once more here, then hand collection back to Python."""
        self._timer.stop()
        gc.collect()
        if self._was_enabled:
            gc.enable()
