"""Python's cyclic garbage collector, run on the GUI thread only; and a check that the
Qt binding keeps Python's reference counts.

Automatic collection runs in whichever thread happens to allocate when a threshold
is crossed — often the core's asyncio thread, which allocates the most. A Qt object
caught in a reference cycle would then be deleted on that thread, which Qt does not
allow (the tests' conftest collects between tests for the same reason). So the tray
switches automatic collection off and collects from a GUI-thread timer instead, by
the same thresholds.

The "Fatal Python error: bool_dealloc" (and ``none_dealloc``) seen on quitting came
from elsewhere: PySide6 6.12.0 on CPython 3.11 releases a reference to None on every
call of a method that returns nothing, and one to True on every ``Signal.emit()``.
On 3.12 and later None and True are immortal and the stray releases are harmless; on
3.11 their counts run down until one reaches zero — usually while the collector or
the interpreter's exit frees the last real owners. `reference_leaks` measures it, the
tray warns at start when the installed binding does it, and the ``gui`` extra keeps
Python 3.11 on PySide6 6.11, which does not (docs/gui.md#quitting-and-relaunching).
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable

from app.qt import PYSIDE_VERSION, QObject, QTimer, Signal

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


class _Probe(QObject):
    ping = Signal()


def reference_leaks(calls: int = 50) -> str:
    """What the Qt binding releases without owning it, in words ("" when nothing).

    Calls a method that returns nothing and emits a signal `calls` times each and
    compares the reference counts of None and True before and after; what the binding
    took is given back afterwards, so the check itself costs nothing."""
    probe = _Probe()
    probe.ping.connect(_ignore)
    counted: list[tuple[str, object, int]] = []
    steps: list[tuple[str, object, Callable[[], object]]] = [
        ("None per call of a method that returns nothing", None, lambda: probe.setObjectName("p")),
        ("True per Signal.emit()", True, probe.ping.emit),
    ]
    for what, obj, action in steps:
        before = sys.getrefcount(obj)
        for _ in range(calls):
            action()
        lost = before - sys.getrefcount(obj)
        for _ in range(max(0, lost)):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        counted.append((what, obj, lost))
    probe.deleteLater()
    leaks = [what for what, _obj, lost in counted if lost >= calls // 2]
    if not leaks:
        return ""
    return (
        f"PySide6 {PYSIDE_VERSION} on Python {sys.version_info.major}."
        f"{sys.version_info.minor} releases a reference to " + " and to ".join(leaks) + "; "
        "the tray dies once a count reaches zero (bool_dealloc). Install PySide6 6.11: "
        "pip install 'PySide6-Essentials<6.12' 'PySide6-Addons<6.12'"
    )


def _ignore() -> None:
    return None
