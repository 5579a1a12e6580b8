"""The single instance knows an instance that is stopping, and Quit shows "Stopping…".

- A launch that finds the instance stopping waits for that process to exit and then
  becomes the instance (it never hands over to an instance that is going away).
- A running instance answers ``ok`` and opens its dashboard.
- After Quit the tray icon stays, says Stopping…, offers nothing, and no action runs
  until the core has stopped; a request under way meanwhile gets its answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from app.qt import QtWidgets
from app.single import OK, OPEN_DASHBOARD, STOPPING, SingleInstance, send, server_name
from tests.app.conftest import IGNORED, Launch, prepare
from tests.helpers import REPO, HeldRequest, chat_body, pid_gone

# An instance in another process: claims the socket, says what it hears, and — told to
# be stopping — exits a moment after it told a launch to wait (as the tray does once
# its core has stopped).
INSTANCE = textwrap.dedent(
    """
    import sys
    from app.qt import QtCore
    from app.single import SingleInstance

    app = QtCore.QCoreApplication([])
    single = SingleInstance(sys.argv[1])
    assert single.claim()
    if sys.argv[2] == "stopping":
        single.set_stopping()

    def waiting():
        print("told a launch to wait", flush=True)
        QtCore.QTimer.singleShot(300, app.quit)

    single.relaunchWaiting.connect(waiting)
    single.messageReceived.connect(lambda m: (print("got", m, flush=True), app.quit()))
    print("listening", flush=True)
    app.exec()
    single.release()
    """
)


def instance(name: str, state: str) -> subprocess.Popen[str]:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", INSTANCE, name, state],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "listening"
    return proc


def test_a_launch_waits_for_a_stopping_instance_then_takes_its_place(
    qtbot: Any, tmp_path: Path
) -> None:
    name = server_name(tmp_path / "config")
    old = instance(name, "stopping")
    try:
        launch = SingleInstance(name)
        assert launch.claim(wait_s=60)  # returns only once the old process has exited
        assert pid_gone(old.pid)
        assert launch.server is not None and launch.server.isListening()
        out = old.communicate(timeout=30)[0]
        assert "told a launch to wait" in out and "got" not in out
        launch.release()
    finally:
        if old.poll() is None:
            old.kill()
            old.wait(30)


def test_a_running_instance_answers_ok_and_gets_the_message(qtbot: Any, tmp_path: Path) -> None:
    name = server_name(tmp_path / "config")
    running = instance(name, "running")
    try:
        answer = send(name, OPEN_DASHBOARD)
        assert (answer.kind, answer.pid) == (OK, 0)
        assert f"got {OPEN_DASHBOARD}" in running.communicate(timeout=30)[0]
    finally:
        if running.poll() is None:
            running.kill()
            running.wait(30)


def test_a_stopping_instance_in_process_answers_stopping(qtbot: Any, tmp_path: Path) -> None:
    """The answer itself, read with the event loop running on this side."""
    first = SingleInstance(server_name(tmp_path / "config"))
    assert first.claim()
    first.set_stopping()
    heard: list[str] = []
    first.messageReceived.connect(heard.append)
    try:
        sock = _raw_client(first.name)
        sock.write(b"open-dashboard\n")
        qtbot.waitUntil(lambda: sock.canReadLine(), timeout=10_000)
        line = bytes(sock.readLine().data()).decode().strip()
        assert line == f"{STOPPING} {os.getpid()}"
        assert heard == []  # a stopping instance opens nothing
        sock.abort()
    finally:
        first.release()


def _raw_client(name: str) -> Any:
    from app.qt import QtNetwork

    sock = QtNetwork.QLocalSocket()
    sock.connectToServer(name)
    assert sock.waitForConnected(5000)
    return sock


@pytest.mark.qt_log_ignore(*IGNORED, "systemTrayWindowChanged")  # offscreen has no tray
def test_quit_shows_stopping_until_the_core_has_stopped(
    qtbot: Any, tmp_path: Path, start_app: Launch
) -> None:
    prepare(tmp_path, **{"server.build": "off"})  # nothing here may start a build
    app = start_app(tmp_path, tray_available=True)
    tray = app.tray
    assert tray is not None
    qtbot.waitUntil(lambda: app.core.running and app.core.proxy is not None, timeout=30_000)
    port = app.core.proxy.port
    held = HeldRequest(port, "/v1/chat/completions", chat_body("under way at Quit"))
    assert held.continued
    app.handlers["quit"]()
    # At once, and until the core has stopped: the icon stays and says so.
    assert tray.icon.isVisible()
    assert tray.icon.toolTip().startswith("Warmslot — Stopping…")
    assert tray.actions == {}
    (line,) = tray.menu.actions()
    assert line.text().startswith("Stopping…") and not line.isEnabled()
    # Nothing else runs meanwhile.
    assert app.handlers["dashboard"]() is None and app.dashboard is None
    assert app.handlers["start"]() is None
    tray.icon.activated.emit(QtWidgets.QSystemTrayIcon.ActivationReason.Trigger)  # a click
    assert app.dashboard is None
    qtbot.waitUntil(lambda: app.core.stopping, timeout=10_000)
    app.controller.stateChanged.emit(app.controller.state)  # a late state does not undo it
    assert tray.icon.toolTip().startswith("Warmslot — Stopping…")
    assert not app.finished  # the request under way holds the stop
    # No llama-server runs here and none is started while stopping: a 503 to retry.
    status, headers, _body = held.finish()
    assert (status, "retry-after" in headers) == (503, True)
    qtbot.waitUntil(lambda: app.finished, timeout=60_000)
    assert not tray.icon.isVisible()
