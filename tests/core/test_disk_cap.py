"""The disk cap at save time (core.cache.retention.Retention.make_room): room is made by
the retention rules before a save is written, a save that cannot fit deletes nothing,
and the saves under way count. Real files and a real index in a temporary folder; the
real-server case (many saves, the shutdown's) is in tests/integration/test_reliability.py.
"""

from __future__ import annotations

from pathlib import Path

from core.cache.retention_plan import MIB
from core.config import Settings
from tests.core.bg_support import IDENT, add_state, make_manager

STATE = MIB - 4096  # a state a little under 1 MiB: its record fits beside it in the MiB


def settings(**cache: object) -> Settings:
    s = Settings()
    for k, v in cache.items():
        setattr(s.cache, k, v)
    return s


def test_a_save_makes_room_oldest_first(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=1, disk_cap_mb=5))
    recs = [add_state(core, mgr, name_seed=f"s{i}", size=STATE, age=60.0 * i) for i in range(4)]
    assert mgr.retention.make_room(2 * MIB, "the 4000-token conversation") is None
    left = {r.filename for r in mgr.state.store.all()}
    assert left == {r.filename for r in recs[:3]}  # the oldest went: 3 + 2 MiB fit in 5
    (ev,) = core.cache_events("evicted")
    assert ev.details["rule"] == "cap" and ev.details["file"] == recs[3].filename
    assert "+ 2.0 MiB being saved > cap 5.0 MiB" in ev.reason, ev.reason
    assert not (core.paths.slot_dir / IDENT / recs[3].filename).exists()


def test_a_save_that_cannot_fit_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=3, disk_cap_mb=3))
    recs = [add_state(core, mgr, name_seed=f"k{i}", size=STATE, age=float(i)) for i in range(3)]
    why = mgr.retention.make_room(MIB, "the 2000-token prefix")
    assert why is not None and "the 2000-token prefix (1.0 MiB)" in why
    assert "disk cap of 3.0 MiB (cache.disk_cap_mb)" in why
    assert {r.filename for r in mgr.state.store.all()} == {r.filename for r in recs}
    assert not core.cache_events("evicted")


def test_saves_under_way_count_but_not_the_one_checked(tmp_path: Path) -> None:
    """A file the server is writing (journaled, not indexed) takes disk like any other;
    once written, the save is checked with its own size, not counted twice."""
    core, mgr = make_manager(tmp_path, settings(keep_recent=0, disk_cap_mb=3))
    old = add_state(core, mgr, name_seed="old", size=STATE, age=100.0)
    busy = add_state(core, mgr, name_seed="busy", size=2 * MIB, write_file=True)
    mgr.state.store.table.delete_where("filename = ?", [busy.filename])  # written, not indexed
    mgr.retention.journal.begin(IDENT, busy.filename)
    # Another save of 0.5 MiB: 1 + 2 (under way) + 0.5 > 3, so the old state goes.
    assert mgr.retention.make_room(MIB // 2, "another save") is None
    assert mgr.state.store.get(old.filename) is None
    # The busy save, now written, checked with its own size: it fits alone.
    assert mgr.retention.make_room(2 * MIB, "the busy save", written=busy.filename) is None


def test_the_estimate_comes_from_the_servers_saved_states(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings())
    record = mgr.retention.record_bytes(100)
    assert mgr.retention.estimate_bytes(100) == record  # nothing saved yet: its record only
    add_state(core, mgr, name_seed="a", size=10_000)  # 10 tokens (bg_support), 1,000 B each
    assert mgr.retention.estimate_bytes(100) == 100_000 + record
