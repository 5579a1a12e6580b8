"""Numbers for people, one way everywhere: the CLI, status lines, event reasons and
the tray format sizes, durations, counts and ratios with these functions.

Sizes are binary (KiB, MiB, GiB: what llama-server's own log and ``--cache-ram``
use), so a state the GUI shows as 105.7 MiB is 105.7 MiB in ``warmslot status``
too. A leaf module: no Warmslot imports.
"""

from __future__ import annotations

__all__ = ["count", "duration", "pct", "size"]

SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def size(n: float | None) -> str:
    """Bytes as B, KiB, MiB, GiB or TiB, one decimal ("—" for unknown)."""
    if n is None:
        return "—"
    value = float(n)
    for unit in SIZE_UNITS:
        if abs(value) < 1024 or unit == SIZE_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(n: float | None) -> str:
    """A count with a k, M or G suffix past a thousand ("—" for unknown)."""
    if n is None:
        return "—"
    v = float(n)
    for div, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(v) >= div:
            return f"{v / div:.1f}{suffix}"
    return f"{v:.0f}"


def duration(seconds: float | None) -> str:
    """Seconds in the unit that reads best: ms, s, min, h or d ("—" for unknown)."""
    if seconds is None:
        return "—"
    s = float(seconds)
    neg = s < 0
    s = abs(s)
    if s < 0.01:  # a warm prefill takes a few ms: "6.8 ms", not "7 ms"
        out = f"{s * 1000:.1f} ms"
    elif s < 1:
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


def pct(ratio: float | None, digits: int = 1) -> str:
    """A ratio (0–1) as a percentage ("—" for unknown)."""
    return "—" if ratio is None else f"{ratio * 100:.{digits}f} %"
