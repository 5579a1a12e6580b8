"""Failed saves: what the check after a save says, and the per-prefix backoff.

The real faults (a full disk during a real save, an undeletable file, kill -9 during a
save) are in tests/integration/test_disk_faults.py; these pin the pieces down.
"""

from __future__ import annotations

from pathlib import Path

from core.cache.saving import SaveBackoff, save_problem


def test_a_save_check_says_what_really_failed(tmp_path: Path) -> None:
    path = tmp_path / "ws-00000000000000000000000000000000.bin"
    # The old message read "server saved 2008 tokens, expected 2008" when the file was
    # missing: the count was fine, the file was not.
    missing = save_problem({"n_saved": 2008, "n_written": 5000}, 2008, path)
    assert missing == (f"the server reported saving 2008 tokens but left no file {path.name}")
    path.write_bytes(b"x" * 4000)
    short = save_problem({"n_saved": 2008, "n_written": 5000}, 2008, path)
    assert short == "the file holds 4000 bytes but the server reported writing 5000 (disk full?)"
    fewer = save_problem({"n_saved": 2000, "n_written": 4000}, 2008, path)
    assert fewer == "the server saved 2000 tokens of the 2008-token prefix"
    assert save_problem({"n_saved": 2008, "n_written": 4000}, 2008, path) is None
    assert save_problem({"n_saved": 2008}, 2008, path) is None  # a server without n_written


def test_save_backoff_doubles_to_its_cap_and_a_success_ends_it() -> None:
    now = [1000.0]
    b = SaveBackoff(lambda: now[0], first=30.0, cap=1800.0)
    assert b.allows("fp")
    delays = []
    for _ in range(8):
        n, delay = b.failed("fp", "disk full")
        delays.append(delay)
        assert not b.allows("fp") and b.allows("other")
        now[0] += delay - 0.5
        assert not b.allows("fp")
        now[0] += 0.5
        assert b.allows("fp")
    assert delays == [30, 60, 120, 240, 480, 960, 1800, 1800]
    assert n == 8
    b.failed("fp", "disk full")
    assert b.status()[0]["failures"] == 9 and b.status()[0]["reason"] == "disk full"
    b.succeeded("fp")
    assert b.allows("fp") and b.status() == []
    assert b.failed("fp", "again") == (1, 30.0)  # counting starts over after a success
