"""Sessions: every (client, session) pair with its requests, reuse and slot, so two
agents of one client show apart — and a warning when agents outnumber agent slots."""

from __future__ import annotations

from typing import Any

from app import fmt
from app.dashboard.base import Request, Tab, ViewContext, fill, table
from app.qt import QtWidgets
from core.cache.crowding import crowding
from core.status import SessionRow, cache_of

SINCE = {"last hour": 3600, "last 24 hours": 86400, "last 7 days": 7 * 86400}


class SessionsTab(Tab):
    title = "Sessions"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        row = QtWidgets.QHBoxLayout()
        self.since = QtWidgets.QComboBox()
        for label, secs in SINCE.items():
            self.since.addItem(label, secs)
        self.since.setCurrentIndex(1)
        self.since.currentIndexChanged.connect(lambda _i: self.refresh())
        row.addWidget(QtWidgets.QLabel("Time:"))
        row.addWidget(self.since)
        row.addStretch(1)
        self.outer.addLayout(row)
        self.warning = QtWidgets.QLabel("")
        self.warning.setObjectName("crowding")
        self.warning.setWordWrap(True)
        self.warning.setProperty("role", "warning")
        self.warning.hide()
        self.outer.addWidget(self.warning)
        self.table = table(
            [
                "client",
                "session",
                "kinds",
                "requests",
                "hit rate",
                "cached tokens",
                "new tokens",
                "prefill",
                "last seen",
                "slot now",
            ],
            stretch=1,
        )
        self.outer.addWidget(self.table, 1)
        self.rows: list[SessionRow] = []

    def requests(self) -> dict[str, Request]:
        since = self.ctx.clock() - float(self.since.currentData())
        return {"sessions": ("sessions", {"since": since}), "status": ("status", {})}

    def apply(self, results: dict[str, Any]) -> None:
        cache = cache_of(results.get("status"))
        slots = cache["slots"] if cache is not None else []
        in_slot = {s["session"]: s["id"] for s in slots if s["session"]}
        if "sessions" in results:
            self.rows = results["sessions"]
        now = self.ctx.clock()
        fill(
            self.table,
            [
                [
                    r["client"],
                    r["session"] or "(none)",
                    r["kinds"] or "",
                    r["requests"],
                    fmt.pct(r["hit_ratio"]),
                    r["cached"],
                    r["new"],
                    fmt.duration(r["prefill_ms"] / 1000),
                    fmt.ago(r["last_seen"], now),
                    in_slot.get(r["session"], "—") if r["session"] else "—",
                ]
                for r in self.rows
            ],
        )
        text = crowding(self.rows, cache, now)
        self.warning.setText(text)
        self.warning.setVisible(bool(text))
