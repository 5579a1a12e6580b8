"""The dashboard's Requests view shows why a request reused what it did: its summary in
the row, and on selection its prompt's sections with the divergence marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.dashboard.requests import RequestsTab
from core.cache.explain import event_of
from core.events import RequestCompleted
from tests.app.conftest import NOW, known_events

EXPLAINED = {
    "request_id": "req-why",
    "client": "claude-cli",
    "session": "s1",
    "slot": 0,
    "n_tokens": 2310,
    "cache_n": 1427,
    "prompt_n": 883,
    "previous_tokens": 2310,
    "divergence": {
        "token": 1427,
        "section": "system",
        "offset": 1427,
        "old_section": "system",
        "before": "Today's date: 2026-1",
        "old": "1-30",
        "new": "2-01",
    },
    "lost_tokens": 883,
    "cost_s": 0.57,
    "ms_per_token": 0.65,
    "note": "",
    "summary": "diverged at token 1,427 in system (1,427 tokens into it)",
    "sections": [
        {"name": "system", "start": 0, "n_tokens": 1441},
        {"name": "tool Read", "start": 1441, "n_tokens": 347},
        {"name": "message 2 (user)", "start": 1788, "n_tokens": 522},
    ],
    "compute_ms": 38.1,
}


@pytest.fixture
def known_db(tmp_path: Path) -> Path:
    from core.telemetry import Telemetry

    path = tmp_path / "telemetry.sqlite3"
    tel = Telemetry(path, clock=lambda: NOW)
    for ev in known_events():
        tel.record(ev)
    tel.record(
        RequestCompleted(
            request_id="req-why",
            client="claude-cli",
            session="s1",
            endpoint="chat",
            stream=False,
            has_tools=True,
            status=200,
            slot=0,
            prompt_n=883,
            cache_n=1427,
            ts=NOW - 1,
        )
    )
    tel.record(event_of(EXPLAINED))
    tel.close()
    return path


def test_a_request_row_says_why_and_expands_to_its_sections(qtbot: Any, offline: Any) -> None:
    tab = RequestsTab(offline)
    qtbot.addWidget(tab)
    before = tab.refresh_count
    tab.refresh()
    qtbot.waitUntil(lambda: tab.refresh_count > before and not tab.busy, timeout=10_000)
    assert not tab.last_errors, tab.last_errors
    row = next(i for i, r in enumerate(tab.rows) if r["request_id"] == "req-why")
    assert tab.table.item(row, 12).text() == EXPLAINED["summary"]
    tab.table.selectRow(row)
    top = tab.why.topLevelItem(0)
    assert top.text(0) == f"why: {EXPLAINED['summary']}"
    sections = [top.child(i) for i in range(top.childCount())]
    assert [s.text(0) for s in sections] == ["system", "tool Read", "message 2 (user)"]
    assert [s.text(2) for s in sections] == ["1,441", "347", "522"]
    assert sections[0].text(3) == "← diverged at token 1,427" and sections[1].text(3) == ""
    assert "'1-30' → '2-01'" in sections[0].child(0).text(0)
    assert tab.why.currentItem() is sections[0]
    # Another request without an explanation: nothing stale stays on screen.
    tab.table.selectRow(next(i for i, r in enumerate(tab.rows) if r["request_id"] != "req-why"))
    assert tab.why.topLevelItemCount() == 0


def test_a_request_not_yet_explained_is_explained_when_selected(qtbot: Any, known_db: Path) -> None:
    """The core explains on demand (core.cache.explain): selecting a row without an
    explanation asks for one and shows it when it comes."""
    from app.backend import TelemetryBackend
    from app.dashboard import ViewContext
    from app.tasks import Tasks
    from tests.fixtures import demo_data as demo

    asked: list[str] = []

    def explain(request_id: str) -> dict[str, Any] | None:
        asked.append(request_id)
        return {**EXPLAINED, "request_id": request_id, "summary": "made on demand"}

    backend = TelemetryBackend(
        known_db, snapshot=demo.status(NOW), clock=lambda: NOW, commands={"explain": explain}
    )
    tasks = Tasks()
    try:
        tab = RequestsTab(ViewContext(backend=backend, tasks=tasks, clock=lambda: NOW))
        qtbot.addWidget(tab)
        tab.refresh()
        qtbot.waitUntil(lambda: tab.refresh_count > 0 and not tab.busy, timeout=10_000)
        row = next(i for i, r in enumerate(tab.rows) if r["request_id"] != "req-why")
        rid = tab.rows[row]["request_id"]
        tab.table.selectRow(row)
        qtbot.waitUntil(
            lambda: (
                tab.why.topLevelItemCount() == 1
                and tab.why.topLevelItem(0).text(0) == "why: made on demand"
            ),
            timeout=10_000,
        )
        assert asked == [rid]
        # Selected again: the explanation is kept, not asked for twice.
        tab.table.clearSelection()
        tab.table.selectRow(row)
        assert asked == [rid] and tab.why.topLevelItem(0).text(0) == "why: made on demand"
    finally:
        backend.close()
        tasks.shutdown()
        tasks.deleteLater()
