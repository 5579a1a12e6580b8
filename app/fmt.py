"""Formatting for the tray: core's numbers for people (`core.fmt`, shared with the CLI),
clock times, and the unit a chart axis shows its values in."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

from core.fmt import count, duration, pct, size

__all__ = [
    "Scale",
    "ago",
    "clock",
    "count",
    "duration",
    "pct",
    "size",
    "size_scale",
    "start_of_day",
    "time_scale",
]


def clock(ts: float | None, *, with_date: bool = False) -> str:
    if not ts:
        return "—"
    t = dt.datetime.fromtimestamp(ts)
    return t.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S")


def ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "—"
    now = time.time() if now is None else now
    return f"{duration(now - ts)} ago"


def start_of_day(now: float) -> float:
    d = dt.datetime.fromtimestamp(now)
    return d.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


@dataclass(frozen=True)
class Scale:
    """How an axis shows values: divided by `divisor`, titled `unit`, `decimals` places."""

    divisor: float
    unit: str
    decimals: int

    @property
    def label_format(self) -> str:
        return f"%.{self.decimals}f"

    def __call__(self, value: float) -> float:
        return value / self.divisor


def _decimals(top: float) -> int:
    # Ticks at a fifth of the range: below 10 they need a decimal to differ.
    return 1 if top < 10 else 0


def time_scale(top_ms: float) -> Scale:
    """The unit for durations in milliseconds whose largest is `top_ms`: ms up to 2 s,
    s up to 2 min, min beyond (an axis of 0–4000 "ms" reads better as 0–4 s)."""
    for divisor, unit in ((60_000.0, "min"), (1000.0, "s")):
        if top_ms >= 2 * divisor:
            return Scale(divisor, unit, _decimals(top_ms / divisor))
    return Scale(1.0, "ms", _decimals(top_ms))


def size_scale(top_bytes: float) -> Scale:
    """MiB up to 2 GiB, GiB beyond (llama-server's RSS of 22,000 MiB reads as 21.5 GiB)."""
    if top_bytes >= 2 * 2**30:
        return Scale(float(2**30), "GiB", _decimals(top_bytes / 2**30))
    return Scale(float(2**20), "MiB", _decimals(top_bytes / 2**20))
