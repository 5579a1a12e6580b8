"""Retention: TTL classes, keep-recent, pinning, byte cap, foreign files, idle sessions.

Everything runs against a `FakeCore` (in-memory telemetry, a `FakeClock`) and
real files in a temporary slot directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.cache import retention as ret
from core.cache.deps import deps_from
from core.cache.fingerprint import state_filename
from core.cache.store import card_name
from core.config import Settings
from core.events import CacheEvent
from tests.core.bg_support import (
    IDENT,
    MB,
    OTHER,
    FakeCore,
    FakeManager,
    add_state,
    make_manager,
    prefix,
)

HOUR = 3600.0


def settings(**cache: object) -> Settings:
    s = Settings()
    for k, v in cache.items():
        setattr(s.cache, k, v)
    return s


def evicted(core: FakeCore) -> list[CacheEvent]:
    return core.cache_events("evicted")


def files(core: FakeCore, identity: str = IDENT, pattern: str = "*.bin") -> set[str]:
    """The slot files in an identity's directory (`pattern` "*.json": their records)."""
    d = core.paths.slot_dir / identity
    return {p.name for p in d.glob(pattern)} if d.is_dir() else set()


def test_ttl_classes_have_the_documented_defaults() -> None:
    c = Settings().cache
    assert [ret.ttl_seconds(c, k) for k in ("short", "long", "extended")] == [300, 3600, 86400]
    assert ret.class_for(c, "prefix") == "extended"
    assert ret.class_for(c, "conversation") == "long"
    assert ret.class_for(c, "aux") == "short"


@pytest.mark.parametrize("ttl_class,ttl", [("short", 300), ("long", 3600), ("extended", 86400)])
async def test_each_class_expires_after_its_ttl(tmp_path: Path, ttl_class: str, ttl: int) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=0))
    fresh = add_state(core, mgr, name_seed="fresh", age=ttl - 1, ttl_class=ttl_class)
    stale = add_state(core, mgr, name_seed="stale", age=ttl + 1, ttl_class=ttl_class)
    out = await mgr.retention.sweep_disk()
    assert out.actions == 1
    assert files(core) == {fresh.filename}
    assert files(core, pattern="*.json") == {card_name(fresh.filename)}  # its record went too
    assert mgr.state.store.get(stale.filename) is None
    (ev,) = evicted(core)
    assert ev.details["file"] == stale.filename and ev.details["rule"] == "expired"
    assert ev.bytes == MB and ev.details["age_s"] == ttl + 1
    assert f"{ttl_class} TTL" in ev.reason
    # Time passes: the fresh one expires too, exactly once its TTL is over.
    await core.clock.advance(2)
    await mgr.retention.sweep_disk()
    assert files(core) == set()


async def test_user_edited_ttl_applies_at_the_next_sweep(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=0, ttl_long_s=3 * 3600))
    rec = add_state(core, mgr, name_seed="a", age=2 * HOUR, ttl_class="long")
    await mgr.retention.sweep_disk()
    assert files(core) == {rec.filename}
    core.settings.cache.ttl_long_s = 3600
    await mgr.retention.sweep_disk()
    assert files(core) == set()


async def test_keeps_the_n_most_recently_used(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=3))
    recs = [
        add_state(core, mgr, name_seed=f"r{i}", age=2 * 86400 + i * HOUR, ttl_class="extended")
        for i in range(5)
    ]
    out = await mgr.retention.sweep_disk()
    assert out.actions == 2
    assert files(core) == {r.filename for r in recs[:3]}  # the three youngest


async def test_pinned_is_never_swept_by_ttl_or_cap(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=0, disk_cap_mb=1))
    pinned = add_state(core, mgr, name_seed="p", size=3 * MB, age=400 * 86400, pinned=True)
    await mgr.retention.sweep_disk()
    assert files(core) == {pinned.filename}
    assert not evicted(core)
    assert mgr.retention.last_plan is not None
    assert mgr.retention.last_plan.kept[pinned.filename] == "pinned"


