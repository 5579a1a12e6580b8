"""The dashboard draws exactly what the telemetry queries return.

Every tab reads a real SQLite telemetry database with known rows (through
`TelemetryBackend`, i.e. the same query functions the core runs); the numbers
on screen are compared with the same queries run directly.
"""

from __future__ import annotations

from typing import Any

import pytest

from app import fmt
from app.dashboard import Dashboard
from app.dashboard.base import Tab, cell_texts
from app.dashboard.cache import CacheTab
from app.dashboard.events import EventsTab
from app.dashboard.memory import MemoryTab, level_runs
from app.dashboard.overview import OverviewTab, saved_basis
from app.dashboard.requests import RequestsTab
from app.dashboard.reuse import ReuseTab, window
from app.dashboard.server import ServerTab, exits_summary
from app.dashboard.sessions import SessionsTab
from app.qt import Qt, QtGui, QtWidgets
from core.cache.crowding import crowding
from core.events import BuildProgress, LogLine
from tests.app.conftest import NOW
from tests.fixtures.status_shapes import complete


def approx_points(pts: list[tuple[float, float]]) -> Any:
    """Compare lists of (x, y) pairs approximately."""

    class Approx:
        def __eq__(self, other: object) -> bool:
            assert isinstance(other, list) and len(other) == len(pts), (other, pts)
            flat = [v for p in other for v in p]
            return flat == pytest.approx([float(v) for p in pts for v in p])

        def __repr__(self) -> str:
            return repr(pts)

    return Approx()


def refreshed(qtbot: Any, tab: Tab) -> None:
    """Refresh `tab` and wait until it has drawn (and no other refresh is pending)."""
    before = tab.refresh_count
    tab.refresh()
    qtbot.waitUntil(lambda: tab.refresh_count > before and not tab.busy, timeout=10_000)
    assert not tab.last_errors, tab.last_errors


@pytest.mark.parametrize("bucket", ["minute", "hour", "day"])
def test_reuse_charts_equal_the_queries(
    qtbot: Any, offline: Any, expected: Any, bucket: str
) -> None:
    tab = ReuseTab(offline)
    qtbot.addWidget(tab)
    tab.bucket.setCurrentIndex(tab.bucket.findData(bucket))
    qtbot.waitUntil(lambda: not tab.busy)
    tab.buckets.clear()
    refreshed(qtbot, tab)
    since, until, size = window(bucket, NOW)
    assert tab.last_requests["hit"] == (
        "hit_rate",
        {"bucket": bucket, "since": since, "until": until},
    )
    # The next refresh asks only for the buckets that were not final yet (finished
    # ones are cached); what is drawn must still equal the whole window's query.
    refreshed(qtbot, tab)
    name, kw = tab.last_requests["hit"]
    assert name == "hit_rate" and kw["bucket"] == bucket and kw["until"] == until
    assert since < kw["since"] <= NOW and (kw["since"] - since) % size == 0
    detail = max(since, NOW - 86400)
    assert tab.last_requests["ttfb"] == ("ttfb", {"since": detail})
    rows = expected.hit_rate(bucket=bucket, since=since, until=until)
    assert rows, "the known data has requests in every window"
    # Hit rate line: one point per bucket with requests, y = hit ratio in percent.
    assert tab.hit.points("hit rate") == approx_points(
        [(r["bucket"], r["hit_ratio"] * 100) for r in rows]
    )
    # Stacked tokens: two points per bucket (a step), cached below, new on top of it.
    cached = tab.tokens.points("cached")
    top = tab.tokens.points("new")
    by_bucket = {r["bucket"]: r for r in rows}
    starts = [cached[i][0] for i in range(0, len(cached), 2)]
    assert starts[0] == since and starts[-1] + size >= until
    d = tab.tokens_divisor  # large numbers are drawn in thousands or millions
    for i, b in enumerate(starts):
        r = by_bucket.get(b, {"cached": 0, "new": 0})
        assert cached[2 * i][1] * d == pytest.approx(r["cached"])
        assert (top[2 * i][1] - cached[2 * i][1]) * d == pytest.approx(r["new"])
        assert cached[2 * i + 1][0] == b + size and cached[2 * i + 1][1] == cached[2 * i][1]

    t = expected.ttfb(since=detail)
    assert tab.ttfb.bars() == [
        (f"prefill warm (n={t['warm_prefill_n']:,})", round(t["warm_prefill"], 1)),
        (f"prefill cold (n={t['cold_prefill_n']:,})", round(t["cold_prefill"], 1)),
        (f"first byte warm (n={t['warm_n']:,})", round(t["warm"], 1)),
        (f"first byte cold (n={t['cold_n']:,})", round(t["cold"], 1)),
    ]
    clients = [c for c in expected.per_client(since=detail) if c["hit_ratio"] is not None]
    assert tab.clients.bars() == [
        (f"{c['client']} ({c['requests']:,})", round(c["hit_ratio"] * 100, 1)) for c in clients
    ]
    div = expected.recent_events(category="cache", kind="divergence", limit=10)
    assert [row[4] for row in cell_texts(tab.divergences)] == [d["reason"] for d in div]
    assert [row[1] for row in cell_texts(tab.divergences)] == ["aider", "opencode"]


