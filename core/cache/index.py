"""The cache index: the authoritative state of the disk tier, in a database of its own.

``state/cache-index.sqlite3`` (`core.paths.Paths.cache_index_db`) holds the
``states`` table (every saved slot file, `core.cache.store`), the ``prefixes``
table (learned prefix definitions, `core.cache.definitions`) and the write
journal (``state_writes``, `core.cache.retention`). It lives in the state folder
beside the slot files it describes (``state/slots``): it is worth nothing
without them, and they are not Warmslot's without it. The history
(`core.telemetry`) is another file, so deleting the history never loses the
index. The core thread owns the connection (WAL, as the history's).

Opening it (`CacheIndex.open`), in order:

1. The file is opened and checked (``PRAGMA quick_check``, writable). One that
   cannot be used is moved aside and a fresh one made (`core.dbfile`), or kept in
   memory for this run where no file can be made.
2. On the first start after the upgrade that split it from the history, the index
   tables of the history database (where earlier versions kept them) are copied
   in, once: the import is recorded in the index's ``meta`` table, and the old
   tables are dropped from the history afterwards.
3. The index is reconciled with the slot directories (`StateStore.reconcile`):
   unreadable rows are deleted, and the records beside the slot files
   (``ws-<hex>.json``) rebuild the rows of files the index lost — each still
   checked against its sha256 and probe before its first use.

What was done comes back in `notes`, which the engine shows as a Notice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import sqlite_utils
from sqlite_utils import Migrations
from sqlite_utils.db import Table

from core.cache import store
from core.cache.store import StateStore
from core.dbfile import Recovery, connect, open_or_recover

__all__ = ["LEGACY_TABLES", "CacheIndex", "import_legacy"]

log = logging.getLogger("warmslot.cache")

WHAT = "cache index"
IMPORTED = "imported_from_history"  # the meta key of the one-time import
# The index's tables as earlier versions kept them in the history database, and the
# migration sets that made them there.
LEGACY_TABLES = ("states", "prefixes", "state_writes")
LEGACY_SETS = (store.migrations.name, "warmslot.retention")

migrations = Migrations("warmslot.index")


@migrations()
def m001_meta(db: sqlite_utils.Database) -> None:
    """Facts about the index itself (the one-time import from the history)."""
    cast(Table, db["meta"]).create({"key": str, "value": str}, pk="key")


def _apply(db: sqlite_utils.Database) -> None:
    for m in (migrations, store.migrations):
        m.apply(db)


def _open_checked(path: Path | str) -> sqlite3.Connection:
    """The index at `path`, checked page by page (it is small) and migrated; raises when
    it cannot be trusted or written."""
    conn = connect(path)
    try:
        verdict = conn.execute("PRAGMA quick_check").fetchall()
        if [tuple(r) for r in verdict] != [("ok",)]:
            first = verdict[0][0] if verdict else "no answer"
            raise sqlite3.DatabaseError(f"integrity check failed: {first}")
        _apply(sqlite_utils.Database(conn))
    except BaseException:
        conn.close()
        raise
    return conn


class CacheIndex:
    """The open cache index. Use from one thread (the core thread)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path | str,
        *,
        recovery: Recovery | None = None,
        notes: list[str] | None = None,
    ) -> None:
        self._conn = conn
        self.db = sqlite_utils.Database(conn)
        self.path = path
        self.recovery = recovery
        self.notes = notes if notes is not None else []  # what opening it did, in words

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        slot_dir: Path,
        legacy: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> CacheIndex:
        """Open (or make, import into, rebuild) the index at `path` for the slot files
        under `slot_dir`; `legacy` is the history database earlier versions kept the
        index in. Never raises for the state of either file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        conn, recovery = open_or_recover(path, _open_checked, what=WHAT, clock=clock)
        index = cls(conn, path, recovery=recovery)
        if recovery is not None:
            index.note(recovery.text() + "; rebuilding it from the saved states' records")
        # Into a file only: an index kept in memory for one run would import again at
        # every start (and its folder, which cannot be written, cannot drop the old tables).
        if legacy is not None and not (recovery is not None and recovery.in_memory):
            index.note(import_legacy(index.db, legacy, clock=clock))
        index.note(StateStore(index.db, slot_dir, clock=clock).reconcile().text())
        return index

    @classmethod
    def memory(cls) -> CacheIndex:
        """An empty index in memory (tests, and tools that index a scratch folder)."""
        conn = connect(":memory:")
        _apply(sqlite_utils.Database(conn))
        return cls(conn, ":memory:")

    def note(self, text: str) -> None:
        if text:
            self.notes.append(text if text.startswith("the ") else f"cache index: {text}")
            log.warning("%s", self.notes[-1])

    def close(self) -> None:
        self._conn.close()


def _legacy_tables(conn: sqlite3.Connection) -> list[str]:
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return [t for t in LEGACY_TABLES if t in names]


def import_legacy(
    db: sqlite_utils.Database, legacy: Path, *, clock: Callable[[], float] = time.time
) -> str:
    """Copy the index tables out of the history database `legacy` into `db`, once, and
    drop them there; returns what was done, in words ("" when there was nothing to do).

    The copy is one transaction recorded in `db`'s ``meta`` table, so it never runs
    twice (a new install records that there was nothing to copy); the rows go in as
    they were (the reconcile that follows checks each). The old tables are dropped from
    the history only after the copy is committed (again at a later start if that
    failed), so no state is lost between the two files."""
    meta = cast(Table, db["meta"])
    done = any(True for _ in meta.rows_where("key = ?", [IMPORTED]))

    def mark(copied: dict[str, int]) -> None:
        meta.insert({"key": IMPORTED, "value": json.dumps({"ts": clock(), "rows": copied})})

    if not legacy.is_file():
        if not done:
            mark({})  # nothing to import, ever: a new install (or a history deleted first)
        return ""
    copied: dict[str, int] = {}
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{legacy}?mode=ro", uri=True, timeout=1.0)
        ) as src:
            tables = _legacy_tables(src)
            if not done:
                rows = {t: _rows(src, t) for t in tables}
                with db.atomic():
                    for table, items in rows.items():
                        columns = set(cast(Table, db[table]).columns_dict)
                        clean = [{k: v for k, v in r.items() if k in columns} for r in items]
                        pk = "filename" if table != "prefixes" else "id"
                        cast(Table, db[table]).insert_all(clean, pk=pk, ignore=True)
                        copied[table] = len(clean)
                    mark(copied)
    except sqlite3.Error as e:
        if done:  # imported at an earlier start: the history's state is its own business
            return ""
        return (
            f"could not read the old index in {legacy.name} ({e}); saved states from before "
            "the upgrade are left alone on disk"
        )
    if tables:
        _drop_legacy(legacy, tables)
    if not copied:
        return ""
    log.info("cache index: imported %s from %s", copied, legacy)
    return (
        f"moved the index of {copied.get('states', 0)} saved state(s) and "
        f"{copied.get('prefixes', 0)} prefix definition(s) out of {legacy.name} into its own "
        "database (once)"
    )


def _rows(conn: sqlite3.Connection, table: str) -> list[dict[str, object]]:
    cur = conn.execute(f"SELECT * FROM {table}")  # one of LEGACY_TABLES
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _drop_legacy(legacy: Path, tables: list[str]) -> None:
    """Drop the copied tables (and their migration records) from the history database;
    a failure is logged and tried again at the next start."""
    try:
        with contextlib.closing(connect(legacy)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            for t in tables:
                conn.execute(f"DROP TABLE IF EXISTS {t}")
            with contextlib.suppress(sqlite3.OperationalError):  # no migrations table
                conn.execute(
                    "DELETE FROM _sqlite_migrations WHERE migration_set IN (?, ?)", LEGACY_SETS
                )
            conn.execute("COMMIT")
    except (sqlite3.Error, OSError) as e:
        log.warning(
            "could not drop the old index tables from %s (%s); tried again later", legacy, e
        )
