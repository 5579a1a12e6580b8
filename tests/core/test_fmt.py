"""core.fmt: one way to write sizes and durations for people (CLI, status, events, tray)."""

from __future__ import annotations

from core import fmt


def test_sizes_are_binary_units() -> None:
    assert [fmt.size(n) for n in (1, 1536, 5 << 20, int(105.7 * 2**20), 3 << 30)] == [
        "1 B", "1.5 KiB", "5.0 MiB", "105.7 MiB", "3.0 GiB"
    ]  # fmt: skip
    assert fmt.size(None) == "—"


def test_durations_pick_their_unit() -> None:
    assert [fmt.duration(s) for s in (0.0068, 0.495, 2.98, 300, 7200, 3 * 86400)] == [
        "6.8 ms", "495 ms", "3.0 s", "5 min", "2.0 h", "3.0 d"
    ]  # fmt: skip
    assert fmt.duration(-2.0) == "-2.0 s"
