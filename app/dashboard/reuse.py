"""Reuse: hit rate over time, cached vs new prompt tokens, TTFB warm vs cold,
per-client hit rates and the last divergences (where a prompt stopped matching)."""

from __future__ import annotations

import math
from typing import Any

from app import fmt
from app.charts import BarChart, TimeChart
from app.dashboard.base import Request, Tab, ViewContext, fill, table
from app.dashboard.buckets import BucketCache
from app.qt import QtWidgets
from core.events import CacheEventKind
from core.status import ClientRow
from core.telemetry import BUCKETS
from core.telemetry.rows import EventRow, TtfbMedians

# bucket → (label, window in seconds)
WINDOWS: dict[str, tuple[str, int]] = {
    "minute": ("Minute buckets — last hour", 3600),
    "hour": ("Hour buckets — last 24 hours", 86400),
    "day": ("Day buckets — last 30 days", 30 * 86400),
}
TOP_CLIENTS = 8
# TTFB medians and per-client rates read every request of their period; past a day
# that is seconds of work at a million rows (see docs/gui.md), so they cover the last
# 24 hours at most while the hit-rate and token charts follow the chosen window.
DETAIL_MAX_S = 86400


def window(bucket: str, now: float) -> tuple[float, float, int]:
    """(since, until, bucket size): `since` on a bucket boundary so every bucket is whole."""
    size = BUCKETS[bucket]
    span = WINDOWS[bucket][1]
    since = math.floor((now - span) / size) * size + size
    return float(since), now, size


def ttfb_bars(t: TtfbMedians) -> list[tuple[str, float]]:
    """(label, median ms) bars: prefill warm/cold, then streamed first byte warm/cold."""
    medians = (
        ("prefill warm", t["warm_prefill"], t["warm_prefill_n"]),
        ("prefill cold", t["cold_prefill"], t["cold_prefill_n"]),
        ("first byte warm", t["warm"], t["warm_n"]),
        ("first byte cold", t["cold"], t["cold_n"]),
    )
    return [(f"{what} (n={n:,})", round(ms or 0.0, 1)) for what, ms, n in medians if n]