def test_reuse_minute_numbers_by_hand(qtbot: Any, offline: Any) -> None:
    """The same check against numbers worked out by hand from the known rows."""
    tab = ReuseTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    # Last hour: 5 requests; cached 900+0+500+0+1800 = 3200 of 3200+2000 tokens.
    assert tab.summary.text() == "5 requests · 3.2 k of 5.2 k prompt tokens cached (61.5 %)"
    # Warm (cache_n > prompt_n): 900>100 and 1800>200 → ttfb 120, 110 → median index 1 → 120.
    # Cold: 900 (0≤1000), 300 (500≤500), 400 (0≤200) → median 400.
    # Prefill (prompt_ms = new tokens × 0.5): warm 50, 100 → 100; cold 500, 250, 100 → 250.
    assert tab.ttfb.bars() == [
        ("prefill warm (n=2)", 100.0),
        ("prefill cold (n=3)", 250.0),
        ("first byte warm (n=2)", 120.0),
        ("first byte cold (n=3)", 400.0),
    ]
    bars = tab.clients.bars()
    assert bars[0] == ("opencode (3)", round(2700 / 4000 * 100, 1))  # most requests first
    assert sorted(bars[1:]) == [("aider (1)", 50.0), ("curl (1)", 0.0)]


def test_overview_cards_equal_the_queries(qtbot: Any, offline: Any, expected: Any) -> None:
    tab = OverviewTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    today = expected.totals(since=fmt.start_of_day(NOW))
    hour = expected.totals(since=NOW - 3600)
    assert tab.cards["hit_hour"].value.text() == fmt.pct(hour["hit_ratio"])
    assert tab.cards["hit_hour"].sub.text() == f"{hour['requests']} requests"
    assert tab.cards["hit_today"].value.text() == fmt.pct(today["hit_ratio"])
    assert tab.cards["requests_today"].value.text() == f"{today['requests']:,}"
    assert tab.cards["cached_today"].sub.text() == f"{today['cached_tokens']:,} tokens"
    assert tab.cards["saved_today"].value.text() == fmt.duration(today["seconds_saved"])
    # By hand: the one cold prefill (1,000 new tokens, nothing reused) ran at 0.5 ms/token.
    assert today["cold_rate"]["ms_per_token"] == pytest.approx(0.5)
    assert today["seconds_saved"] == pytest.approx(today["cached_tokens"] * 0.5 / 1000)
    assert tab.cards["saved_today"].sub.text() == saved_basis(today)
    assert "0.5 ms/token (1 cold request)" in saved_basis(today)
    since, until, _ = window("hour", NOW)
    day = expected.hit_rate(bucket="hour", since=since, until=until)
    assert tab.day.points("hit rate") == approx_points(
        [(r["bucket"], r["hit_ratio"] * 100) for r in day]
    )
    # Offline (no controller): the state comes from the snapshot, buttons are off.
    assert tab.state_label.text() == "Warm"
    assert not tab.start_button.isEnabled()


