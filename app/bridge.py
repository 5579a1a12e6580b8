"""Core events → Qt signals on the GUI thread.

The core calls subscribers on its own thread; `Bridge` re-emits every event as
a Qt signal of the matching type. Because the Bridge lives on the GUI thread,
those signals are queued and their slots run on the GUI thread. The Bridge also
remembers what a view opened later needs to catch up: the tail of llama-server's
log, the last pressure sample and the state of a running build.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from app.qt import QObject, Signal
from core.events import (
    BuildProgress,
    CacheEvent,
    Event,
    LogLine,
    Notice,
    PressureChanged,
    PressureSample,
    RequestCompleted,
    ServerExited,
    ServerLaunched,
    ServerStateChanged,
)

LOG_TAIL = 2000


class Bridge(QObject):
    """Subscribes to a core's events and re-emits them as signals (GUI thread)."""

    anyEvent = Signal(object)  # every event (not `event`: that is QObject's event handler)
    serverState = Signal(object)  # ServerStateChanged
    serverLaunched = Signal(object)  # ServerLaunched
    serverExited = Signal(object)  # ServerExited
    request = Signal(object)  # RequestCompleted
    cache = Signal(object)  # CacheEvent
    pressure = Signal(object)  # PressureSample or PressureChanged
    build = Signal(object)  # BuildProgress
    log = Signal(object)  # LogLine
    notice = Signal(object)  # Notice

    def __init__(self, core: Any | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._lock = threading.Lock()
        self.log_tail: deque[LogLine] = deque(maxlen=LOG_TAIL)
        self.last_pressure: PressureSample | None = None
        self.pressure_level = ""  # nominal / low / critical; "" until the first sample
        self.build_state: BuildProgress | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._routes: tuple[tuple[type[Event], Any], ...] = (
            (ServerStateChanged, self.serverState),
            (ServerLaunched, self.serverLaunched),
            (ServerExited, self.serverExited),
            (RequestCompleted, self.request),
            (CacheEvent, self.cache),
            (PressureSample, self.pressure),
            (PressureChanged, self.pressure),
            (BuildProgress, self.build),
            (LogLine, self.log),
            (Notice, self.notice),
        )
        if core is not None:
            self.attach(core)

    def attach(self, core: Any) -> None:
        """Subscribe to `core` (replacing an earlier subscription)."""
        self.detach()
        self._unsubscribe = core.subscribe(self.deliver)

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def deliver(self, ev: Event) -> None:
        """Called on the core thread (or directly by tests and scripts)."""
        with self._lock:
            if isinstance(ev, LogLine):
                self.log_tail.append(ev)
            elif isinstance(ev, PressureSample):
                self.last_pressure = ev
                self.pressure_level = ev.level
            elif isinstance(ev, PressureChanged):
                self.pressure_level = ev.level
            elif isinstance(ev, BuildProgress):
                self.build_state = ev
        try:
            for typ, signal in self._routes:
                if isinstance(ev, typ):
                    signal.emit(ev)
                    break
            self.anyEvent.emit(ev)
        except RuntimeError:  # the Bridge was deleted while the core still ran
            pass

    def log_lines(self) -> list[LogLine]:
        with self._lock:
            return list(self.log_tail)
