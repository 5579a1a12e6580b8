"""pytest-qt setup for the GUI tests: offscreen, and Qt warnings fail tests.

``QT_QPA_PLATFORM=offscreen`` is set before anything imports Qt. Every test in
this folder gets pytest-qt's ``qt_log_level_fail("WARNING")`` marker (the ini
option cannot be set here), so a Qt warning during the test fails it. When
pytest-qt's log capture is off (``-s`` or ``--no-qt-log``) a message handler
installed with ``qInstallMessageHandler`` does the same job.
"""

from __future__ import annotations

import gc
import os
import re

os.environ["QT_QPA_PLATFORM"] = "offscreen"

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.main import App, launch
from core import config as config_mod
from core.paths import Paths

HERE = Path(__file__).resolve().parent
# Said by the offscreen platform plugin itself when a window shows or is raised:
# limits of the test platform, not problems of the app.
IGNORED = (
    "This plugin does not support propagateSizeHints",
    r"This plugin does not support raise\(\)",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        if item.get_closest_marker("qt_log_level_fail") is None:
            item.add_marker(pytest.mark.qt_log_level_fail("WARNING"))
        if item.get_closest_marker("qt_log_ignore") is None:
            item.add_marker(pytest.mark.qt_log_ignore(*IGNORED))


@pytest.fixture(autouse=True)
def _own_xdg_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings dialog reads (and may write) the login entry under XDG_CONFIG_HOME:
    never the real one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


@pytest.fixture(autouse=True)
def _collect_garbage_on_the_gui_thread(qapp: Any) -> Iterator[None]:
    """Free a test's Qt objects here, between tests, on the GUI thread.

    Left to chance, Python's cyclic GC may run on the core thread and delete a
    QObject (or widget) there, which crashes Qt.
    """
    yield
    from app.qt import QtCore

    gc.collect()
    for _ in range(2):
        QtCore.QCoreApplication.sendPostedEvents(None, QtCore.QEvent.Type.DeferredDelete.value)
        qapp.processEvents()


@pytest.fixture(autouse=True)
def _fail_on_qt_warnings(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fallback when pytest-qt does not capture Qt messages."""
    if request.config.pluginmanager.get_plugin("_qt_logging") is not None:
        yield
        return
    from app.qt import QtCore

    seen: list[str] = []
    levels = (
        QtCore.QtMsgType.QtWarningMsg,
        QtCore.QtMsgType.QtCriticalMsg,
        QtCore.QtMsgType.QtFatalMsg,
    )

    def handler(kind: Any, _context: Any, message: str) -> None:
        if kind in levels and not any(re.search(s, message) for s in IGNORED):
            seen.append(f"{kind.name}: {message}")

    previous = QtCore.qInstallMessageHandler(handler)
    try:
        yield
    finally:
        QtCore.qInstallMessageHandler(previous)
    if seen:
        pytest.fail("Qt warnings during the test:\n" + "\n".join(seen))


# ---------------------------------------------------------------- known telemetry
NOW = 1_700_000_000.0  # a fixed "now" for every offline view


def known_events() -> list[Any]:
    """A small history whose every number the tests can check on screen."""
    from core.events import (
        CacheEvent,
        PressureSample,
        RequestCompleted,
        ServerExited,
        ServerLaunched,
        ServerStateChanged,
    )

    def req(ago: float, client: str, cache_n: int, prompt_n: int, ttfb: float) -> Any:
        return RequestCompleted(
            request_id=f"r{ago}",
            client=client,
            session=f"{client}-s",
            endpoint="chat",
            stream=True,
            has_tools=True,
            status=200,
            slot=0,
            prompt_n=prompt_n,
            cache_n=cache_n,
            prompt_ms=prompt_n * 0.5,
            predicted_n=10,
            ttfb_ms=ttfb,
            total_ms=ttfb + 500,
            ts=NOW - ago,
        )

    out: list[Any] = [
        req(50 * 60 + 5, "opencode", 900, 100, 120.0),
        req(50 * 60 - 20, "opencode", 0, 1000, 900.0),
        req(30 * 60, "aider", 500, 500, 300.0),
        req(10 * 60, "curl", 0, 200, 400.0),
        req(5 * 60, "opencode", 1800, 200, 110.0),
        req(3 * 3600, "opencode", 4000, 100, 95.0),
        req(20 * 3600, "aider", 100, 900, 700.0),
        req(3 * 86400, "opencode", 7000, 300, 130.0),
        req(12 * 86400, "curl", 0, 50, 260.0),
    ]
    gib = 2**30
    for i in range(60):
        level = "low" if 20 <= i < 26 else ("critical" if 26 <= i < 28 else "nominal")
        out.append(
            PressureSample(
                level=level,
                ram_available_pct=40.0 - i * 0.5,
                swap_used_pct=2.0 + i * 0.1,
                server_rss_bytes=(20 + i % 3) * gib,
                disk_free_pct=50.0,
                gpus=((0, 24 * gib, (6 + i % 4) * gib),),
                ts=NOW - 3600 + i * 60,
            )
        )
    out += [
        ServerStateChanged(state="starting", previous="stopped", reason="user", ts=NOW - 7200),
        ServerLaunched(
            run_id="run1",
            pid=111,
            port=4000,
            argv=("llama-server", "-m", "m.gguf"),
            binary="llama-server",
            binary_version="b1",
            model="m.gguf",
            ts=NOW - 7199,
        ),
        ServerStateChanged(state="ready", previous="starting", reason="healthy", ts=NOW - 7190),
        ServerExited(
            run_id="run1",
            pid=111,
            returncode=-11,
            signal=11,
            outcome="crashed",
            requested_by="",
            ts=NOW - 4000,
        ),
        ServerLaunched(
            run_id="run2",
            pid=222,
            port=4001,
            argv=("llama-server", "-m", "m.gguf"),
            binary="llama-server",
            binary_version="b1",
            model="m.gguf",
            ts=NOW - 3990,
        ),
        CacheEvent(kind="save", reason="saved the 900-token prefix", tokens=900, ts=NOW - 2900),
        CacheEvent(
            kind="divergence",
            reason="reused 0 tokens; expected ≥ 899",
            slot=0,
            tokens=0,
            details={"client": "opencode"},
            ts=NOW - 2990,
        ),
        CacheEvent(kind="evicted", reason="disk cap reached", bytes=123456, ts=NOW - 600),
        CacheEvent(
            kind="divergence",
            reason="reused 500 tokens; expected ≥ 990",
            slot=1,
            tokens=500,
            details={"client": "aider"},
            ts=NOW - 1700,
        ),
    ]
    return out


@pytest.fixture
def known_db(tmp_path: Path) -> Path:
    from core.telemetry import Telemetry

    path = tmp_path / "telemetry.sqlite3"
    tel = Telemetry(path, clock=lambda: NOW)
    for ev in known_events():
        tel.record(ev)
    tel.close()
    return path


@pytest.fixture
def expected(known_db: Path) -> Iterator[Any]:
    """A Telemetry on the known database, to compute what the screen must show."""
    from core.telemetry import Telemetry

    tel = Telemetry(known_db, clock=lambda: NOW)
    yield tel
    tel.close()


@pytest.fixture
def offline(qtbot: Any, known_db: Path) -> Iterator[Any]:
    """A ViewContext over the known database (no core, no server)."""
    from app.backend import TelemetryBackend
    from app.bridge import Bridge
    from app.dashboard import ViewContext
    from app.tasks import Tasks
    from tests.fixtures import demo_data as demo

    calls: list[tuple[str, tuple[Any, ...]]] = []
    commands = {
        name: (lambda *a, n=name: calls.append((n, a))) for name in ("pin", "evict", "rewarm")
    }
    backend = TelemetryBackend(
        known_db, snapshot=demo.status(NOW), clock=lambda: NOW, commands=commands
    )
    tasks = Tasks()
    ctx = ViewContext(backend=backend, tasks=tasks, bridge=Bridge(), clock=lambda: NOW)
    ctx.calls = calls  # type: ignore[attr-defined]
    yield ctx
    backend.close()
    tasks.shutdown()
    tasks.deleteLater()
    ctx.bridge.deleteLater()


# ---------------------------------------------------------------- launching the app
Launch = Callable[..., App]


def prepare(home: Path, **values: Any) -> Paths:
    """A dev dir whose settings use an ephemeral proxy port (plus `values`)."""
    paths = Paths.under(home)
    paths.ensure()
    config_mod.set_value(paths.config_file, "proxy.port", 0)
    for name, value in values.items():
        config_mod.set_value(paths.config_file, name, value)
    return paths


@pytest.fixture
def start_app(qtbot: Any) -> Iterator[Launch]:
    """``start_app(home, **launch_kwargs)`` → a launched App; quit and joined at teardown."""
    apps: list[App] = []

    def factory(home: Path, **kw: Any) -> App:
        app = launch(["--dev-dir", str(home)], exit_loop=lambda: None, **kw)
        assert app is not None, "another instance holds the socket"
        apps.append(app)
        return app

    yield factory
    for app in apps:
        if not app.finished:
            app.quit()
            qtbot.waitUntil(lambda a=app: a.finished, timeout=60_000)
        app.dispose()


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Any]:
    """A running core without llama-server, its settings read from its settings file
    (the tray's way): changes go through it to the file."""
    from core.engine import Core

    c = Core(prepare(tmp_path / "home"))
    c.start(start_server=False)
    yield c
    c.stop()


@pytest.fixture
def tasks() -> Iterator[Any]:
    """The GUI's worker pool, shut down after the test."""
    from app.tasks import Tasks

    t = Tasks()
    yield t
    t.shutdown()
    t.deleteLater()
