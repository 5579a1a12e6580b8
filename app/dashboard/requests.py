"""Requests: the last requests with their reuse (cached vs new tokens), prefill time,
slot, session and kind; selecting one shows all its fields and, where the cache
broke, the divergence (which token, what changed)."""

from __future__ import annotations

import json
from typing import Any

from app import fmt
from app.dashboard.base import Request, Tab, ViewContext, fill, table
from app.qt import QtWidgets
from core.events import CacheEventKind

LIMIT = 200


def hit_ratio(r: dict[str, Any]) -> float | None:
    total = (r.get("cache_n") or 0) + (r.get("prompt_n") or 0)
    return (r.get("cache_n") or 0) / total if total else None


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
            ],
            stretch=11,
        )
        self.table.setWordWrap(False)
        self.table.itemSelectionChanged.connect(self._show_details)
        self.outer.addWidget(self.table, 1)
        self.details = QtWidgets.QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setMaximumHeight(150)
        self.details.setPlaceholderText("Select a request to see all its fields.")
        self.outer.addWidget(self.details)
        self.rows: list[dict[str, Any]] = []
        self.divergences: dict[str, dict[str, Any]] = {}

    def requests(self) -> dict[str, Request]:
        return {
            "requests": ("recent_requests", {"limit": LIMIT}),
            "divergences": (
                "recent_events",
                {"limit": 100, "category": "cache", "kind": CacheEventKind.DIVERGENCE.value},
            ),
        }

    def apply(self, results: dict[str, Any]) -> None:
        if "divergences" in results:
            self.divergences = {
                str(e["details"].get("request_id")): e
                for e in results["divergences"]
                if e.get("details", {}).get("request_id")
            }
        if "requests" not in results:
            return
        self.rows = results["requests"]
        fill(
            self.table,
            [
                [
                    fmt.clock(r["ts"]),
                    r.get("client") or "",
                    r.get("session") or "",
                    r.get("kind") or "",
                    r.get("status"),
                    r.get("slot"),
                    r.get("cache_n"),
                    r.get("prompt_n"),
                    fmt.pct(hit_ratio(r)),
                    fmt.duration((r["prompt_ms"] or 0) / 1000) if r.get("prompt_ms") else "—",
                    fmt.duration(r["ttfb_ms"] / 1000) if r.get("ttfb_ms") else "—",
                    ("cache broke: " if r.get("request_id") in self.divergences else "")
                    + (r.get("error") or ""),
                ]
                for r in self.rows
            ],
        )

    def _show_details(self) -> None:
        picked = self.table.selectionModel().selectedRows()
        if not picked or picked[0].row() >= len(self.rows):
            self.details.clear()
            return
        r = self.rows[picked[0].row()]
        text = json.dumps(r, indent=1, default=str)
        div = self.divergences.get(str(r.get("request_id")))
        if div is not None:
            text = f"Divergence: {div['reason']}\n\n{text}"
        self.details.setPlainText(text)
