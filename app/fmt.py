"""Formatting numbers for people: percentages, sizes, durations, times."""

from __future__ import annotations

import datetime as dt
import time


def pct(ratio: float | None, digits: int = 1) -> str:
    return "—" if ratio is None else f"{ratio * 100:.{digits}f} %"


def size(n: float | None) -> str:
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError


def count(n: float | None) -> str:
    if n is None:
        return "—"
    v = float(n)
    for div, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(v) >= div:
            return f"{v / div:.1f}{suffix}"
    return f"{v:.0f}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = float(seconds)
    neg = s < 0
    s = abs(s)
    if s < 1:
        out = f"{s * 1000:.0f} ms"
    elif s < 90:
        out = f"{s:.1f} s"
    elif s < 90 * 60:
        out = f"{s / 60:.0f} min"
    elif s < 48 * 3600:
        out = f"{s / 3600:.1f} h"
    else:
        out = f"{s / 86400:.1f} d"
    return f"-{out}" if neg else out


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