async def test_current_prefix_is_never_deleted(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=0))
    rec = add_state(core, mgr, name_seed="cur", age=3 * 86400)
    mgr.state.slots.slots[0].prefix_fp = rec.fingerprint  # a slot holds it right now
    await mgr.retention.sweep_disk()
    assert files(core) == {rec.filename}
    mgr.state.slots.slots[0].prefix_fp = ""
    await mgr.retention.sweep_disk()
    assert files(core) == set()


async def test_byte_cap_evicts_oldest_first_and_events_add_up(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=1, disk_cap_mb=5))
    recs = [add_state(core, mgr, name_seed=f"c{i}", size=2 * MB, age=i * 60.0) for i in range(5)]
    before = mgr.state.store.total_bytes()
    out = await mgr.retention.sweep_disk()
    # 10 MiB > 5 MiB: delete the oldest until ≤ 5 MiB → three go, the two youngest stay.
    assert files(core) == {recs[0].filename, recs[1].filename}
    order = [e.details["file"] for e in evicted(core)]
    assert order == [recs[4].filename, recs[3].filename, recs[2].filename]
    assert all(e.details["rule"] == "cap" for e in evicted(core))
    freed = sum(e.bytes or 0 for e in evicted(core))
    assert freed == before - mgr.state.store.total_bytes() == out.details["freed_bytes"] == 6 * MB


async def test_keep_recent_beats_the_cap(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=2, disk_cap_mb=1))
    recs = [add_state(core, mgr, name_seed=f"k{i}", size=2 * MB, age=i) for i in range(3)]
    await mgr.retention.sweep_disk()
    assert files(core) == {recs[0].filename, recs[1].filename}


def test_default_cap_is_a_tenth_of_free_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Usage:
        total, used, free = 1000 * MB, 500 * MB, 500 * MB

    monkeypatch.setattr(ret.shutil, "disk_usage", lambda p: Usage)
    assert ret.default_cap_bytes(tmp_path / "not" / "yet") == 50 * MB
    core = FakeCore(tmp_path)
    mgr = FakeManager(deps_from(core))  # type: ignore[arg-type]
    assert mgr.retention.cap_bytes == 50 * MB  # cache.disk_cap_mb = 0
    core.settings.cache.disk_cap_mb = 7
    assert mgr.retention.cap_bytes == 7 * MB


async def test_other_identities_age_out_and_go_first_under_the_cap(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=3, disk_cap_mb=5))
    ours = [add_state(core, mgr, name_seed=f"o{i}", size=MB, age=10 * 86400) for i in range(2)]
    theirs_old = add_state(core, mgr, name_seed="t0", age=2 * 86400, identity=OTHER)
    theirs_new = add_state(core, mgr, name_seed="t1", size=4 * MB, age=60, identity=OTHER)
    await mgr.retention.sweep_disk()
    # Ours are expired but among the 3 most recent of the running server: kept.
    assert files(core) == {r.filename for r in ours}
    # Theirs: not protected by keep-recent, so the expired one ages out; the cap
    # (2 + 4 MiB > 5 MiB) takes the other identity's file before any of ours.
    assert files(core, OTHER) == set()
    reasons = {e.details["file"]: e.reason for e in evicted(core)}
    assert "another server identity" in reasons[theirs_old.filename]
    assert "another server identity" in reasons[theirs_new.filename]


