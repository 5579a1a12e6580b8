"""Events: the cache and server history (evictions, saves, restores, divergences,
state changes), filterable by category, kind, time and text, with reasons."""

from __future__ import annotations

import json
from typing import Any

from app import fmt
from app.charts import tone
from app.dashboard.base import (
    Request,
    Tab,
    ViewContext,
    fill_keeping_selection,
    selected_key,
    table,
)
from app.qt import QtWidgets
from core.events import CacheEventKind
from core.telemetry.rows import EventRow

CATEGORIES = ["all", "cache", "server", "pressure", "notice", "build", "settings"]
# The cache event kinds the kind filter offers (any other can be typed in).
CACHE_KINDS = [
    CacheEventKind.EVICTED,
    CacheEventKind.INVALIDATED,
    CacheEventKind.SAVE,
    CacheEventKind.SAVE_FAILED,
    CacheEventKind.UNDELETABLE,
    CacheEventKind.RESTORE_OK,
    CacheEventKind.RESTORE_REJECTED,
    CacheEventKind.PREWARM_HIT,
    CacheEventKind.PREWARM_COLD,
    CacheEventKind.REWARM,
    CacheEventKind.KEEPALIVE,
    CacheEventKind.PINNED,
    CacheEventKind.UNPINNED,
    CacheEventKind.DIVERGENCE,
    CacheEventKind.DISPLACED,
    CacheEventKind.PREFIX_LEARNED,
    CacheEventKind.SERVER_IDENTITY,
    CacheEventKind.IDENTITY_FAILED,
]
# Then kinds of other categories: server states, pressure levels, notice levels.
KNOWN_KINDS = [
    *(k.value for k in CACHE_KINDS),
    "ready",
    "failed",
    "low",
    "critical",
    "error",
    "warning",
]
SINCE = {
    "last 15 minutes": 900,
    "last hour": 3600,
    "last 24 hours": 86400,
    "last 7 days": 7 * 86400,
    "everything": 0,
}
LIMIT = 500
BAD = {
    CacheEventKind.INVALIDATED,
    CacheEventKind.RESTORE_REJECTED,
    CacheEventKind.SAVE_FAILED,
    CacheEventKind.UNDELETABLE,
    CacheEventKind.IDENTITY_FAILED,
    "failed",
    "error",
    CacheEventKind.EVICTED,
    "critical",
}


class EventsTab(Tab):
    title = "Events"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        row = QtWidgets.QHBoxLayout()
        self.category = QtWidgets.QComboBox()
        self.category.addItems(CATEGORIES)
        self.kind = QtWidgets.QComboBox()
        self.kind.setEditable(True)
        self.kind.addItems(["all", *KNOWN_KINDS])
        self.kind.setMinimumContentsLength(14)
        self.since = QtWidgets.QComboBox()
        for label, secs in SINCE.items():
            self.since.addItem(label, secs)
        self.since.setCurrentIndex(2)
        self.search = QtWidgets.QLineEdit()
        self.search.setPlaceholderText("filter reasons…")
        self.search.setClearButtonEnabled(True)
        for label, w in (
            ("Category:", self.category),
            ("Kind:", self.kind),
            ("Time:", self.since),
        ):
            row.addWidget(QtWidgets.QLabel(label))
            row.addWidget(w)
        row.addWidget(self.search, 1)
        self.outer.addLayout(row)
        self.category.currentIndexChanged.connect(lambda _i: self.refresh())
        self.kind.currentTextChanged.connect(lambda _t: self.refresh())
        self.since.currentIndexChanged.connect(lambda _i: self.refresh())
        self.search.textChanged.connect(lambda _t: self._draw())
        self.table = table(
            ["time", "category", "kind", "reason", "slot", "tokens", "size", "fingerprint"],
            stretch=3,
        )
        self.table.setWordWrap(False)
        self.table.itemSelectionChanged.connect(self._show_details)
        self.outer.addWidget(self.table, 1)
        self.details = QtWidgets.QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setMaximumHeight(110)
        self.details.setPlaceholderText("Select an event to see its details.")
        self.outer.addWidget(self.details)
        self.count_label = QtWidgets.QLabel("")
        self.outer.addWidget(self.count_label)
        self.rows: list[EventRow] = []
        self.shown: list[EventRow] = []

    def requests(self) -> dict[str, Request]:
        kw: dict[str, Any] = {"limit": LIMIT}
        cat = self.category.currentText()
        if cat != "all":
            kw["category"] = cat
        kind = self.kind.currentText().strip()
        if kind and kind != "all":
            kw["kind"] = kind
        secs = int(self.since.currentData())
        if secs:
            kw["since"] = self.ctx.clock() - secs
        return {"events": ("recent_events", kw)}

    def apply(self, results: dict[str, Any]) -> None:
        if "events" in results:
            self.rows = results["events"]
            self._draw()

    def _draw(self) -> None:
        needle = self.search.text().strip().lower()
        self.shown = [
            r
            for r in self.rows
            if not needle or needle in (r["reason"] or "").lower() or needle in r["kind"]
        ]
        fill_keeping_selection(
            self.table,
            [
                [
                    fmt.clock(r["ts"], with_date=True),
                    r["category"],
                    r["kind"],
                    r["reason"] or "",
                    r["slot"],
                    r["tokens"],
                    fmt.size(r["bytes"]) if r["bytes"] is not None else "",
                    r["fingerprint"] or "",
                ]
                for r in self.shown
            ],
            keys=[r["id"] for r in self.shown],
        )
        bad = tone("error", self.palette())
        for i, r in enumerate(self.shown):
            cell = self.table.item(i, 2)
            if r["kind"] in BAD and cell is not None:
                cell.setForeground(bad)
        more = " (newest first; narrow the filters to see older)" if len(self.rows) >= LIMIT else ""
        self.count_label.setText(f"{len(self.shown)} of {len(self.rows)} events{more}")

    def selected_event(self) -> EventRow | None:
        """The selected event (kept by its id across refreshes)."""
        key = selected_key(self.table)
        return next((r for r in self.shown if r["id"] == key), None)

    def _show_details(self) -> None:
        r = self.selected_event()
        if r is None:
            self.details.clear()
            return
        self.details.setPlainText(
            f"{r['category']}/{r['kind']}: {r['reason'] or ''}\n"
            + json.dumps(r["details"], indent=1, default=str)
        )
