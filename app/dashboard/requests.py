"""Requests: the last requests with their reuse (cached vs new tokens), prefill time,
slot, session and kind, and why (core.cache.explain); selecting one expands it: its
prompt's sections with their token counts and where it left its slot's previous
prompt (section, token, what changed, what it cost), then all its fields. A request
not explained yet is explained when selected (the core renders it on the server then,
never on the request's path)."""

from __future__ import annotations

import json
from typing import Any

from app import fmt
from app.dashboard.base import (
    Request,
    Tab,
    ViewContext,
    fill_keeping_selection,
    selected_key,
    table,
)
from app.qt import QtWidgets
from core.cache.explain import from_row
from core.events import CacheEventKind
from core.status import Explanation, RequestRow
from core.telemetry.rows import EventRow, ExplanationRow

LIMIT = 200


def hit_ratio(r: RequestRow) -> float | None:
    cached, new = r["cache_n"] or 0, r["prompt_n"] or 0
    return cached / (cached + new) if cached + new else None


class RequestsTab(Tab):
    title = "Requests"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        self.table = table(
            [
                "time",
                "client",
                "session",
                "kind",
                "status",
                "slot",
                "cached",
                "new",
                "hit",
                "prefill",
                "first byte",
                "error",
                "why",
            ],
            stretch=12,
        )
        self.table.setWordWrap(False)
        self.table.itemSelectionChanged.connect(self._show_details)
        self.outer.addWidget(self.table, 1)
        # The selected request's sections (a row each) under the line that says why.
        self.why = QtWidgets.QTreeWidget()
        self.why.setHeaderLabels(["section", "first token", "tokens", ""])
        self.why.setRootIsDecorated(True)
        self.why.setMaximumHeight(220)
        self.outer.addWidget(self.why)
        self.details = QtWidgets.QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setMaximumHeight(150)
        self.details.setPlaceholderText("Select a request to see all its fields.")
        self.outer.addWidget(self.details)
        self.rows: list[RequestRow] = []
        self.shown_request: str | None = None  # whose details are shown
        self.divergences: dict[str, EventRow] = {}
        self.explained: dict[str, Explanation] = {}

    def requests(self) -> dict[str, Request]:
        return {
            "requests": ("recent_requests", {"limit": LIMIT}),
            "divergences": (
                "recent_events",
                {"limit": 100, "category": "cache", "kind": CacheEventKind.DIVERGENCE.value},
            ),
            "explained": ("explanations", {"limit": LIMIT}),
        }

    def apply(self, results: dict[str, Any]) -> None:
        if "divergences" in results:
            events: list[EventRow] = results["divergences"]
            self.divergences = {
                str(e["details"]["request_id"]): e for e in events if e["details"].get("request_id")
            }
        if "explained" in results:
            rows: list[ExplanationRow] = results["explained"]
            self.explained = {e["request_id"]: from_row(e) for e in rows}
        if "requests" not in results:
            return
        self.rows = results["requests"]
        fill_keeping_selection(
            self.table,
            [
                [
                    fmt.clock(r["ts"]),
                    r["client"] or "",
                    r["session"] or "",
                    r["kind"] or "",
                    r["status"],
                    r["slot"],
                    r["cache_n"],
                    r["prompt_n"],
                    fmt.pct(hit_ratio(r)),
                    fmt.duration(r["prompt_ms"] / 1000) if r["prompt_ms"] else "—",
                    fmt.duration(r["ttfb_ms"] / 1000) if r["ttfb_ms"] else "—",
                    ("cache broke: " if r["request_id"] in self.divergences else "")
                    + (r["error"] or ""),
                    self._summary(r["request_id"]),
                ]
                for r in self.rows
            ],
            keys=[r["request_id"] for r in self.rows],
        )

    def _summary(self, request_id: str) -> str:
        rec = self.explained.get(request_id)
        return rec["summary"] if rec is not None else ""

    def selected_request(self) -> RequestRow | None:
        """The selected request (kept by its id while newer ones arrive above it)."""
        key = selected_key(self.table)
        return next((r for r in self.rows if r["request_id"] == key), None)

    def _show_details(self) -> None:
        r = self.selected_request()
        if r is not None and self.shown_request == r["request_id"]:
            return  # the same request after a refresh: keep its expanded sections
        self.why.clear()
        self.shown_request = r["request_id"] if r is not None else None
        if r is None:
            self.details.clear()
            return
        text = json.dumps(r, indent=1, default=str)
        div = self.divergences.get(r["request_id"])
        if div is not None:
            text = f"Divergence: {div['reason']}\n\n{text}"
        self.details.setPlainText(text)
        rec = self.explained.get(r["request_id"])
        if rec is not None:
            self.show_why(rec)
        elif self.ctx.backend.supports("explain"):
            rid = r["request_id"]
            self.why.addTopLevelItem(QtWidgets.QTreeWidgetItem(["why: explaining…", "", "", ""]))
            self.ctx.tasks.watch(
                self.ctx.backend.command("explain", rid),
                lambda found: self._explained(rid, found),
                lambda exc: self._explained(rid, None),
                owner=self,
            )

    def _explained(self, request_id: str, rec: Explanation | None) -> None:
        """An explanation asked for on selection arrived (None: none could be made)."""
        current = self.selected_request()
        if current is None or current["request_id"] != request_id:
            return  # another row is selected by now
        if rec is None:
            self.why.clear()
            self.why.addTopLevelItem(
                QtWidgets.QTreeWidgetItem(
                    ["why: not explained (the request is no longer kept)", "", "", ""]
                )
            )
            return
        self.explained[request_id] = rec
        self.show_why(rec)

    def show_why(self, rec: Explanation) -> None:
        """The request's explanation as a tree: why, then its sections (the one where it
        diverged marked and selected)."""
        self.why.clear()
        top = QtWidgets.QTreeWidgetItem(
            [f"why: {rec['summary'] or '—'}", "", f"{rec['n_tokens']:,}", ""]
        )
        self.why.addTopLevelItem(top)
        div = rec["divergence"]
        for s in rec.get("sections") or []:
            end = s["start"] + max(1, s["n_tokens"])
            inside = div is not None and s["start"] <= div["token"] < end
            mark = f"← diverged at token {div['token']:,}" if inside and div else ""
            item = QtWidgets.QTreeWidgetItem(
                [s["name"], f"{s['start']:,}", f"{s['n_tokens']:,}", mark]
            )
            top.addChild(item)
            if inside and div:
                item.addChild(
                    QtWidgets.QTreeWidgetItem(
                        [
                            f"…{div['before'][-40:]!r} then {div['old'][:40]!r} → "
                            f"{div['new'][:40]!r}",
                            "",
                            "",
                            "",
                        ]
                    )
                )
                item.setExpanded(True)
                self.why.setCurrentItem(item)
        if rec.get("note"):
            top.addChild(QtWidgets.QTreeWidgetItem([f"note: {rec['note']}", "", "", ""]))
        top.setExpanded(True)
        self.why.resizeColumnToContents(0)