async def test_another_loaded_models_files_are_its_own_not_foreign(tmp_path: Path) -> None:
    """The same files as above, but OTHER is the slot directory of a second model the
    engine runs: the one sweep over the shared index keeps each model's recent files
    and what its slots hold."""
    core, mgr = make_manager(tmp_path, settings(keep_recent=3, disk_cap_mb=5))
    peer = FakeManager(
        deps_from(
            core,  # type: ignore[arg-type]
            SimpleNamespace(resolved=SimpleNamespace(slot_dir=core.paths.slot_dir / OTHER)),  # type: ignore[arg-type]
            model="b",
        )
    )
    ours = [add_state(core, mgr, name_seed=f"o{i}", size=MB, age=10 * 86400) for i in range(2)]
    theirs_old = add_state(core, mgr, name_seed="t0", age=2 * 86400, identity=OTHER)
    theirs_new = add_state(core, mgr, name_seed="t1", size=4 * MB, age=60, identity=OTHER)
    peer.state.slots.slots[0].prefix_fp = theirs_new.fingerprint  # b's slot holds it right now
    await mgr.retention.sweep_disk(peers=[peer])
    assert files(core) == {r.filename for r in ours}
    # b's expired file is among b's 3 most recent; the larger one is current in b's slot
    # (the cap cannot be met: everything left is protected).
    assert files(core, OTHER) == {theirs_old.filename, theirs_new.filename}
    assert evicted(core) == []
    kept = mgr.retention.last_plan.kept if mgr.retention.last_plan else {}
    assert kept[theirs_new.filename] == "current (held by a slot)"
    assert kept[theirs_old.filename] == "one of the 3 most recently used"


async def test_files_we_did_not_write_are_never_touched(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=0, disk_cap_mb=1))
    d = core.paths.slot_dir / IDENT
    d.mkdir(parents=True, exist_ok=True)
    theirs = d / state_filename("ab" * 32)  # our naming scheme, but no index row
    theirs.write_bytes(b"x" * (3 * MB))
    other = d / "notes.txt"
    other.write_text("mine")
    elsewhere = core.paths.slot_dir / "not-an-identity" / "ws-x.bin"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"y")
    rec = add_state(core, mgr, name_seed="ours", size=MB, age=10 * 86400)
    out = await mgr.retention.sweep_disk()
    assert theirs.exists() and other.exists() and elsewhere.exists()
    assert not (d / rec.filename).exists()
    assert out.details["unknown_files_left_alone"] == 3
    assert [e.details["file"] for e in evicted(core)] == [rec.filename]


async def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=5))
    gone = add_state(core, mgr, name_seed="gone", write_file=False)
    bad = add_state(core, mgr, name_seed="bad", size=MB)
    (core.paths.slot_dir / IDENT / bad.filename).write_bytes(b"short")  # truncated
    await mgr.retention.sweep_disk()
    assert mgr.state.store.get(gone.filename) is None and mgr.state.store.get(bad.filename) is None
    rules = {e.details["file"]: (e.details["rule"], e.bytes) for e in evicted(core)}
    assert rules == {gone.filename: ("missing", 0), bad.filename: ("corrupt", 5)}
    assert files(core) == set()


async def test_unfinished_save_leaves_no_row_and_its_file_is_swept(tmp_path: Path) -> None:
    """Atomicity: a save that dies half-way never gets an index row; the sweep cleans up."""
    core, mgr = make_manager(tmp_path, settings(keep_recent=5))
    assert mgr.fake is not None
    info = prefix(list(range(1, 41)))
    mgr.state.by_fp[info.fingerprint] = info
    mgr.fake.fail_save = True
    await mgr.ops.persist_now(info)
    name = state_filename(info.fingerprint)
    partial = core.paths.slot_dir / IDENT / name
    assert partial.exists()  # the server wrote half a file …
    assert mgr.state.store.get(name) is None  # … and no index row claims it
    assert core.cache_events("save_failed")
    await mgr.retention.sweep_disk()
    assert partial.exists()  # within the grace period it may still be writing
    await core.clock.advance(ret.UNFINISHED_GRACE_S + 1)
    out = await mgr.retention.sweep_disk()
    assert not partial.exists() and out.actions == 1
    (ev,) = evicted(core)
    assert ev.details["rule"] == "unfinished" and ev.bytes == 80
    assert mgr.retention.journal.pending() == []


