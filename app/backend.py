"""What the views need from the core, as futures: status, telemetry queries, commands.

`CoreBackend` wraps a live `core.engine.Core`: every call is submitted to the
core thread and returns a future. `TelemetryBackend` reads a telemetry database
file on its own thread (a sqlite connection belongs to its thread) and answers
``status()`` from a fixed snapshot: the screenshot script, the chart benchmark
and the tests use it to draw real query results without a running server.

Commands go by name (``pin``, ``evict``, ``rewarm``, ``start_server`` …): a live
core has every one of `COMMANDS`; an offline backend has only those it was given,
and `supports(name)` lets a view disable the buttons of the others.

``server_status()`` is what the views poll: the server and cache parts of the
status without the all-time telemetry aggregates (``Core.status()`` computes
totals and per-client numbers over every stored request, about 1.1 s at a
million rows). Both answer a `core.status.Status`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from app.tasks import done_future, failed_future
from core import config as config_mod
from core.config import FileRead, Settings, SettingsUpdate
from core.engine import Core
from core.errors import CoreStopped
from core.status import Status
from core.telemetry import QUERIES, Telemetry

# The Core methods the GUI calls by name (docs/gui.md, "Core API the GUI uses").
CACHE_COMMANDS = ("pin", "evict", "rewarm", "explain")
BUILD_COMMANDS = ("build_server", "cancel_build")
SERVER_COMMANDS = ("start_server", "stop_server", "restart_server")
COMMANDS = frozenset((*CACHE_COMMANDS, *BUILD_COMMANDS, *SERVER_COMMANDS))


class Backend(Protocol):
    """The GUI's view of the core."""

    @property
    def settings(self) -> Settings: ...

    @property
    def running(self) -> bool: ...

    def status(self) -> concurrent.futures.Future[Status]: ...

    def server_status(self) -> concurrent.futures.Future[Status]: ...

    def query(self, name: str, **kwargs: Any) -> concurrent.futures.Future[Any]: ...

    def supports(self, command: str) -> bool: ...

    def command(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]: ...

    def settings_file(self) -> FileRead:
        """The settings file as it is (its values, and what is wrong in it)."""
        ...

    def update_settings(
        self, changes: Mapping[str, object]
    ) -> concurrent.futures.Future[SettingsUpdate]:
        """Write only `changes` and apply the whole file (`Core.update_settings`)."""
        ...


class CoreBackend:
    """A `Backend` over a live Core (commands run on the core thread)."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @property
    def settings(self) -> Settings:
        s: Settings = self.core.settings
        return s

    @property
    def running(self) -> bool:
        return bool(self.core.running)

    def _guard(self, make: Callable[[], concurrent.futures.Future[Any]]) -> Any:
        if not self.core.running:
            return failed_future(CoreStopped("the Warmslot core is not running"))
        try:
            return make()
        except Exception as e:  # CoreStopped raced with shutdown, or an assertion
            return failed_future(e)

    def status(self) -> concurrent.futures.Future[Status]:
        fut: concurrent.futures.Future[Status] = self._guard(self.core.status)
        return fut

    def server_status(self) -> concurrent.futures.Future[Status]:
        """Server and cache state without telemetry aggregates (see the module doc)."""
        fut: concurrent.futures.Future[Status] = self._guard(self.core.server_status)
        return fut

    def query(self, name: str, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = self._guard(lambda: self.core.query(name, **kwargs))
        return fut

    def supports(self, command: str) -> bool:
        return command in COMMANDS

    def command(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if name not in COMMANDS:
            return failed_future(NotImplementedError(f"the GUI does not call Core.{name}()"))
        fn = getattr(self.core, name)
        fut: concurrent.futures.Future[Any] = self._guard(lambda: fn(*args, **kwargs))
        return fut

    def settings_file(self) -> FileRead:
        return config_mod.read_file(self.core.paths.config_file)

    def update_settings(
        self, changes: Mapping[str, object]
    ) -> concurrent.futures.Future[SettingsUpdate]:
        """Through the core, running or not (it writes the file either way)."""
        try:
            fut: concurrent.futures.Future[SettingsUpdate] = self.core.update_settings(changes)
        except Exception as e:
            return failed_future(e)
        return fut


def status_from_telemetry(snapshot: Status, tel: Telemetry, now: float) -> Status:
    """`snapshot` with the telemetry part of `Core.status()` from `tel`."""
    return {
        **snapshot,
        "totals": tel.totals(),
        "last_hour": tel.totals(now - 3600),
        "clients": tel.per_client(),
        "recent_requests": tel.recent_requests(10),
    }


class TelemetryBackend:
    """A `Backend` over a telemetry database file, for offline views and tests.

    Queries run on one private thread that owns the connection. ``status()``
    returns `snapshot` (server and cache parts as `Core.status()` has them)
    merged with the telemetry part computed from the file; without a snapshot both
    status calls fail (a view shows its banner) and only queries answer.
    """

    def __init__(
        self,
        db_path: Path,
        *,
        snapshot: Status | None = None,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.time,
        commands: dict[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.db_path = db_path
        self.snapshot = snapshot
        self._settings = settings or Settings()
        self.clock = clock
        self.commands = dict(commands or {})
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="warmslot-telemetry-reader"
        )
        self._local = threading.local()
        self._closed = False

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def running(self) -> bool:
        return not self._closed

    def _tel(self) -> Telemetry:
        tel: Telemetry | None = getattr(self._local, "tel", None)
        if tel is None:
            tel = Telemetry(self.db_path, clock=self.clock)
            self._local.tel = tel
        return tel

    def status(self) -> concurrent.futures.Future[Status]:
        snapshot = self.snapshot
        if snapshot is None:
            return failed_future(CoreStopped("no status snapshot in this offline view"))
        return self._pool.submit(lambda: status_from_telemetry(snapshot, self._tel(), self.clock()))

    def server_status(self) -> concurrent.futures.Future[Status]:
        if self.snapshot is None:
            return failed_future(CoreStopped("no status snapshot in this offline view"))
        return done_future(self.snapshot)

    def query(self, name: str, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if name not in QUERIES:  # refused at once, as Core.query does
            return failed_future(ValueError(f"unknown query {name!r}"))
        return self._pool.submit(lambda: self._tel().query(name, **kwargs))

    def supports(self, command: str) -> bool:
        return command in self.commands

    def command(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fn = self.commands.get(name)
        if fn is None:
            return failed_future(NotImplementedError(f"no {name}() here"))
        return self._pool.submit(lambda: fn(*args, **kwargs))

    def settings_file(self) -> FileRead:
        """No file here: the settings it was given, as a file without problems."""
        return config_mod.FileRead(
            Path("<offline>"),
            False,
            {name: self._settings.get(name) for name in config_mod.SCHEMA},
            {},
            (),
            self._settings,
            True,
        )

    def update_settings(
        self, changes: Mapping[str, object]
    ) -> concurrent.futures.Future[SettingsUpdate]:
        try:
            new = self._settings.with_changes(changes)
        except Exception as e:
            return failed_future(e)
        update = SettingsUpdate.between(self._settings, new)
        self._settings = new
        return done_future(update)

    def close(self) -> None:
        """Close the reader connection and stop its thread (waits for running queries)."""
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            tel: Telemetry | None = getattr(self._local, "tel", None)
            if tel is not None:
                tel.close()
                self._local.tel = None

        self._pool.submit(shut).result(30)
        self._pool.shutdown(wait=True)