def test_overview_long_error_has_details(qtbot: Any, offline: Any) -> None:
    """The state line shows what fits; Details… opens the whole message, copyable."""
    from app.state import AppState, TrayState

    tab = OverviewTab(offline)
    qtbot.addWidget(tab)
    long = "llama-server failed to start: " + "a reason that goes on and on, " * 12
    tab.show_state(AppState(tray=TrayState.ERROR, detail=long, server_state="failed", model="m"))
    assert tab.details_button.isVisibleTo(tab)
    assert tab.detail_label.toolTip() == long
    tab.details_button.click()
    assert tab.details_box is not None and long in tab.details_box.text()
    tab.details_box.close()
    ready = "ready; prefixes warm as clients send them"
    tab.show_state(AppState(tray=TrayState.WARM, detail=ready, server_state="ready", model="m"))
    assert not tab.details_button.isVisibleTo(tab)  # an ordinary state needs no Details


def test_memory_chart_equals_pressure_series(qtbot: Any, offline: Any, expected: Any) -> None:
    tab = MemoryTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    rows = expected.pressure_series(since=NOW - 3600)
    assert len(rows) == 60
    assert tab.percent.points("RAM available") == approx_points(
        [(r["ts"], r["ram_available_pct"]) for r in rows]
    )
    assert tab.percent.points("swap used") == approx_points(
        [(r["ts"], r["swap_used_pct"]) for r in rows]
    )
    gpu = [(r["ts"], (r["gpus"][0][1] - r["gpus"][0][2]) / r["gpus"][0][1] * 100) for r in rows]
    assert tab.percent.points("VRAM used GPU 0") == approx_points(gpu)
    # 20–22 GiB of RSS: drawn in GiB (fmt.size_scale), one axis unit, nice ticks.
    assert tab.rss.axis_y.titleText() == "GiB"
    assert tab.rss.points("RSS") == approx_points(
        [(r["ts"], r["server_rss"] / 2**30) for r in rows]
    )
    # Level bands: low for 6 samples, then critical for 2, nothing while nominal.
    runs = level_runs(rows, NOW)
    assert [(lvl, round((b - a) / 60)) for a, b, lvl in runs] == [("low", 6), ("critical", 2)]
    assert tab.percent.bands == runs
    assert "critical" in [b[2] for b in tab.rss.bands]
    # Disk: the snapshot's saved states against its cap.
    assert tab.disk_label.text().startswith("3.0 GiB in 4 saved states, cap 8.0 GiB")


def test_memory_rss_drops_to_zero_where_no_server_ran(qtbot: Any, offline: Any) -> None:
    tab = MemoryTab(offline)
    qtbot.addWidget(tab)
    sample = {"level": "nominal", "ram_available_pct": 50.0, "swap_used_pct": 1.0, "gpus": []}
    rows = [
        {**sample, "ts": NOW - 300, "server_rss": 300 * 2**20},
        {**sample, "ts": NOW - 200, "server_rss": None},  # stopped
        {**sample, "ts": NOW - 100, "server_rss": 310 * 2**20},
    ]
    tab.apply_series(rows, NOW - 3600, NOW)
    want = [(NOW - 300, 300), (NOW - 200, 0), (NOW - 100, 310)]
    assert tab.rss.points("RSS") == approx_points(want)
    assert not tab.rss.showing_message
    stopped = [{**r, "server_rss": None} for r in rows]
    tab.apply_series(stopped, NOW - 3600, NOW)
    assert tab.rss.showing_message and "did not run" in tab.rss.message.text()
    assert not tab.percent.showing_message  # RAM and swap were still sampled


def test_memory_placeholder_without_samples(qtbot: Any, offline: Any) -> None:
    tab = MemoryTab(offline)
    qtbot.addWidget(tab)
    tab.apply_series([], NOW - 3600, NOW)
    assert tab.percent.showing_message
    assert "pressure sampler" in tab.percent.message.text()


