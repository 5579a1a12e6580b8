"""The GUI's controller: one-click start, stop, status, notifications.

It owns no core state: it sends commands (futures, delivered back by `Tasks`),
listens to the `Bridge`, and keeps an `AppState` derived from the latest
``Core.status()`` for the tray and the dashboard. Starting or stopping the core
thread itself blocks for a moment, so that runs on a worker thread too.

One click, "Start model + cache": start the core (proxy) if needed → the core
finds the binary and model and launches llama-server (building it first when no
binary is found and the core can build) → the cache manager restores (verified)
or prewarms the most recent prefixes → warm. Each step moves the progress shown
in the tray tooltip, its menu and the Overview tab.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from app.backend import Backend
from app.bridge import Bridge
from app.qt import QObject, QTimer, Signal
from app.state import AppState, TrayState, derive_state
from app.tasks import Tasks, gather
from core.config import SettingsUpdate
from core.errors import BinaryNotFound, WarmslotError
from core.events import (
    BuildProgress,
    CacheEvent,
    CacheEventKind,
    Notice,
    ServerExited,
    ServerStateChanged,
)
from core.server.logparse import crash_cause
from core.status import Status, Totals, cache_of

log = logging.getLogger("warmslot.gui")

STATUS_POLL_MS = 3000
STATUS_SOON_MS = 150
CACHE_ALERTS = {
    CacheEventKind.INVALIDATED: "Saved cache invalidated",
    CacheEventKind.RESTORE_REJECTED: "Cache state rejected",
    CacheEventKind.UNDELETABLE: "Cache file cannot be deleted",
}
WARMING_KINDS = (
    CacheEventKind.RESTORE_OK,
    CacheEventKind.RESTORE_REJECTED,
    CacheEventKind.PREWARM_HIT,
    CacheEventKind.PREWARM_COLD,
)


# How the tray says that the settings file kept the core from starting (app/main.py).
SETTINGS_INVALID = "Settings file is invalid"
# What a signal that ended llama-server means, for the crash notification.
SIGNAL_WORDS = {
    signal.SIGKILL: "was killed (SIGKILL): by the system when memory ran out, or by "
    "another program",
    signal.SIGSEGV: "crashed (a segmentation fault in llama-server)",
    signal.SIGABRT: "stopped itself on an internal error (SIGABRT)",
    signal.SIGBUS: "crashed (a bus error: a file it had mapped, such as the model, "
    "changed or went away)",
    signal.SIGILL: "crashed on an instruction this CPU does not have (SIGILL)",
    signal.SIGFPE: "crashed on an arithmetic error (SIGFPE)",
    signal.SIGTERM: "was stopped by another program (SIGTERM)",
}


def error_text(exc: BaseException) -> str:
    return exc.user_message() if isinstance(exc, WarmslotError) else f"{type(exc).__name__}: {exc}"


def crash_text(ev: ServerExited) -> str:
    """The crash notification's text, in words (the log keeps llama-server's own lines)."""
    if ev.signal:
        try:
            what = SIGNAL_WORDS.get(signal.Signals(ev.signal), "")
        except ValueError:
            what = ""
        what = what or f"was ended by signal {ev.signal}"
    else:
        what = f"exited with code {ev.returncode}"
    cause = crash_cause(list(ev.last_lines))
    because = f"; its output says: {cause}" if cause else ""
    return (
        f"llama-server {what}{because}. Warmslot starts it again and brings the warm "
        "prefixes back; Open logs has llama-server's own lines."
    )


class Controller(QObject):
    """Commands and derived state for the tray and the dashboard."""

    stateChanged = Signal(object)  # AppState
    statusChanged = Signal(object)  # the latest Core.status() (core.status.Status)
    notify = Signal(str, str, str)  # title, text, level (info/warning/error)
    dashboardRequested = Signal()
    settingsRequested = Signal()

    def __init__(
        self,
        core: Any,
        backend: Backend,
        bridge: Bridge,
        tasks: Tasks,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.core = core
        self.backend = backend
        self.bridge = bridge
        self.tasks = tasks
        self.status: Status | None = None
        self.core_error = ""
        self.state = AppState()
        self._progress: tuple[float, str] | None = None
        self._start_after_build = False
        self._status_inflight = False
        self._status_again = False
        self._status_started = 0.0
        self._closing = False
        self._warm_seen = 0
        self._core_waiters: list[Callable[[], None]] | None = None
        self._poll = QTimer(self)
        self._poll.setInterval(STATUS_POLL_MS)
        self._poll.timeout.connect(self.refresh_status)
        self._soon = QTimer(self)
        self._soon.setSingleShot(True)
        self._soon.setInterval(STATUS_SOON_MS)
        self._soon.timeout.connect(self.refresh_status)
        bridge.serverState.connect(self._on_server_state)
        bridge.serverLaunched.connect(lambda _ev: self._step(35, "Loading the model"))
        bridge.serverExited.connect(self._on_exit)
        bridge.cache.connect(self._on_cache)
        bridge.build.connect(self._on_build)
        bridge.notice.connect(self._on_notice)
        bridge.pressure.connect(lambda _ev: self._recompute())

    # ------------------------------------------------------------ state
    @property
    def starting(self) -> bool:
        return self._progress is not None

    def _recompute(self) -> None:
        pressure = self.bridge.pressure_level or _status_pressure(self.status)
        build = self.bridge.build_state
        state = derive_state(
            self.status if self.core.running else None,
            core_running=bool(self.core.running),
            core_error=self.core_error,
            pressure=pressure,
            build=build,
            configured_model=self.backend.settings.server.model,
            progress=self._progress,
            can_cancel_build=self.backend.supports("cancel_build"),
        )
        if self._progress is not None and state.tray is TrayState.STOPPED:
            state = _with(state, tray=TrayState.STARTING)  # our start is under way
        if self._progress is not None and state.tray in (
            TrayState.WARM,
            TrayState.COLD,
            TrayState.DEGRADED,
        ):
            if state.tray is TrayState.COLD and "identity" in state.detail:
                # still learning the server identity right after ready: keep going
                state = _with(state, tray=TrayState.STARTING)
            else:
                self._finish_start(state)
                state = _with(state, progress=None)
        if state != self.state:
            self.state = state
            self.stateChanged.emit(state)

    def _finish_start(self, state: AppState) -> None:
        self._progress = None
        url = state.proxy_url
        self.notify.emit(
            "Model ready",
            f"{state.label}. Point your client at {url}/v1" if url else state.label,
            "info",
        )

    def _step(self, percent: float, text: str) -> None:
        if self._progress is None:
            return
        self._progress = (max(percent, self._progress[0]), text)
        self._recompute()

    def schedule_status(self) -> None:
        if not self._closing:
            self._soon.start()

    def refresh_status(self) -> None:
        """Ask the core for its state and the last hour's numbers (one request at a time)."""
        if self._closing:
            return
        if not self.core.running:
            self.status = None
            self._recompute()
            return
        if self._status_inflight:
            self._status_again = True
            return
        self._status_inflight = True
        self._status_started = time.monotonic()
        fut = gather(
            {
                "status": self.backend.server_status(),
                "hour": self.backend.query("totals", since=time.time() - 3600),
            }
        )
        self.tasks.watch(fut, self._got_status, owner=self)

    def _got_status(self, got: dict[str, Any]) -> None:
        self._status_inflight = False
        # Poll gently when the core is slow to answer (a huge history, a busy disk).
        took_ms = (time.monotonic() - self._status_started) * 1000
        self._poll.setInterval(int(max(STATUS_POLL_MS, 5 * took_ms)))
        st: Status | BaseException = got["status"]
        hour: Totals | BaseException = got["hour"]
        if isinstance(st, BaseException):
            log.debug("status failed: %r", st)
        else:
            # server_status() has no history; the last hour's totals come from their query.
            self.status = {**st, "last_hour": None if isinstance(hour, BaseException) else hour}
            self.statusChanged.emit(self.status)
        self._recompute()
        if self._status_again:
            self._status_again = False
            self.refresh_status()

    # ------------------------------------------------------------ core lifecycle
    def start_core(self, then: Callable[[], None] | None = None) -> None:
        """Start the core thread and proxy (on a worker thread); then call `then`."""
        if self.core.running:
            if then is not None:
                then()
            return
        if self._core_waiters is not None:  # already starting: run `then` after it
            if then is not None:
                self._core_waiters.append(then)
            return
        self._core_waiters = [then] if then is not None else []

        def ok(_: Any) -> None:
            waiters, self._core_waiters = self._core_waiters or [], None
            self.core_error = ""
            self._poll.start()
            self.refresh_status()
            for fn in waiters:
                fn()

        def failed(exc: BaseException) -> None:
            self._core_waiters = None
            self.core_error = error_text(exc)
            self._progress = None
            self._recompute()
            self.notify.emit("Warmslot could not start", self.core_error, "error")

        self.core_error = ""
        self.tasks.run(lambda: self.core.start(start_server=False), ok, failed, owner=self)

    def start_all(self) -> None:
        """One click: proxy → find/build server → launch → restore or prewarm → warm."""
        if self.state.running or self.state.tray is TrayState.BUILDING:
            return
        if self.core_error.startswith(SETTINGS_INVALID):  # never on the stand-in defaults
            self.settings_closed(then=self.start_all)
            return
        self._progress = (3.0, "Starting the proxy")
        self._warm_seen = 0
        self._recompute()
        self.start_core(then=self._start_server)

    def _start_server(self) -> None:
        self._step(10, "Finding llama-server and the model")
        self.tasks.watch(
            self.backend.command("start_server"),
            lambda _r: self._step(80, "Restoring or prewarming saved prefixes"),
            self._start_failed,
            owner=self,
        )

    def _start_failed(self, exc: BaseException) -> None:
        if isinstance(exc, BinaryNotFound) and self.backend.supports("build_server"):
            self._start_after_build = True
            self._step(12, "No llama-server found: building one")
            self.build()
            return
        self._progress = None
        if not isinstance(exc, WarmslotError):  # the core already announced its own errors
            self.notify.emit("llama-server did not start", error_text(exc), "error")
        self.refresh_status()

    def stop(self) -> None:
        self._progress = None
        self._start_after_build = False
        self.tasks.watch(
            self.backend.command("stop_server"),
            lambda _r: self.refresh_status(),
            lambda e: self.notify.emit("Stop failed", error_text(e), "error"),
            owner=self,
        )

    def restart(self) -> None:
        self.tasks.watch(
            self.backend.command("restart_server"),
            lambda _r: self.refresh_status(),
            lambda e: self.notify.emit("Restart failed", error_text(e), "error"),
            owner=self,
        )

    def build(self) -> None:
        """Build llama-server from source (needs `Core.build_server`)."""
        if not self.backend.supports("build_server"):
            self.notify.emit(
                "Cannot build here",
                "This core has no build command; run `warmslot build` in a terminal.",
                "warning",
            )
            return
        self.tasks.watch(self.backend.command("build_server"), None, self._build_failed, owner=self)

    def _build_failed(self, exc: BaseException) -> None:
        self._start_after_build = False
        self._progress = None
        self.notify.emit("Build failed", error_text(exc), "error")
        self._recompute()

    def cancel_build(self) -> None:
        self._start_after_build = False
        self.tasks.watch(self.backend.command("cancel_build"), owner=self)

    def shutdown(self, on_done: Callable[[], None]) -> None:
        """Stop polling, stop the core (on a worker thread), then call `on_done`."""
        if self._closing:
            return
        self._closing = True
        self._poll.stop()
        self._soon.stop()

        def stop_core() -> None:
            self.core.stop()

        def done(_: Any = None) -> None:
            self.bridge.detach()
            on_done()

        if self.core.running:
            self.tasks.run(stop_core, done, lambda e: done(), owner=self)
        else:
            done()

    # ------------------------------------------------------------ events
    def _on_server_state(self, ev: ServerStateChanged) -> None:
        if ev.state == "starting":
            self._step(15, "Finding llama-server and the model")
        elif ev.state == "ready":
            self._step(80, "Restoring or prewarming saved prefixes")
        elif ev.state == "failed" and self._progress is not None:
            self._progress = None
        self.schedule_status()

    def _on_exit(self, ev: ServerExited) -> None:
        if ev.outcome == "crashed":
            self.notify.emit("llama-server crashed", crash_text(ev), "error")
        self.schedule_status()

    def settings_closed(self, then: Callable[[], None] | None = None) -> None:
        """After Settings… closed (or a Start while the file is invalid): a core that an
        invalid settings file held back reads the file again — a fix made in a text
        editor counts too — and starts once it is valid, on the file's settings."""
        if not self.core_error.startswith(SETTINGS_INVALID):
            return

        def done(update: SettingsUpdate) -> None:
            if update.applied:
                self.core_error = ""
                self.start_core(then)
                return
            self.core_error = f"{SETTINGS_INVALID}: {update.problems[0].error.user_message()}"
            self._recompute()
            self.notify.emit(SETTINGS_INVALID, update.problems[0].text, "error")

        self.tasks.watch(
            self.backend.update_settings({}),
            done,
            lambda e: self.notify.emit(SETTINGS_INVALID, error_text(e), "error"),
            owner=self,
        )

    def _on_cache(self, ev: CacheEvent) -> None:
        title = CACHE_ALERTS.get(ev.kind)
        if title:
            self.notify.emit(title, ev.reason, "warning")
        if ev.kind in WARMING_KINDS:
            self._warm_seen += 1
            self._step(min(95, 80 + 5 * self._warm_seen), f"Warming prefixes ({self._warm_seen})")
        self.schedule_status()

    def _on_build(self, ev: BuildProgress) -> None:
        if ev.done:
            if ev.ok:
                self.notify.emit("llama-server build finished", ev.step, "info")
                if self._start_after_build:
                    self._start_after_build = False
                    self._start_server()
            else:
                self._start_after_build = False
                self._progress = None
                self.notify.emit("llama-server build failed", ev.step, "error")
        elif self._progress is not None:
            self._progress = (self._progress[0], f"Building llama-server: {ev.step}")
        self._recompute()

    def _on_notice(self, ev: Notice) -> None:
        if ev.level == "error":
            text = f"{ev.text}\n→ {ev.hint}" if ev.hint else ev.text
            self.notify.emit("Warmslot", text, "error")


def _status_pressure(status: Status | None) -> str:
    """The pressure level the cache manager reports in its status, if any."""
    cache = cache_of(status)
    return cache["pressure"]["level"] if cache is not None else ""


def _with(state: AppState, **changes: Any) -> AppState:
    import dataclasses

    return dataclasses.replace(state, **changes)
