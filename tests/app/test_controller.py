"""The controller's notifications and build state, driven by core events."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from app.backend import CoreBackend
from app.bridge import Bridge
from app.controller import Controller
from app.state import TrayState
from app.tasks import Tasks
from core.config import Settings
from core.events import BuildProgress, CacheEvent, Notice, PressureSample, ServerExited


@pytest.fixture
def controller(qtbot: Any) -> Iterator[Controller]:
    core = SimpleNamespace(running=False, settings=Settings())
    tasks = Tasks()
    bridge = Bridge()
    c = Controller(core, CoreBackend(core), bridge, tasks)
    yield c
    tasks.shutdown()
    for obj in (c, bridge, tasks):
        obj.deleteLater()


def test_notifies_crash_build_and_invalidated_cache(qtbot: Any, controller: Controller) -> None:
    got: list[tuple[str, str, str]] = []
    controller.notify.connect(lambda *a: got.append(a))
    deliver = controller.bridge.deliver
    deliver(
        ServerExited(
            run_id="r",
            pid=1,
            returncode=None,
            signal=11,
            outcome="crashed",
            requested_by="",
            last_lines=("ggml_abort: out of memory",),
        )
    )
    deliver(
        ServerExited(
            run_id="r", pid=2, returncode=0, signal=None, outcome="requested", requested_by="user"
        )
    )
    deliver(CacheEvent(kind="invalidated", reason="saved for a different server identity"))
    deliver(CacheEvent(kind="save", reason="saved"))
    deliver(BuildProgress(build_id="b", percent=100, step="built b1234", done=True, ok=True))
    deliver(Notice(level="error", text="port 8089 is taken", hint="choose another port"))
    deliver(Notice(level="info", text="fyi"))
    qtbot.waitUntil(lambda: len(got) >= 4)
    titles = [t for t, _, _ in got]
    assert titles == [
        "llama-server crashed",
        "Saved cache invalidated",
        "llama-server build finished",
        "Warmslot",
    ]
    # In words (the signal's meaning, the cause), never llama-server's raw line.
    assert got[0][1].startswith("llama-server crashed (a segmentation fault in llama-server)")
    assert "its output says: out of memory" in got[0][1] and "ggml_abort" not in got[0][1]
    assert got[3] == ("Warmslot", "port 8089 is taken\n→ choose another port", "error")


def test_build_progress_and_pressure_drive_the_tray_state(
    qtbot: Any, controller: Controller
) -> None:
    deliver = controller.bridge.deliver
    deliver(BuildProgress(build_id="b", percent=37.0, step="compiling ggml"))
    qtbot.waitUntil(lambda: controller.state.tray is TrayState.BUILDING)
    assert controller.state.build_percent == 37.0
    assert "compiling ggml" in controller.state.detail
    deliver(BuildProgress(build_id="b", percent=100, step="failed", done=True, ok=False))
    qtbot.waitUntil(lambda: controller.state.tray is TrayState.STOPPED)
    deliver(
        PressureSample(
            level="critical",
            ram_available_pct=2.0,
            swap_used_pct=50.0,
            server_rss_bytes=None,
            disk_free_pct=40.0,
        )
    )
    qtbot.waitUntil(lambda: controller.state.pressure == "critical")
    assert "Memory pressure: critical" in controller.state.tooltip()