def test_events_table_filters(qtbot: Any, offline: Any, expected: Any) -> None:
    tab = EventsTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    rows = expected.recent_events(limit=500, since=NOW - 86400)
    assert [r[2] for r in cell_texts(tab.table)] == [r["kind"] for r in rows]
    assert [r[3] for r in cell_texts(tab.table)] == [r["reason"] or "" for r in rows]
    tab.category.setCurrentText("cache")
    refreshed(qtbot, tab)
    assert {r[1] for r in cell_texts(tab.table)} == {"cache"}
    tab.kind.setCurrentText("divergence")
    refreshed(qtbot, tab)
    assert len(cell_texts(tab.table)) == 2
    tab.search.setText("500 tokens")
    assert [r[3] for r in cell_texts(tab.table)] == ["reused 500 tokens; expected ≥ 990"]
    assert tab.count_label.text() == "1 of 2 events"
    tab.table.selectRow(0)
    assert '"client": "aider"' in tab.details.toPlainText()


def test_server_tab_runs_log_and_build(qtbot: Any, offline: Any, expected: Any) -> None:
    offline.bridge.deliver(LogLine(level="info", area="srv", text="hello", raw="srv hello"))
    tab = ServerTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    runs = expected.server_runs(limit=20)
    texts = cell_texts(tab.runs)
    assert [r[3] for r in texts] == [r["outcome"] or "running" for r in runs]
    assert texts[1][4] == "signal 11"
    assert "llama-server -m" in tab.argv.toPlainText()
    # The log tail: what the bridge had, then live lines.
    assert tab.log.toPlainText() == "srv hello"
    offline.bridge.deliver(LogLine(level="error", area="srv", text="boom", raw="srv boom"))
    qtbot.waitUntil(lambda: tab.log.toPlainText().endswith("srv boom"))
    # Build progress from BuildProgress events; no build API in this backend.
    offline.bridge.deliver(
        BuildProgress(
            build_id="b",
            percent=42.0,
            step="compiling ggml",
            steps_done=88,
            steps_total=208,
            elapsed_s=300.0,
            eta_s=420.0,
            purpose="no llama-server works on this CPU: building one for it",
        )
    )
    qtbot.waitUntil(lambda: tab.build_bar.value() == 42)
    assert tab.build_step.text() == (
        "no llama-server works on this CPU: building one for it: 42 % (88/208), "
        "5 min so far, about 7 min left\ncompiling ggml"
    )
    assert not tab.build_button.isEnabled()
    assert "build_server" in tab.build_button.toolTip()


def test_server_tab_fit_plan_and_exits(qtbot: Any, offline: Any) -> None:
    """The fit plan keeps its columns (fixed pitch, no wrapping); exits count by kind."""
    tab = ServerTab(offline)
    qtbot.addWidget(tab)
    plan = "  device        weights   KV+state\n  CPU (host)    241 MiB     18 MiB"
    failed = {"outcome": "start_failed", "ts": 0.0, "returncode": 1, "signal": None,
              "requested_by": "", "last_lines": []}  # fmt: skip
    tab.apply_status(
        complete(
            {"server": {"state": "failed", "pid": None, "restarts": 0,
                        "fit": {"plan": {}, "text": plan}, "exits": [failed, failed]}}
        )["server"]
    )  # fmt: skip
    assert tab.fit.toPlainText() == plan
    assert QtGui.QFontInfo(tab.fit.font()).fixedPitch()
    assert tab.fit.lineWrapMode() is QtWidgets.QPlainTextEdit.LineWrapMode.NoWrap
    assert tab.facts["restarts"].text() == (
        "0 in a row now; 2 exits since Warmslot started: 2 failed starts"
    )
    tab.apply_status(complete({"server": {"state": "stopped", "pid": None}})["server"])
    assert tab.fit.toPlainText() == "" and "warmslot fit" in tab.fit.placeholderText()
    assert (
        exits_summary([{"outcome": "crashed"}, {"outcome": "requested"}, {"outcome": "crashed"}])
        == "3 exits since Warmslot started: 2 crashes, 1 requested stop"
    )
    assert exits_summary([]) == "no exits since Warmslot started"