class ReuseTab(Tab):
    title = "Reuse"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        self.buckets = BucketCache()
        self.tokens_divisor = 1.0  # the token chart shows tokens / this
        self.span: tuple[float, float, int] = (0.0, 0.0, 60)
        row = QtWidgets.QHBoxLayout()
        row.addWidget(QtWidgets.QLabel("Show:"))
        self.bucket = QtWidgets.QComboBox()
        for key, (label, _) in WINDOWS.items():
            self.bucket.addItem(label, key)
        self.bucket.currentIndexChanged.connect(lambda _i: self.refresh())  # cache is per bucket
        row.addWidget(self.bucket)
        row.addStretch(1)
        self.summary = QtWidgets.QLabel("")
        row.addWidget(self.summary)
        self.outer.addLayout(row)

        self.hit = TimeChart("Hit rate", "% of prompt tokens from cache", y_range=(0, 100))
        self.hit.add_line("hit rate", "green", points=True)
        self.hit.chart.legend().setVisible(False)
        self.tokens = TimeChart("Prompt tokens: cached vs new", "tokens")
        self.tokens.add_stacked_area("cached", "blue")
        self.tokens.add_stacked_area("new", "orange")
        self.ttfb = BarChart(
            "Prefill and first byte (median)",
            "ms",
            color_name="violet",
            value_text=lambda ms: fmt.duration(ms / 1000),
            scale=fmt.time_scale,  # 0–4 s reads better than 0–4000 ms
        )
        self.clients = BarChart(
            "Hit rate per client",
            "% cached",
            color_name="teal",
            value_text=lambda v: f"{v:.1f} %",
            value_range=(0, 100),
        )
        grid = QtWidgets.QGridLayout()
        grid.addWidget(self.hit, 0, 0)
        grid.addWidget(self.tokens, 0, 1)
        grid.addWidget(self.ttfb, 1, 0)
        grid.addWidget(self.clients, 1, 1)
        grid.setRowStretch(0, 3)
        grid.setRowStretch(1, 2)
        self.outer.addLayout(grid, 1)
        self.outer.addWidget(QtWidgets.QLabel("<b>Last divergences</b> — why a prompt reused less"))
        self.divergences = table(["time", "client", "slot", "reused", "reason"], stretch=4)
        self.divergences.setMaximumHeight(150)
        self.outer.addWidget(self.divergences)

    @property
    def current_bucket(self) -> str:
        return str(self.bucket.currentData())

    def requests(self) -> dict[str, Request]:
        now = self.ctx.clock()
        bucket = self.current_bucket
        since, until, size = window(bucket, now)
        self.span = (since, until, size)
        q_since = self.buckets.query_since(bucket, since, now)
        detail = max(since, now - DETAIL_MAX_S)
        return {
            "hit": ("hit_rate", {"bucket": bucket, "since": q_since, "until": until}),
            "ttfb": ("ttfb", {"since": detail}),
            "clients": ("per_client", {"since": detail}),
            "divergences": (
                "recent_events",
                {"category": "cache", "kind": CacheEventKind.DIVERGENCE.value, "limit": 10},
            ),
        }

    def apply(self, results: dict[str, Any]) -> None:
        kw = self.last_requests["hit"][1]
        bucket = kw["bucket"]
        since, until, size = self.span
        period = "last hour" if until - since <= 3600 else "last 24 hours"
        self.ttfb.chart.setTitle(f"Prefill and streamed first byte (median, {period})")
        self.clients.chart.setTitle(f"Hit rate per client ({period})")
        if "hit" in results:
            rows = self.buckets.merge(bucket, since, kw["since"], results["hit"], self.ctx.clock())
            self.apply_hit(rows, since, until, size)
        if "ttfb" in results:
            self.apply_ttfb(results["ttfb"])
        if "clients" in results:
            self.apply_clients(results["clients"])
        if "divergences" in results:
            self.apply_divergences(results["divergences"])

    def apply_hit(self, rows: list[dict[str, Any]], since: float, until: float, size: int) -> None:
        for chart in (self.hit, self.tokens):
            chart.set_x_range(since, max(until, since + size))
        if not rows:
            msg = "No requests in this window yet. Point a client at the proxy to see reuse here."
            self.hit.show_message(msg)
            self.tokens.show_message(msg)
            self.summary.setText("")
            return
        self.hit.show_chart()
        self.tokens.show_chart()
        self.hit.set_line(
            "hit rate",
            [(r["bucket"], r["hit_ratio"] * 100) for r in rows if r["hit_ratio"] is not None],
        )
        by_bucket = {r["bucket"]: r for r in rows}
        cached: list[tuple[float, float]] = []
        new: list[tuple[float, float]] = []
        b = since
        while b < until:
            r = by_bucket.get(b)
            for x in (b, b + size):
                cached.append((x, float(r["cached"]) if r else 0.0))
                new.append((x, float(r["new"]) if r else 0.0))
            b += size
        top = max((c + n for (_, c), (_, n) in zip(cached, new, strict=True)), default=0.0)
        self.tokens_divisor, unit = (
            (1e6, "millions") if top >= 2e6 else (1e3, "thousands") if top >= 2e4 else (1.0, "")
        )
        d = self.tokens_divisor
        self.tokens.axis_y.setTitleText(f"tokens ({unit})" if unit else "tokens")
        self.tokens.set_stacked(
            {"cached": [(x, y / d) for x, y in cached], "new": [(x, y / d) for x, y in new]}
        )
        self.tokens.fit_y()
        total_c = sum(r["cached"] for r in rows)
        total = sum(r["total"] for r in rows)
        n = sum(r["requests"] for r in rows)
        self.summary.setText(
            f"{n:,} requests · {fmt.count(total_c)} of {fmt.count(total)} prompt tokens cached "
            f"({fmt.pct(total_c / total if total else None)})"
        )

    def apply_ttfb(self, t: TtfbMedians) -> None:
        """Prefill time warm vs cold (what the cache saves), then the first byte of streamed
        requests warm vs cold; a non-streamed first byte includes generation and is left out."""
        if not t["warm_prefill_n"] and not t["cold_prefill_n"]:
            self.ttfb.show_message("No requests with timings in this window yet.")
            return
        self.ttfb.show_chart()
        self.ttfb.set_bars(ttfb_bars(t))

    def apply_clients(self, rows: list[ClientRow]) -> None:
        rated = [(r, ratio) for r in rows if (ratio := r["hit_ratio"]) is not None][:TOP_CLIENTS]
        if not rated:
            self.clients.show_message("No client has sent a request in this window yet.")
            return
        self.clients.show_chart()
        self.clients.set_bars(
            [
                (f"{r['client'] or '?'} ({r['requests']:,})", round(ratio * 100, 1))
                for r, ratio in rated
            ]
        )

    def apply_divergences(self, rows: list[EventRow]) -> None:
        fill(
            self.divergences,
            [
                [
                    fmt.clock(r["ts"], with_date=True),
                    str(r["details"].get("client", "")),
                    r["slot"],
                    r["tokens"],
                    r["reason"] or "",
                ]
                for r in rows
            ],
        )
