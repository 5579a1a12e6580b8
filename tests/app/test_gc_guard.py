"""Cyclic garbage made on another thread is collected on the GUI thread."""

from __future__ import annotations

import gc
import threading
from typing import Any, ClassVar

from app.gc_guard import GuiThreadCollector


class Cycle:
    freed_on: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        Cycle.freed_on.append(threading.current_thread().name)


def test_cycles_dropped_by_a_worker_thread_are_freed_on_the_gui_thread(qtbot: Any) -> None:
    gui = threading.current_thread().name
    collector = GuiThreadCollector(interval_ms=20)
    collector.start()
    try:
        assert not gc.isenabled()

        kept: list[list[int]] = []

        def worker() -> None:
            for _ in range(50):
                Cycle()  # unreachable at once, but only the cyclic GC can free it
            # allocate (and keep) well past generation 0's threshold, as the core's loop
            # does: Python counts live container allocations, not all of them
            kept.extend([i] for i in range(gc.get_threshold()[0] * 2))

        t = threading.Thread(target=worker, name="core-like")
        t.start()
        t.join()
        qtbot.waitUntil(lambda: len(Cycle.freed_on) >= 50, timeout=5_000)
        assert set(Cycle.freed_on) == {gui}
        kept.clear()
    finally:
        collector.stop()
    assert gc.isenabled()