async def test_finished_save_is_indexed_and_journal_cleared(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    info = prefix(list(range(1, 41)))
    mgr.state.by_fp[info.fingerprint] = info
    await mgr.ops.persist_now(info)
    rec = mgr.state.store.get(state_filename(info.fingerprint))
    assert rec is not None and rec.ttl_class == "extended"
    assert rec.created == core.clock.time()  # stamped by the injected clock
    assert mgr.retention.journal.pending() == []


# ------------------------------------------------------------------ idle sessions
def _session(mgr: object, slot: int, session: str, fp: str = "", kind: str = "agent") -> None:
    m = mgr  # a CacheManager
    st = m.state.slots.slots[slot]  # type: ignore[attr-defined]
    st.session, st.prefix_fp, st.last_kind = session, fp, kind
    st.last_used = m.clock.monotonic()  # type: ignore[attr-defined]
    st.tokens_hint = 100
    m.state.slots.sessions[session] = slot  # type: ignore[attr-defined]


async def test_idle_conversation_is_saved_and_released_after_its_ttl(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    info = prefix(list(range(1, 41)))
    mgr.state.by_fp[info.fingerprint] = info
    _session(mgr, 0, "ses-a", info.fingerprint)
    await core.clock.advance(3599)
    assert (await mgr.idle_release.sweep()).actions == 0
    await core.clock.advance(1)
    out = await mgr.idle_release.sweep()
    assert out.details["released"] == ["ses-a"]
    assert "ses-a" not in mgr.state.slots.sessions and mgr.state.slots.slots[0].session == ""
    (ev,) = evicted(core)
    assert ev.details["rule"] == "idle_session" and ev.details["ttl_class"] == "long"
    assert "long TTL" in ev.reason and "saving its prefix" in ev.reason
    # The prefix gets persisted in the background (the slot is free for it now).
    await asyncio.gather(*mgr._jobs)
    assert mgr.state.store.for_fingerprint(info.fingerprint) is not None
    # The next session gets the released slot.
    slot, _ = mgr.state.slots.pick("ses-b", "agent")
    assert slot == 0


async def test_idle_release_without_disk_tier_says_why(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    from core.cache.deps import DiskTier

    mgr.state.disk = DiskTier(False, "sliding-window model on an unpatched server")
    info = prefix(list(range(1, 41)))
    mgr.state.by_fp[info.fingerprint] = info
    _session(mgr, 0, "ses-a", info.fingerprint)
    await core.clock.advance(3600)
    await mgr.idle_release.sweep()
    (ev,) = evicted(core)
    assert "not saved: sliding-window" in ev.reason
    assert not mgr._jobs


async def test_busy_session_is_never_released(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    _session(mgr, 0, "ses-a")
    mgr.state.slots.slots[0].inflight = 1
    await core.clock.advance(10 * 3600)
    assert (await mgr.idle_release.sweep()).actions == 0


async def test_critical_pressure_releases_idle_sessions_first(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    info = prefix(list(range(1, 41)))
    mgr.state.by_fp[info.fingerprint] = info
    _session(mgr, 0, "ses-a", info.fingerprint)
    mgr.state.pressure.level = "critical"
    from core.machine.pressure import Cause

    mgr.state.pressure.causes = (Cause("RAM", "critical", 3.0, 5.0, "available"),)
    await core.clock.advance(299)
    assert (await mgr.idle_release.sweep()).actions == 0
    await core.clock.advance(1)
    assert (await mgr.idle_release.sweep()).actions == 1  # short TTL, not long
    (ev,) = evicted(core)
    assert "memory pressure is critical (RAM critical)" in ev.reason
    assert "not saved: persisting new state paused: RAM critical" in ev.reason
    assert not mgr._jobs


async def test_status_shows_ttl_class_and_time_to_expiry(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    mgr.fake = None  # status without a server
    rec = add_state(core, mgr, name_seed="s", age=HOUR, ttl_class="extended")
    pinned = add_state(core, mgr, name_seed="p", pinned=True)
    _session(mgr, 0, "ses-a")
    await core.clock.advance(600)
    st = await mgr.status()
    saved = {s["file"]: s for s in st["saved"]}
    assert saved[rec.filename]["expires_in_s"] == 86400 - HOUR - 600
    assert saved[pinned.filename]["expires_in_s"] is None
    slot0 = st["slots"][0]
    assert slot0["ttl_class"] == "long" and slot0["expires_in_s"] == 3000
    assert st["ttl"] == {"short": 300, "long": 3600, "extended": 86400}
    assert st["disk"]["used_bytes"] == 2 * MB
    text = st["text"]
    assert "pinned, probe answer recorded at save, not restored since, never expires" in text
    assert "expires in 22.8 h" in text
    assert "long TTL, expires in 50 min" in text


def conversation(
    core: FakeCore, mgr: FakeManager, seed: str, session: str, *, age: float, pinned: bool = False
) -> str:
    """Index a saved conversation state of `session` (long TTL class, as saved)."""
    rec = add_state(
        core, mgr, name_seed=seed, age=age, ttl_class="long", kind="conversation", pinned=pinned
    )
    mgr.state.store.add(dataclasses.replace(rec, session=session, base="b" * 64))
    return rec.filename


async def test_a_session_keeps_its_newest_n_conversations_and_its_pinned_ones(
    tmp_path: Path,
) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=10, conversations_per_session=2))
    a = [conversation(core, mgr, f"a{i}", "ses-a", age=(i + 1) * 60) for i in range(4)]
    a_pinned = conversation(core, mgr, "a-pin", "ses-a", age=50 * 60, pinned=True)
    b = [conversation(core, mgr, f"b{i}", "ses-b", age=(i + 1) * 60) for i in range(2)]
    out = await mgr.retention.sweep_disk()
    # Keep-recent (10) protects none of them from the per-session rule: it is a budget.
    assert out.actions == 2
    assert files(core) == {a[0], a[1], a_pinned, *b}
    gone = evicted(core)
    assert {e.details["file"] for e in gone} == {a[2], a[3]}
    assert {e.details["rule"] for e in gone} == {"per_session"}
    assert all("ses-a" in e.reason and e.bytes == MB for e in gone)
    # The setting is read at every sweep.
    core.settings.cache.conversations_per_session = 1
    await mgr.retention.sweep_disk()
    assert files(core) == {a[0], a_pinned, b[0]}


async def test_a_pinned_conversation_never_expires_an_unpinned_one_does(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path, settings(keep_recent=0, disk_cap_mb=1))
    old = 400 * 86400
    pinned = conversation(core, mgr, "pinned", "ses-p", age=old, pinned=True)
    expired = conversation(core, mgr, "expired", "ses-e", age=HOUR + 1)
    fresh = conversation(core, mgr, "fresh", "ses-f", age=HOUR - 1)
    await mgr.retention.sweep_disk()
    # 2 MB left under a 1 MB cap: the cap takes the unpinned one, never the pinned one.
    assert files(core) == {pinned}
    rules = {e.details["file"]: e.details["rule"] for e in evicted(core)}
    assert rules == {expired: "expired", fresh: "cap"}
    assert mgr.retention.last_plan is not None
    assert mgr.retention.last_plan.kept[pinned] == "pinned"


def test_per_session_rule_is_pure_and_off_at_zero() -> None:
    from core.cache.retention_plan import plan_disk_sweep
    from core.cache.store import StateRecord

    def rec(name: str, session: str, created: float, kind: str = "conversation") -> StateRecord:
        return StateRecord(
            name,
            IDENT,
            name,
            "",
            "",
            1,
            1,
            1,
            "",
            "long",
            False,
            created,
            created,
            None,
            "",
            {},
            kind=kind,
            session=session,
        )

    recs = [rec("c1", "s", 3), rec("c2", "s", 2), rec("c3", "s", 1), rec("p", "s", 0, "prefix")]

    def plan(n: int) -> set[str]:
        p = plan_disk_sweep(
            recs,
            now=4,
            ttl=lambda _: 1e9,
            keep_recent=0,
            cap_bytes=1 << 30,
            current_identities={IDENT},
            in_use=set(),
            file_size=lambda _: 1,
            per_session=n,
        )
        return {e.rec.filename for e in p.evictions}

    assert plan(0) == set()
    assert plan(1) == {"c2", "c3"}  # prefix states are not conversations: never counted
    assert plan(3) == set()
