"""The app's entry point: no-tray fallback, single instance, quitting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.qt import QtWidgets
from app.single import OPEN_DASHBOARD, SingleInstance, server_name
from app.state import TrayState
from tests.app.conftest import IGNORED, Launch, prepare
from tests.helpers import REPO


def test_without_a_system_tray_the_dashboard_opens(
    qtbot: Any, tmp_path: Path, start_app: Launch
) -> None:
    prepare(tmp_path)
    assert not QtWidgets.QSystemTrayIcon.isSystemTrayAvailable()  # offscreen has none
    app = start_app(tmp_path)
    assert app.tray is None
    assert app.dashboard is not None and app.dashboard.isVisible()
    # The core (proxy, telemetry) starts in the background; llama-server does not.
    qtbot.waitUntil(lambda: app.core.running and app.controller.status is not None, timeout=30_000)
    assert app.controller.state.tray is TrayState.STOPPED
    assert app.controller.state.proxy_url.startswith("http://127.0.0.1:")
    overview = app.dashboard.page("overview")
    assert overview.start_button.isEnabled()
    # Closing the window quits the app (there is no tray to keep it alive).
    app.dashboard.close()
    qtbot.waitUntil(lambda: app.finished, timeout=60_000)
    assert not app.core.running


def test_quit_stops_the_core_without_blocking(
    qtbot: Any, tmp_path: Path, start_app: Launch
) -> None:
    prepare(tmp_path)
    app = start_app(tmp_path, tray_available=False)
    qtbot.waitUntil(lambda: app.core.running, timeout=30_000)
    app.handlers["quit"]()
    assert not app.finished  # the core stops on a worker thread
    qtbot.waitUntil(lambda: app.finished, timeout=60_000)
    assert not app.core.running
    assert not app.paths.runtime_file.exists()


def test_invalid_settings_file_is_reported_not_fatal(
    qtbot: Any, tmp_path: Path, start_app: Launch
) -> None:
    paths = prepare(tmp_path)
    paths.config_file.write_text("[server]\nslots = -1\n")
    app = start_app(tmp_path, tray_available=False)
    assert app.controller.state.tray is TrayState.ERROR
    assert "server.slots" in app.controller.state.detail
    assert not app.core.running


def test_single_instance_in_process(qtbot: Any, tmp_path: Path) -> None:
    name = server_name(tmp_path / "config")
    first = SingleInstance(name)
    assert first.claim()
    try:
        second = SingleInstance(name)
        with qtbot.waitSignal(first.messageReceived, timeout=5000) as got:
            assert not second.claim()
        assert got.args == [OPEN_DASHBOARD]
        assert second.server is None
    finally:
        first.release()
    # Once the first is gone, the next launch becomes the instance.
    third = SingleInstance(name)
    assert third.claim()
    third.release()


def test_second_launch_opens_the_first_ones_dashboard(
    qtbot: Any, tmp_path: Path, start_app: Launch
) -> None:
    prepare(tmp_path)
    app = start_app(tmp_path, tray_available=False)
    assert app.dashboard is not None
    app.dashboard.hide()  # as if it were closed to the tray
    opened: list[str] = []
    app.single.messageReceived.connect(opened.append)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "--dev-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        qtbot.waitUntil(lambda: proc.poll() is not None and bool(opened), timeout=60_000)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == 0, out
    assert opened == [OPEN_DASHBOARD]
    assert app.dashboard is not None and app.dashboard.isVisible()


@pytest.mark.qt_log_ignore(*IGNORED, "systemTrayWindowChanged")  # offscreen has no tray
def test_tray_icon_menu_and_tooltip_follow_the_state(
    qtbot: Any, tmp_path: Path, start_app: Launch
) -> None:
    prepare(tmp_path, **{"server.model": str(tmp_path / "missing.gguf")})
    app = start_app(tmp_path, tray_available=True)
    tray = app.tray
    assert tray is not None and app.dashboard is None  # a tray app starts hidden
    qtbot.waitUntil(lambda: app.controller.status is not None, timeout=30_000)
    assert tray.icon.toolTip().startswith("Warmslot — Stopped")
    assert tray.actions["start"].isEnabled() and not tray.actions["stop"].isEnabled()
    # One click with a model that does not exist: the tray says why.
    tray.actions["start"].trigger()
    qtbot.waitUntil(lambda: app.controller.state.tray is TrayState.ERROR, timeout=60_000)
    assert "missing.gguf" in tray.icon.toolTip()
    assert tray.actions["start"].isEnabled()
    assert tray.icon.icon().cacheKey() != 0
    tray.actions["dashboard"].trigger()
    assert app.dashboard is not None and app.dashboard.isVisible()


def test_missing_x11_libraries_are_named_before_qt_aborts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qt aborts on a missing xcb library naming the wrong one: the tray checks first."""
    import app.main
    import core.machine.syslibs

    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    missing = core.machine.syslibs.TrayLibraries(
        checked=True,
        missing=("libxcb-icccm.so.4",),
        hint="Install them: sudo apt install libxcb-icccm4",
    )
    monkeypatch.setattr(core.machine.syslibs, "check_tray_libraries", lambda: missing)
    assert app.main.main([]) == 2
    err = capsys.readouterr().err
    assert "libxcb-icccm.so.4" in err and "sudo apt install libxcb-icccm4" in err
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")  # Qt would not use the X11 plugin
    assert app.main.missing_xcb_libraries() == ""


def test_logs_without_a_file_manager_and_the_build_button_during_a_build(
    qtbot: Any, tmp_path: Path, start_app: Launch, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.qt import QtGui
    from core.events import BuildProgress

    prepare(tmp_path)
    app = start_app(tmp_path, tray_available=False)
    qtbot.waitUntil(lambda: app.core.running, timeout=30_000)
    # No file manager (a bare X session): the log folder's path is shown, and copyable.
    monkeypatch.setattr(QtGui.QDesktopServices, "openUrl", lambda url: False)
    assert app.open_logs() is False
    box = app.logs_box
    assert box is not None and str(app.paths.log_dir) in box.text()
    copy = next(b for b in box.buttons() if b.text() == "Copy")
    copy.click()
    assert QtWidgets.QApplication.clipboard().text() == str(app.paths.log_dir)
    assert box.isVisible()  # copying does not close it
    box.close()
    # One build at a time: the button is off while a build runs, back on after it.
    assert app.dashboard is not None
    server = app.dashboard.page("server")
    assert server.build_button.isEnabled()
    running = BuildProgress(build_id="b", percent=10.0, step="compiling", purpose="test")
    app.bridge.deliver(running)
    qtbot.waitUntil(lambda: not server.build_button.isEnabled(), timeout=5_000)
    app.bridge.deliver(BuildProgress(build_id="b", percent=100.0, step="built", done=True, ok=True))
    qtbot.waitUntil(server.build_button.isEnabled, timeout=5_000)