def test_sessions_tab_equals_the_query(qtbot: Any, offline: Any, expected: Any) -> None:
    from core.events import RequestCompleted

    # a second opencode session, which must not merge with the first
    second = RequestCompleted(
        request_id="second",
        client="opencode",
        session="opencode-ses_8f2a",
        endpoint="chat",
        stream=True,
        has_tools=True,
        status=200,
        slot=0,
        prompt_n=40,
        cache_n=960,
        prompt_ms=30.0,
        ttfb_ms=35.0,
        total_ms=400.0,
        ts=NOW - 60,
    )
    expected.record(second)
    expected.flush()
    tab = SessionsTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    since = NOW - 86400
    assert tab.last_requests["sessions"] == ("sessions", {"since": since})
    rows = expected.sessions(since=since)
    texts = cell_texts(tab.table)
    assert len(texts) == len(rows) > 1
    assert [(t[0], t[1], t[3], t[4]) for t in texts] == [
        (r["client"], r["session"] or "(none)", str(r["requests"]), fmt.pct(r["hit_ratio"]))
        for r in rows
    ]
    # sessions of one client are apart: more rows than clients
    assert len({t[1] for t in texts}) > len({t[0] for t in texts})
    # a session that holds a slot now (the status snapshot) shows its slot
    slot_of = {"opencode-ses_8f2a": "0", "aider-7c1e": "1"}
    for t in texts:
        assert t[9] == slot_of.get(t[1], "—")


def test_crowding_warning_when_agents_outnumber_agent_slots() -> None:
    now = 10_000.0
    cache = {"aux_slot": 1, "slots": [{"id": 0}, {"id": 1}]}  # one agent slot
    two = [
        {"session": "a", "kinds": "agent", "last_seen": now - 30},
        {"session": "b", "kinds": "agent", "last_seen": now - 200},
        {"session": "", "kinds": "aux", "last_seen": now - 5},
    ]
    text = crowding(two, cache, now)
    assert text.startswith("2 agent sessions were active") and "1 agent slot:" in text
    assert crowding(two[:1], cache, now) == ""  # one agent, one slot
    assert crowding(two, {"aux_slot": None, "slots": [{"id": 0}, {"id": 1}]}, now) == ""
    stale = [dict(two[0]), {**two[1], "last_seen": now - 3600}]
    assert crowding(stale, cache, now) == ""  # the other one left an hour ago
    assert crowding(two, None, now) == ""  # no cache status: nothing to say


def test_requests_tab_rows_and_details(qtbot: Any, offline: Any, expected: Any) -> None:
    tab = RequestsTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    rows = expected.recent_requests(200)
    texts = cell_texts(tab.table)
    assert len(texts) == len(rows) > 1
    assert [(t[1], t[2], t[6], t[7]) for t in texts] == [
        (r["client"], r["session"], str(r["cache_n"]), str(r["prompt_n"])) for r in rows
    ]
    r0 = rows[0]
    assert texts[0][8] == fmt.pct(r0["cache_n"] / (r0["cache_n"] + r0["prompt_n"]))
    tab.table.selectRow(0)
    assert f'"request_id": "{r0["request_id"]}"' in tab.details.toPlainText()


def test_cache_tab_actions(qtbot: Any, offline: Any) -> None:
    snap = offline.backend.snapshot["cache"]
    snap["saved"][2]["expires_in_s"] = 600.0  # the core's own figure wins when it gives one
    snap["slots"][0].update(ttl_class="long", expires_in_s=1800.0)
    tab = CacheTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    saved = cell_texts(tab.saved)
    assert len(saved) == 4
    assert saved[0][5] == "never (pinned)" and saved[0][6] == "yes"
    assert saved[1][5] == "in 23.3 h"  # extended TTL (24 h) minus 43 min since last use
    assert saved[2][5] == "in 10 min"
    assert cell_texts(tab.slots)[0][7] == "long, in 30 min"
    assert not tab.pin_button.isEnabled()  # nothing selected yet
    tab.saved.selectRow(0)
    assert tab.pin_button.text() == "Unpin" and tab.pin_button.isEnabled()
    qtbot.mouseClick(tab.pin_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(offline.calls) == 1)
    qtbot.waitUntil(lambda: not tab.busy)  # a done command refreshes the tab
    tab.saved.selectRow(1)
    qtbot.mouseClick(tab.rewarm_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(offline.calls) == 2)
    qtbot.waitUntil(lambda: not tab.busy)
    tab.saved.selectRow(1)
    qtbot.mouseClick(tab.evict_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(offline.calls) == 3)
    qtbot.waitUntil(lambda: not tab.busy)
    tab.prefixes.selectRow(2)
    qtbot.mouseClick(tab.rewarm_prefix_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(offline.calls) == 4)
    assert offline.calls == [
        ("pin", (saved[0][0], False)),
        ("rewarm", (saved[1][1],)),
        ("evict", (saved[1][0],)),
        ("rewarm", (cell_texts(tab.prefixes)[2][0],)),
    ]
    qtbot.waitUntil(lambda: "done" in tab.action_label.text() and not tab.busy)
    tab.saved.selectRow(3)  # saved for another server: cannot be re-warmed here
    assert not tab.rewarm_button.isEnabled()
    assert len(cell_texts(tab.slots)) == 4 and cell_texts(tab.slots)[3][1] == "side calls"


