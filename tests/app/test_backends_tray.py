"""The tray with several backends: one that is not ready degrades it, and says which
(docs/scale.md#several-backends)."""

from __future__ import annotations

from typing import Any

from app.state import TrayState, derive_state
from core.status.server import ServerRow
from tests.app.conftest import NOW
from tests.fixtures import demo_data as demo


def _row(name: str, ready: bool, state: str, reason: str = "") -> ServerRow:
    return {
        "name": name,
        "model": "",
        "backend": name,
        "primary": name == "main",
        "where": "launched here",
        "ready": ready,
        "state": state,
        "reason": reason,
        "port": None,
        "pid": None,
        "inflight": 0,
        "idle_s": 0.0,
        "calls": {"agent": 0, "aux": 0},
        "errors": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "hit_ratio": None,
        "active_sessions": 0,
        "moved_in": 0,
    }


def test_a_backend_that_is_not_ready_degrades_the_tray() -> None:
    st: Any = demo.status(NOW)
    healthy = derive_state(st).tray
    st["backends"] = {
        "backends": [_row("main", True, "ready"), _row("gpu1", True, "ready")],
        "sessions": 2,
        "moved": 0,
    }
    assert derive_state(st).tray is healthy
    st["backends"]["backends"][1] = _row("gpu1", False, "starting", "restart 1 in 0.5 s")
    lost = derive_state(st)
    assert (lost.tray, lost.detail) == (
        TrayState.DEGRADED,
        "backend gpu1 is not ready (starting — restart 1 in 0.5 s): sessions go elsewhere",
    )


def test_the_server_tab_lists_the_backends(qtbot: Any, offline: Any) -> None:
    from app.dashboard.server import ServerTab

    tab = ServerTab(offline)
    qtbot.addWidget(tab)
    st: Any = demo.status(NOW)
    tab.apply({"status": st})
    assert tab.facts["backends"].text() == "one (the llama-server above)"
    st["backends"] = {
        "backends": [_row("main", True, "ready"), _row("gpu1", False, "starting")],
        "sessions": 2,
        "moved": 1,
    }
    tab.apply({"status": st})
    lines = tab.facts["backends"].text().split("\n")
    assert [line.split()[:2] for line in lines] == [["main", "ready"], ["gpu1", "starting"]]
