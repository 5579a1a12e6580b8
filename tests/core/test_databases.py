"""The history and the cache index: two files, each recovered on its own (no server).

- The history database (`Telemetry.open`) in each way a user meets an unusable file:
  opened anyway, said what was done, and it records and answers queries.
- The cache index (`CacheIndex.open`): imported once from the history database as
  Warmslot up to 564cc59 left it (a copy of such a file, tests/fixtures/legacy_index),
  rebuilt from the slot files' records when lost or damaged, unreadable rows skipped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from core.cache.index import CacheIndex
from core.cache.manager import policy_factory
from core.cache.store import StateStore, card_name
from core.config import Settings
from core.engine import Core
from core.events import Notice
from core.paths import Paths
from core.telemetry import Telemetry
from tests.db_damage import WAYS, damaged
from tests.helpers import EventLog

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_index"
IDENTITY = "0123456789abcdef"

# What the history's recovery says for each way (a part of its sentence).
SAID = {
    "truncated": "damaged or cut short",
    "zero-length": "the file was empty (0 bytes)",
    "not-a-database": "not a SQLite database",
    "locked": "another process holds a lock on it",
    "directory": "a directory is in its place",
    "read-only-file": "cannot be written",
    "read-only-folder": "cannot be written",
}


def _history(path: Path) -> None:
    tel = Telemetry(path)
    for i in range(500):
        tel.record(Notice(level="info", text=f"old history {i} " + "x" * 100))
    tel.close()


@pytest.mark.parametrize("way", WAYS)
def test_the_history_opens_in_every_way_it_can_be_damaged(tmp_path: Path, way: str) -> None:
    path = tmp_path / "state" / "telemetry.sqlite3"
    _history(path)
    with damaged(path, way):
        tel, recovery = Telemetry.open(path)
        try:
            tel.record(Notice(level="warning", text="after"))
            tel.flush()
            texts = [e["reason"] for e in tel.recent_events(limit=1000, category="notice")]
            assert "after" in texts
            tel.recent_requests()
            tel.server_runs()
            tel.pressure_series(since=0)
            tel.sessions()
            tel.totals()
        finally:
            tel.close()
    if way == "garbage-rows":
        assert recovery is None  # the file is fine; its rows are read past
        return
    assert recovery is not None
    text = recovery.text()
    assert SAID[way] in text, text
    assert str(path) in text
    if recovery.moved_to is not None:  # the unusable file is kept, with its companions
        assert recovery.moved_to.name.startswith("telemetry.sqlite3.broken-")
        assert recovery.moved_to.exists() and f"moved it to {recovery.moved_to.name}" in text
        assert not recovery.in_memory and path.is_file()
    elif recovery.in_memory:  # nothing could be made in its place: said so
        assert "in memory" in text
    else:  # an empty file is a fresh database in its place
        assert way == "zero-length" and path.is_file()


def test_a_damaged_history_is_moved_aside_whole_and_still_opens_there(tmp_path: Path) -> None:
    """The moved copy keeps its -wal: what it held can still be read there."""
    path = tmp_path / "telemetry.sqlite3"
    tel = Telemetry(path)
    tel.record(Notice(level="info", text="kept"))
    tel.flush()
    holder = sqlite3.connect(path)  # keeps the -wal after the writer closes
    holder.execute("SELECT 1").fetchall()
    tel.close()
    with damaged(path, "locked"):
        fresh, recovery = Telemetry.open(path)
        fresh.close()
    holder.close()
    assert recovery is not None and recovery.moved_to is not None
    old = Telemetry(recovery.moved_to)
    assert [e["reason"] for e in old.recent_events(category="notice")] == ["kept"]
    old.close()


def test_unreadable_rows_of_history_are_read_past(tmp_path: Path) -> None:
    """Broken JSON is shown as empty, text in a number's column as None, a row whose time
    is text is in no time window (it would sort after every number, so into every one)."""
    path = tmp_path / "t.sqlite3"
    _history(path)
    with damaged(path, "garbage-rows"):
        tel = Telemetry(path)
        events = tel.recent_events(limit=5000)
        runs = tel.server_runs()
        requests = tel.recent_requests()
        clients = tel.per_client()
        sessions = tel.sessions()
        pressure = tel.pressure_series(since=0)
        tel.close()
    broken = [e for e in events if e["ts"] == 1000.0]
    assert [e["details"] for e in broken] == [{}]
    assert not [e for e in events if e["reason"] == "7"]  # its time was text
    assert [r["argv"] for r in runs] == [[]] and runs[0]["run_id"] == "garbage"
    assert [(r["prompt_n"], r["total_ms"], r["session"]) for r in requests] == [(None, None, "42")]
    assert [c["client"] for c in clients] == [""]
    assert [(s["client"], s["session"]) for s in sessions] == [("", "42")]
    assert [p["gpus"] for p in pressure] == [[]]


# ------------------------------------------------------------------ the cache index
def _legacy_home(tmp_path: Path) -> Paths:
    """A copy of an install as Warmslot up to 564cc59 left it."""
    home = tmp_path / "home"
    shutil.copytree(FIXTURE / "state", home / "state")
    return Paths.under(home)


def _rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as c:
        return list(c.execute(sql))


def _open(paths: Paths) -> CacheIndex:
    return CacheIndex.open(paths.cache_index_db, slot_dir=paths.slot_dir, legacy=paths.telemetry_db)


def test_an_existing_install_moves_its_index_out_of_the_history_once(tmp_path: Path) -> None:
    paths = _legacy_home(tmp_path)
    before = {r[0]: r for r in _rows(paths.telemetry_db, "SELECT * FROM states")}
    assert len(before) == 3
    index = _open(paths)
    try:
        assert any("3 saved state(s) and 1 prefix definition(s)" in n for n in index.notes)
        store = StateStore(index.db, paths.slot_dir)
        recs = {r.filename: r for r in store.all()}
        assert set(recs) == set(before)
        assert [r.filename for r in recs.values() if r.pinned] == [
            n
            for n, row in before.items()
            if row[10]  # the pinned column
        ]
        assert {r.kind for r in recs.values()} == {"prefix", "conversation"}
        assert [r.owner for r in recs.values() if r.kind == "conversation"] == ["alice"]
        assert index.db.execute("SELECT count(*) FROM prefixes").fetchone()[0] == 1
        assert index.db.execute("SELECT count(*) FROM state_writes").fetchone()[0] == 1
        for rec in recs.values():  # each file checks against its imported row
            assert store.check_file(rec) is None
            assert (paths.slot_dir / IDENTITY / card_name(rec.filename)).is_file()
    finally:
        index.close()
    # The history keeps its history, without the index tables or their migrations.
    tables = {r[0] for r in _rows(paths.telemetry_db, "SELECT name FROM sqlite_master")}
    assert not tables & {"states", "prefixes", "state_writes"}
    assert {"requests", "events"} <= tables
    sets = {r[0] for r in _rows(paths.telemetry_db, "SELECT migration_set FROM _sqlite_migrations")}
    assert sets == {"warmslot.telemetry"}
    tel = Telemetry(paths.telemetry_db)
    assert [e["reason"] for e in tel.recent_events(category="notice")] == [
        "history from before the upgrade"
    ]
    tel.close()
    # Once: a second start imports nothing and says nothing.
    again = _open(paths)
    assert again.notes == []
    assert len(StateStore(again.db, paths.slot_dir).all()) == 3
    again.close()


def test_the_import_is_idempotent_when_the_old_tables_could_not_be_dropped(
    tmp_path: Path,
) -> None:
    paths = _legacy_home(tmp_path)
    copy = tmp_path / "legacy-copy.sqlite3"
    shutil.copy(paths.telemetry_db, copy)
    _open(paths).close()
    shutil.copy(copy, paths.telemetry_db)  # as if the drop had failed
    index = _open(paths)
    assert index.notes == []  # not imported twice
    assert index.db.execute("SELECT count(*) FROM states").fetchone()[0] == 3
    index.close()
    tables = {r[0] for r in _rows(paths.telemetry_db, "SELECT name FROM sqlite_master")}
    assert "states" not in tables  # dropped at this start instead


def test_a_deleted_index_is_rebuilt_from_the_records_of_the_files(tmp_path: Path) -> None:
    paths = _legacy_home(tmp_path)
    _open(paths).close()
    original = {
        r[0]: r for r in _rows(paths.cache_index_db, "SELECT filename, pinned, sha256 FROM states")
    }
    for p in paths.state_dir.glob("cache-index.sqlite3*"):
        p.unlink()
    index = _open(paths)
    try:
        assert any("indexed 3 saved state(s) again from their records" in n for n in index.notes)
        store = StateStore(index.db, paths.slot_dir)
        recs = store.all()
        assert {r.filename: (r.filename, int(r.pinned), r.sha256) for r in recs} == original
        # Never trusted on the record's word: no stat, so the next check hashes the file.
        assert all(r.stat == "" for r in recs)
        victim = next(r for r in recs if r.kind == "prefix")
        path = paths.slot_dir / IDENTITY / victim.filename
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF  # same size, other contents
        path.write_bytes(bytes(data))
        assert store.check_file(victim) == "contents changed (sha256 mismatch): corrupted"
    finally:
        index.close()


@pytest.mark.parametrize("way", ["truncated", "not-a-database", "directory", "zero-length"])
def test_a_damaged_index_is_moved_aside_and_rebuilt(tmp_path: Path, way: str) -> None:
    paths = _legacy_home(tmp_path)
    index = _open(paths)
    # Enough rows that cutting the file in half cuts into them.
    index.db.execute("CREATE TABLE filler (x)")
    index.db.conn.executemany("INSERT INTO filler VALUES (?)", [("x" * 1000,)] * 200)
    index.close()
    with damaged(paths.cache_index_db, way):
        index = _open(paths)
    try:
        assert index.recovery is not None
        text = " ".join(index.notes)
        assert SAID[way] in text and "rebuilding it from the saved states' records" in text
        assert len(StateStore(index.db, paths.slot_dir).all()) == 3
    finally:
        index.close()


def test_unreadable_index_rows_are_skipped_and_deleted(tmp_path: Path) -> None:
    paths = _legacy_home(tmp_path)
    _open(paths).close()
    names = [r[0] for r in _rows(paths.cache_index_db, "SELECT filename FROM states")]
    with contextlib.closing(sqlite3.connect(paths.cache_index_db)) as c, c:
        c.execute("UPDATE states SET probe = '{not json' WHERE filename = ?", [names[0]])
        c.execute("UPDATE states SET bytes = 'big' WHERE filename = ?", [names[1]])
        c.execute("INSERT INTO states (filename, identity) VALUES ('../../etc/passwd', 'x')")
    # Their records are gone too: the files must not come back through them.
    (paths.slot_dir / IDENTITY / card_name(names[1])).unlink()
    index = _open(paths)
    try:
        text = " ".join(index.notes)
        assert "skipped and deleted 3 unreadable row(s)" in text, text
        # The file whose record is intact is indexed again from it; the other is left alone.
        assert "indexed 1 saved state(s) again" in text
        store = StateStore(index.db, paths.slot_dir)
        assert {r.filename for r in store.all()} == {names[0], names[2]}
        # A row damaged while running is skipped by every read, not raised.
        index.db.execute("UPDATE states SET probe = '[' WHERE filename = ?", [names[2]])
        assert store.get(names[2]) is None
        assert [r.filename for r in store.all()] == [names[0]]
        assert store.for_fingerprint(store.all()[0].fingerprint) is not None
    finally:
        index.close()
    assert (paths.slot_dir / IDENTITY / names[1]).is_file()  # never deleted on a bad row


def test_records_that_do_not_match_their_files_are_not_adopted(tmp_path: Path) -> None:
    paths = _legacy_home(tmp_path)
    _open(paths).close()
    names = sorted(r[0] for r in _rows(paths.cache_index_db, "SELECT filename FROM states"))
    folder = paths.slot_dir / IDENTITY
    # 0: the file grew; 1: the record names another file; 2: the file is gone.
    with (folder / names[0]).open("ab") as f:
        f.write(b"more")
    card = json.loads((folder / card_name(names[1])).read_text())
    card["filename"] = names[0]
    (folder / card_name(names[1])).write_text(json.dumps(card))
    (folder / names[2]).unlink()
    (folder / ("ws-" + "a" * 32 + ".bin")).write_bytes(b"no record: never ours to index")
    for p in paths.state_dir.glob("cache-index.sqlite3*"):
        p.unlink()
    index = _open(paths)
    try:
        assert StateStore(index.db, paths.slot_dir).all() == []
        assert "left 2 saved state(s) alone" in " ".join(index.notes)
    finally:
        index.close()
    assert not (folder / card_name(names[2])).exists()  # a stray record is removed
    assert (folder / names[0]).is_file() and (folder / names[1]).is_file()  # left alone


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("way", WAYS)
def test_the_core_starts_and_says_what_it_did(tmp_path: Path, way: str) -> None:
    """Core.start (no llama-server) on an upgraded install whose history is then
    damaged: it starts, its status answers, and its one warning about the history says
    what was done; the index, imported at the first start, is not mentioned again."""
    paths = _legacy_home(tmp_path)
    settings = Settings()
    settings.proxy.port = 0

    def start() -> list[str]:
        core = Core(paths, settings, policy_factory=policy_factory)
        log = EventLog()
        core.subscribe(log.append, (Notice,))
        core.start(start_server=False)
        try:
            status = core.status().result(30)
            assert status["cache"] is not None
        finally:
            core.stop()
        return [n.text for n in log.of(Notice) if n.level == "warning"]

    first = start()
    assert len(first) == 1 and "moved the index of 3 saved state(s)" in first[0], first
    with damaged(paths.telemetry_db, way):
        said = start()
    history = [t for t in said if "the history database" in t]
    if way == "garbage-rows":
        assert said == []
    else:
        assert len(history) == 1 and SAID[way] in history[0], said
    if way == "read-only-folder":  # the index is in that folder too: rebuilt in memory
        assert any("the cache index" in t and "in memory" in t for t in said), said
        assert any("indexed 3 saved state(s) again" in t for t in said), said
    else:
        assert said == history
    index = CacheIndex.open(paths.cache_index_db, slot_dir=paths.slot_dir)
    assert len(StateStore(index.db, paths.slot_dir).all()) == 3  # untouched by it all
    index.close()
