"""The dashboard at the edges a user meets first: a small screen, the keyboard, a dark
theme, a refresh under a selection, a destructive click, units, a stopped server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import fmt
from app.charts import BarChart, contrast, dark_palette, muted
from app.dashboard import Dashboard
from app.dashboard.base import cell_texts, selected_key
from app.dashboard.cache import CacheTab
from app.dashboard.events import EventsTab
from app.dashboard.memory import MemoryTab
from app.dashboard.overview import OverviewTab
from app.dashboard.preview import preview, slots_text
from app.dashboard.requests import RequestsTab
from app.dashboard.reuse import ReuseTab
from app.qt import Qt, QtCore, QtGui, QtWidgets
from tests.app.conftest import NOW, Launch, prepare
from tests.app.test_dashboard import refreshed

GiB = 2**30


# ---------------------------------------------------------------- the window
def test_window_fits_the_available_geometry(qtbot: Any, offline: Any) -> None:
    """The preferred 1200×820 is taller than the screen (offscreen: 800×800): the window
    shrinks to what the screen leaves, frame included, and opens inside it."""
    dash = Dashboard(offline)
    qtbot.addWidget(dash)
    avail = dash.available()
    assert avail.height() < 820  # the case the preferred size does not fit
    dash.show()
    qtbot.waitUntil(dash.fits_screen)
    assert avail.contains(dash.frameGeometry())
    assert dash.height() < 820 and dash.width() <= 1200  # shrunk, never grown
    qtbot.waitUntil(lambda: not dash.current_page().busy)


def test_saved_geometry_from_a_larger_screen_is_brought_inside(
    qtbot: Any, offline: Any, tmp_path: Path
) -> None:
    settings = QtCore.QSettings(str(tmp_path / "gui.ini"), QtCore.QSettings.Format.IniFormat)
    first = Dashboard(offline, settings)
    qtbot.addWidget(first)
    first.setGeometry(300, 200, 1700, 1000)  # as on a 1920×1080 screen
    first.save_geometry()
    again = Dashboard(offline, settings)
    qtbot.addWidget(again)
    again.show()
    qtbot.waitUntil(again.fits_screen)
    assert again.available().contains(again.frameGeometry())
    for dash in (first, again):
        qtbot.waitUntil(lambda d=dash: not d.current_page().busy)


# ---------------------------------------------------------------- keyboard
def _activated(qtbot: Any, dash: Dashboard) -> None:
    dash.show()
    dash.activateWindow()
    qtbot.waitUntil(lambda: QtWidgets.QApplication.activeWindow() is dash)


def test_esc_and_ctrl_w_close_ctrl_q_asks_to_quit(qtbot: Any, offline: Any) -> None:
    dash = Dashboard(offline)
    qtbot.addWidget(dash)
    for key, mod in (
        (Qt.Key.Key_Escape, Qt.KeyboardModifier.NoModifier),
        (Qt.Key.Key_W, Qt.KeyboardModifier.ControlModifier),
    ):
        _activated(qtbot, dash)
        with qtbot.waitSignal(dash.closed, timeout=5000):
            qtbot.keyClick(dash.tabs, key, mod)
        assert not dash.isVisible()
    _activated(qtbot, dash)
    with qtbot.waitSignal(dash.quitRequested, timeout=5000):
        qtbot.keyClick(dash.tabs, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    assert dash.isVisible()  # quitting is the app's business (it stops the core first)
    # Where the window is the app (no tray), Esc does not close it: that would quit.
    dash.esc_closes = False
    qtbot.keyClick(dash.tabs, Qt.Key.Key_Escape)
    assert dash.isVisible()
    for page in dash.pages.values():
        qtbot.waitUntil(lambda p=page: not p.busy)


def test_ctrl_q_quits_through_the_apps_quit(qtbot: Any, tmp_path: Path, start_app: Launch) -> None:
    prepare(tmp_path)
    app = start_app(tmp_path, tray_available=False)
    qtbot.waitUntil(lambda: app.core.running, timeout=30_000)
    dash = app.dashboard
    assert dash is not None
    _activated(qtbot, dash)
    qtbot.keyClick(dash.tabs, Qt.Key.Key_Escape)  # no tray: Esc must not quit
    assert not app.stopping and dash.isVisible()
    qtbot.keyClick(dash.tabs, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    assert app.stopping  # App.quit: Stopping…, the core stops on a worker thread
    qtbot.waitUntil(lambda: app.finished, timeout=60_000)
    assert not app.core.running


# ---------------------------------------------------------------- selection across refreshes
def _add_events(db: Path, *events: Any) -> None:
    from core.telemetry import Telemetry

    tel = Telemetry(db, clock=lambda: NOW)
    for ev in events:
        tel.record(ev)
    tel.close()


def test_events_selection_follows_the_event_not_the_row(
    qtbot: Any, offline: Any, known_db: Path
) -> None:
    from core.events import CacheEvent

    tab = EventsTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    tab.table.selectRow(1)
    picked = tab.selected_event()
    assert picked is not None
    details = tab.details.toPlainText()
    # Two newer events arrive: they are listed above the selected one.
    _add_events(
        known_db,
        CacheEvent(kind="save", reason="saved a new prefix", tokens=10, ts=NOW - 5),
        CacheEvent(kind="keepalive", reason="re-warmed", tokens=10, ts=NOW - 1),
    )
    refreshed(qtbot, tab)
    assert [r[3] for r in cell_texts(tab.table)][:2] == ["re-warmed", "saved a new prefix"]
    assert selected_key(tab.table) == picked["id"]
    assert tab.table.selectionModel().selectedRows()[0].row() == 3
    assert tab.details.toPlainText() == details
    # Filtered out: nothing is selected (not whichever row took its place).
    tab.search.setText("re-warmed")
    assert tab.selected_event() is None and tab.details.toPlainText() == ""


def test_requests_selection_follows_the_request(qtbot: Any, offline: Any, known_db: Path) -> None:
    from core.events import RequestCompleted

    tab = RequestsTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    tab.table.selectRow(0)
    picked = tab.selected_request()
    assert picked is not None
    new = RequestCompleted(
        request_id="r-new", client="curl", session="s", endpoint="chat", stream=False,
        has_tools=False, status=200, slot=0, prompt_n=5, cache_n=0, prompt_ms=1.0,
        predicted_n=1, ttfb_ms=2.0, total_ms=3.0, ts=NOW - 1,
    )  # fmt: skip
    _add_events(known_db, new)
    refreshed(qtbot, tab)
    assert cell_texts(tab.table)[0][1] == "curl"
    assert selected_key(tab.table) == picked["request_id"]
    assert f'"request_id": "{picked["request_id"]}"' in tab.details.toPlainText()


# ---------------------------------------------------------------- evicting
def _box(tab: CacheTab) -> QtWidgets.QMessageBox:
    box = tab.confirm_box
    assert box is not None and box.isVisible()
    return box


def _button(box: QtWidgets.QMessageBox, text: str) -> QtWidgets.QAbstractButton:
    return next(b for b in box.buttons() if b.text().replace("&", "") == text)


def test_evicting_a_pinned_state_asks_first(qtbot: Any, offline: Any) -> None:
    snap = offline.backend.snapshot["cache"]
    conversation = {
        **snap["saved"][1], "file": "ws-conv-opencode.bin", "kind": "conversation",
        "client": "opencode", "session": "ses_8f2a", "tokens": 4_210,
        "bytes": int(105.7 * 2**20), "pinned": True,
    }  # fmt: skip
    snap["saved"].append(conversation)
    tab = CacheTab(offline)
    qtbot.addWidget(tab)
    tab.show()
    refreshed(qtbot, tab)
    # A pinned conversation of 105.7 MiB: the question names its size and that it is pinned.
    tab.conversations.selectRow(0)
    qtbot.mouseClick(tab.conversation_evict_button, Qt.MouseButton.LeftButton)
    box = _box(tab)
    assert "105.7 MiB" in box.text() and "pinned" in box.text() and "4,210 tokens" in box.text()
    assert offline.calls == []  # nothing evicted while the question is up
    qtbot.mouseClick(_button(box, "Cancel"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: tab.confirm_box is None)
    assert offline.calls == []
    qtbot.mouseClick(tab.conversation_evict_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(_button(_box(tab), "Evict"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: offline.calls == [("evict", ("ws-conv-opencode.bin",))])
    qtbot.waitUntil(lambda: not tab.busy)
    # The pinned prefix state asks too; an unpinned 201 MiB one is evicted at once.
    tab.saved.selectRow(0)
    qtbot.mouseClick(tab.evict_button, Qt.MouseButton.LeftButton)
    assert "pinned" in _box(tab).text()
    qtbot.mouseClick(_button(_box(tab), "Cancel"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: tab.confirm_box is None)
    tab.saved.selectRow(2)
    assert not snap["saved"][2]["pinned"] and snap["saved"][2]["bytes"] < GiB
    qtbot.mouseClick(tab.evict_button, Qt.MouseButton.LeftButton)
    assert tab.confirm_box is None
    qtbot.waitUntil(lambda: len(offline.calls) == 2)
    assert offline.calls[1] == ("evict", (snap["saved"][2]["file"],))
    qtbot.waitUntil(lambda: not tab.busy)


# ---------------------------------------------------------------- dark theme
@pytest.fixture
def dark(qapp: Any) -> Iterator[QtGui.QPalette]:
    before = QtGui.QPalette(qapp.palette())
    qapp.setPalette(dark_palette())
    yield qapp.palette()
    qapp.setPalette(before)


def test_charts_and_captions_follow_a_dark_palette(
    qtbot: Any, offline: Any, dark: QtGui.QPalette
) -> None:
    base = dark.color(QtGui.QPalette.ColorRole.Base)
    text = dark.color(QtGui.QPalette.ColorRole.Text)
    tab = ReuseTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    for chart in (tab.hit, tab.tokens, tab.ttfb, tab.clients):
        c = chart.chart
        assert c.backgroundBrush().color() == base  # not white
        assert c.titleBrush().color() == text
        for axis in c.axes():
            assert axis.labelsBrush().color() == text
    overview = OverviewTab(offline)
    qtbot.addWidget(overview)
    caption = muted(overview.palette(), "base")
    assert contrast(caption, base) >= 4.5
    card = overview.cards["hit_hour"]
    assert caption.name() in card.caption.styleSheet()
    assert contrast(QtGui.QColor("#666666"), base) < 4.5  # the old caption color was not
    qtbot.waitUntil(lambda: not overview.busy)


def test_a_chart_repaints_when_the_palette_turns_dark(qtbot: Any, offline: Any, qapp: Any) -> None:
    tab = MemoryTab(offline)
    qtbot.addWidget(tab)
    light_bg = tab.percent.chart.backgroundBrush().color()
    before = QtGui.QPalette(qapp.palette())
    try:
        qapp.setPalette(dark_palette())
        qtbot.waitUntil(lambda: tab.percent.chart.backgroundBrush().color() != light_bg)
        assert tab.percent.chart.backgroundBrush().color() == dark_palette().color(
            QtGui.QPalette.ColorRole.Base
        )
    finally:
        qapp.setPalette(before)
    qtbot.waitUntil(lambda: not tab.busy)


# ---------------------------------------------------------------- units
def test_axis_units_follow_the_data() -> None:
    assert fmt.time_scale(1_500).unit == "ms"
    assert (fmt.time_scale(3_053).unit, fmt.time_scale(3_053).divisor) == ("s", 1000.0)
    assert fmt.time_scale(300_000).unit == "min"
    assert fmt.size_scale(300 * 2**20).unit == "MiB"
    assert fmt.size_scale(22 * GiB).unit == "GiB"
    assert fmt.size(105.7 * 2**20) == "105.7 MiB"


def test_bars_read_in_seconds_and_keep_small_values_readable(qtbot: Any) -> None:
    chart = BarChart("t", "ms", value_text=lambda ms: fmt.duration(ms / 1000), scale=fmt.time_scale)
    qtbot.addWidget(chart)
    chart.set_bars([("prefill warm", 6.8), ("prefill cold", 2982.7)])
    assert chart.axis_val.titleText() == "s"
    assert [chart.set.at(i) for i in range(2)] == pytest.approx([2.9827, 0.0068])  # bottom-up
    assert chart.bars() == [("prefill warm", 6.8), ("prefill cold", 2982.7)]
    # The value is in the category's label, beside the bar: a 6.8 ms bar cannot clip it.
    assert chart.labels() == ["prefill warm · 6.8 ms", "prefill cold · 3.0 s"]
    assert not chart.series.isLabelsVisible()


def test_memory_rss_in_gib_for_a_large_server(qtbot: Any, offline: Any, expected: Any) -> None:
    tab = MemoryTab(offline)
    qtbot.addWidget(tab)
    refreshed(qtbot, tab)
    rows = expected.pressure_series(since=NOW - 3600)
    assert tab.rss.axis_y.titleText() == "GiB"  # 20–22 GiB: not "21,504 MiB"
    got = tab.rss.points("RSS")
    assert [y for _, y in got] == pytest.approx([r["server_rss"] / GiB for r in rows])


# ---------------------------------------------------------------- a stopped server
def test_stopped_overview_names_the_model_and_the_plans_slots(
    qtbot: Any, tmp_path: Path, start_app: Launch, tiny_model: Path
) -> None:
    """Before the first start the status names no model and its slot map holds the
    settings' placeholder (2); the Overview says what the start will launch."""
    paths = prepare(tmp_path, **{"server.model": str(tiny_model), "server.slots": 0})
    app = start_app(tmp_path, tray_available=False)
    qtbot.waitUntil(lambda: app.core.running and app.controller.status is not None, timeout=30_000)
    assert app.dashboard is not None
    tab = app.dashboard.page("overview")
    assert isinstance(tab, OverviewTab)
    qtbot.waitUntil(lambda: tab.launch_preview is not None, timeout=30_000)
    qtbot.waitUntil(lambda: "tiny.gguf" in tab.facts["model"].text(), timeout=10_000)
    want = preview(app.backend.settings, paths)
    assert want.slots == 4  # the fit plan's three agent slots and one for side calls
    assert tab.facts["model"].text().startswith("tiny.gguf")
    assert "Start model + cache" in tab.facts["model"].text()
    assert tab.facts["model"].toolTip() == str(tiny_model)
    qtbot.waitUntil(lambda: tab.facts["slots"].text() == f"starts with {slots_text(want)}")
    assert "2 slots" not in tab.facts["slots"].text()


# ---------------------------------------------------------------- refreshing a table
def test_refilling_a_table_with_a_selected_row_measures_each_cell_once(qtbot: Any) -> None:
    """Columns sized to their contents were measured again for every replaced item once a
    row was selected: 200 × 13 cells took 80 s per refresh (every 5 s on Requests)."""
    from app.dashboard.base import fill, table

    calls = [0]

    class Counting(QtWidgets.QStyledItemDelegate):
        def sizeHint(self, option: Any, index: Any) -> QtCore.QSize:
            calls[0] += 1
            return super().sizeHint(option, index)

    t = table(["a", "b", "c", "d"])
    qtbot.addWidget(t)
    t.setItemDelegate(Counting(t))
    t.show()
    rows = [[f"r{i}", i, "x" * (i % 7), 3.5] for i in range(60)]
    fill(t, rows)
    t.selectRow(1)
    QtWidgets.QApplication.processEvents()
    calls[0] = 0
    fill(t, rows)
    QtWidgets.QApplication.processEvents()
    assert calls[0] <= 4 * 60 * 4  # was 43,200: every cell, for every cell replaced