def test_cache_actions_disabled_without_core_api(qtbot: Any, offline: Any) -> None:
    offline.backend.commands.clear()
    tab = CacheTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    tab.saved.selectRow(0)
    tab.prefixes.selectRow(0)
    for button, name in (
        (tab.pin_button, "Core.pin("),
        (tab.evict_button, "Core.evict("),
        (tab.rewarm_button, "Core.rewarm("),
        (tab.rewarm_prefix_button, "Core.rewarm("),
    ):
        assert not button.isEnabled()
        assert name in button.toolTip()


def test_dashboard_window_geometry_and_tabs(qtbot: Any, offline: Any, tmp_path: Any) -> None:
    from app.qt import QtCore

    settings = QtCore.QSettings(str(tmp_path / "gui.ini"), QtCore.QSettings.Format.IniFormat)
    dash = Dashboard(offline, settings)
    qtbot.addWidget(dash)
    dash.show()
    assert [dash.tabs.tabText(i) for i in range(dash.tabs.count())] == [
        "Overview",
        "Reuse",
        "Memory",
        "Sessions",
        "Requests",
        "Cache",
        "Events",
        "Server",
    ]
    qtbot.waitUntil(lambda: dash.page("overview").refresh_count > 0)
    dash.tabs.setCurrentIndex(2)
    qtbot.waitUntil(lambda: dash.page("memory").refresh_count > 0)
    dash.resize(700, 500)  # within the offscreen screen (800×600)
    dash.close()
    again = Dashboard(offline, settings)
    qtbot.addWidget(again)
    assert again.tabs.currentIndex() == 2
    assert (again.size().width(), again.size().height()) == (700, 500)
    assert isinstance(again.page("reuse"), QtWidgets.QWidget)
    for page in dash.pages.values():  # let in-flight refreshes land before teardown
        qtbot.waitUntil(lambda p=page: not p.busy)


def test_server_tab_says_who_placed_the_layers(qtbot: Any, offline: Any) -> None:
    """llama.cpp's placement (and any MoE experts it kept in RAM) beside Warmslot's estimate."""
    from core.server.placement import Placement

    tab = ServerTab(offline)
    qtbot.addWidget(tab)
    place = Placement(
        "llama-fit-params",
        n_gpu_layers=5,
        overrides=("blk\\.0\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU",),
    )
    plan = {"n_gpu_layers": 3, "devices": [{"kind": "gpu"}], "placement": place.to_dict()}
    srv = {"state": "running", "pid": 1, "restarts": 0, "fit": {"plan": plan, "text": "t"}}
    tab.apply_status(complete({"server": srv})["server"])
    assert tab.placement.text() == (
        "Layers: placed by llama.cpp (llama-fit-params): -ngl 5; MoE experts of 1 layer(s) "
        "in host RAM. Warmslot's own estimate was -ngl 3."
    )
    plan["placement"] = Placement("--fit at launch", target_mib=1024).to_dict()
    tab.apply_status(complete({"server": srv})["server"])
    assert "--fit as it loads" in tab.placement.text()
    assert "1024 MiB" in tab.placement.text()
