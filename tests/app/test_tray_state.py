"""Tray states from status snapshots, the menu built for every state, icons, tooltips."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from app.icons import icon_path, state_icon
from app.menu import (
    CANCEL_BUILD,
    CHOOSE_MODEL,
    CLIENT_SETUP,
    COPY_DETAIL,
    DASHBOARD,
    DETAIL_LINES,
    DETAIL_WIDTH,
    LOGS,
    QUIT,
    RESTART,
    SETTINGS,
    START,
    STOP,
    detail_lines,
    menu_entries,
    populate,
)
from app.qt import QtWidgets
from app.state import AppState, TrayState, derive_state
from core.events import BuildProgress
from tests.app.conftest import NOW
from tests.fixtures import demo_data as demo
from tests.fixtures.status_shapes import complete

ALWAYS = (DASHBOARD, SETTINGS, LOGS, QUIT, CHOOSE_MODEL, CLIENT_SETUP)


def ready_status(**cache_changes: Any) -> Any:
    st = demo.status(NOW)
    st["last_hour"] = {"hit_ratio": 0.875, "requests": 40}
    st["cache"].update(cache_changes)
    return st


def state_for(tray: TrayState) -> AppState:
    return AppState(
        tray=tray,
        detail="something happened",
        server_state={"stopped": "stopped", "error": "failed", "building": "stopped"}.get(
            tray.value, "starting" if tray is TrayState.STARTING else "ready"
        ),
        model="m.gguf",
        hit_rate_hour=0.5,
        requests_hour=10,
        pressure="nominal",
        progress=(40.0, "Loading the model") if tray is TrayState.STARTING else None,
        can_cancel_build=True,
    )


def test_a_long_error_is_wrapped_in_the_menu_and_can_be_copied() -> None:
    """A menu does not wrap: the message is cut into lines, and a Copy entry has it all."""
    long = (
        "llama-server failed to start: this llama-server uses CPU instructions this "
        "processor lacks (this CPU: AMD EPYC — AVX2, AVX-512, no AMX); Warmslot builds one "
        "for this CPU when server.build is auto — run `warmslot doctor` to see every candidate"
    )
    st = AppState(tray=TrayState.ERROR, detail=long, server_state="failed", model="m.gguf")
    entries = menu_entries(st)
    shown = [e.text for e in entries if e.id.startswith("detail")]
    assert shown == detail_lines(long)
    assert 1 < len(shown) <= DETAIL_LINES
    assert all(len(line) <= DETAIL_WIDTH for line in shown)
    assert shown[-1].endswith(" …")  # cut, and says so
    assert shown[0].startswith("llama-server failed to start: this llama-server")
    copy = next(e for e in entries if e.id == COPY_DETAIL)
    assert copy.kind == "action" and copy.enabled
    short = AppState(tray=TrayState.ERROR, detail="no binary", server_state="failed", model="m")
    assert [e.text for e in menu_entries(short) if e.id.startswith("detail")] == ["no binary"]
    warm = AppState(tray=TrayState.WARM, detail="", server_state="ready", model="m")
    assert COPY_DETAIL not in {e.id for e in menu_entries(warm)}


@pytest.mark.parametrize("tray", list(TrayState))
def test_menu_for_every_state(qtbot: Any, tray: TrayState) -> None:
    st = state_for(tray)
    entries = menu_entries(st)
    by_id = {e.id: e for e in entries}
    assert entries[0].kind == "label" and entries[0].text.startswith(f"Warmslot — {st.label}")
    for key in ALWAYS:
        assert by_id[key].enabled, key
    running = tray in (TrayState.STARTING, TrayState.WARM, TrayState.COLD, TrayState.DEGRADED)
    assert by_id[START].enabled == (tray in (TrayState.STOPPED, TrayState.ERROR))
    assert by_id[START].text == "Start model + cache"
    assert by_id[STOP].enabled == running
    assert by_id[RESTART].enabled == (tray in (TrayState.WARM, TrayState.COLD, TrayState.DEGRADED))
    assert (CANCEL_BUILD in by_id) == (tray is TrayState.BUILDING)
    if tray is TrayState.STARTING:
        assert by_id["progress"].text == "Loading the model (40 %)"
    # The same entries as a real QMenu, wired to handlers by id.
    menu = QtWidgets.QMenu()
    called: list[str] = []
    handlers = {e.id: (lambda i=e.id: called.append(i)) for e in entries if e.kind == "action"}
    actions = populate(menu, entries, handlers)
    assert [a.text() for a in menu.actions() if not a.isSeparator()] == [
        e.text for e in entries if e.kind != "separator"
    ]
    actions[QUIT].trigger()
    actions[DASHBOARD].trigger()
    assert called == [QUIT, DASHBOARD]
    menu.deleteLater()


def test_every_state_has_its_own_icon(qtbot: Any) -> None:
    digests = set()
    for tray in TrayState:
        path = icon_path(tray)
        assert path.is_file(), path
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
        icon = state_icon(tray)
        assert not icon.isNull()
        assert not icon.pixmap(16, 16).isNull()
    assert len(digests) == len(TrayState)


def test_tooltip_has_model_hit_rate_and_pressure() -> None:
    st = derive_state(ready_status(), pressure="nominal")
    tip = st.tooltip()
    assert "Qwen3-Coder-30B-A3B-Instruct-Q4_K_M.gguf" in tip
    assert "Hit rate (last hour): 88 % of 40 requests" in tip
    assert "Memory pressure: nominal" in tip
    assert "no samples" in AppState().tooltip()


def test_derive_states() -> None:
    assert derive_state(None, core_running=False).tray is TrayState.STOPPED
    assert derive_state(None, core_running=False, core_error="port taken").tray is TrayState.ERROR
    stopped = complete({"server": {"state": "stopped"}})
    assert derive_state(stopped).tray is TrayState.STOPPED
    assert derive_state(complete({"server": {"state": "starting"}})).tray is TrayState.STARTING
    failed = derive_state(complete({"server": {"state": "failed", "reason": "no binary"}}))
    assert (failed.tray, failed.detail) == (TrayState.ERROR, "no binary")
    building = derive_state(stopped, build=BuildProgress(build_id="b", percent=30, step="cmake"))
    assert (building.tray, building.build_percent) == (TrayState.BUILDING, 30.0)
    done = BuildProgress(build_id="b", percent=100, step="ok", done=True, ok=True)
    assert derive_state(stopped, build=done).tray is TrayState.STOPPED
    # Ready: warm or cold as the core says (core.cache.inventory.warmth), in its words.
    warm = derive_state(ready_status())
    assert (warm.tray, warm.detail) == (TrayState.WARM, "3 recently used prefixes warm")
    why = "could not bring prefix 3f9c0a1d2b4e5f60 back into slot 0: 400 invalid tokens"
    cold = derive_state(ready_status(warmth={"warm": False, "why": why}))
    assert (cold.tray, cold.detail) == (TrayState.COLD, why)
    low = derive_state(ready_status(), pressure="low")
    assert (low.tray, low.detail) == (TrayState.DEGRADED, "memory pressure is low")
    st = ready_status()
    st["server"]["restarts"] = st["server"]["recent_restarts"] = 2
    crashed = derive_state(st)
    assert (crashed.tray, crashed.detail) == (
        TrayState.DEGRADED,
        "llama-server restarted 2× after crashes",
    )
    # Steady again for server.degraded_clear_s: the core counts them no more, the tray
    # is warm again although the restart counter (for max_restarts) still says 2.
    st["server"]["recent_restarts"] = 0
    assert derive_state(st).tray is TrayState.WARM


def test_a_lost_rpc_worker_degrades_the_tray_and_a_wait_shows_why() -> None:
    st = ready_status()
    st["workers"] = {
        "workers": [
            {"label": "a (10.0.0.2:50052)", "state": "in use", "note": ""},
            {
                "label": "b (10.0.0.3:50052)",
                "state": "left out",
                "note": "not answering: connection refused",
            },
        ],
        "waiting_for": [],
    }
    lost = derive_state(st)
    assert (lost.tray, lost.detail) == (
        TrayState.DEGRADED,
        "RPC worker b (10.0.0.3:50052) is gone: running without it",
    )
    st["workers"]["workers"][1]["note"] = "not needed: the model fits on the main host"
    assert derive_state(st).tray is TrayState.WARM
    reason = "waiting for worker b (10.0.0.3:50052) (connection refused): the model does not fit"
    waiting = derive_state(complete({"server": {"state": "starting", "reason": reason}}))
    assert (waiting.tray, waiting.detail) == (TrayState.STARTING, reason)
