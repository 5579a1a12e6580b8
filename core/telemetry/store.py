"""The telemetry writer: `Telemetry` owns the database, buffers rows (from events,
`record`) and writes them in batches on a writer thread of its own (never on the core's
event loop); a row SQLite refuses is dropped and counted, never stopping the rest. Old
rows go by `prune`.

The file holds history only (requests, events, server runs, builds, explanations,
pressure samples, sweeps): the cache index is a database of its own
(`core.cache.index`), so losing this file loses charts, never cache state.
`Telemetry.open` is how the engine opens it: a file that cannot be used is moved
aside and a fresh one made (`core.dbfile`), so history never stops serving."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import sqlite_utils

from core.dbfile import Recovery, connect, open_or_recover
from core.events import (
    BuildProgress,
    CacheEvent,
    Event,
    ModelEvent,
    Notice,
    PressureChanged,
    PressureSample,
    RequestCompleted,
    RequestExplained,
    ServerExited,
    ServerLaunched,
    ServerStateChanged,
    SettingsChanged,
    SweepRun,
)
from core.telemetry import totals
from core.telemetry.queries import Queries
from core.telemetry.schema import db_table, migrations

log = logging.getLogger("warmslot.telemetry")

BATCH = 200
# The most rows held for writing. Past it the oldest are dropped (and counted): a
# database that cannot be written must not grow the core's memory without end.
MAX_PENDING = 20 * BATCH

# What writing one row can raise because of that row: a value sqlite3 cannot bind or
# encode (UnicodeEncodeError is a ValueError), a constraint, an unknown column.
_ROW_ERRORS = (sqlite3.Error, ValueError, TypeError, OverflowError)


def safe_text(value: str) -> str:
    """`value` as text SQLite (and JSON) can store: code points that are not valid
    Unicode text — lone surrogates, as aiohttp makes of a header's non-UTF-8 bytes
    (``surrogateescape``) — become U+FFFD replacement characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # surrogateescape turns the escaped bytes back into themselves; surrogatepass
        # keeps any other lone surrogate as its (invalid) UTF-8 bytes; decoding with
        # "replace" then makes each invalid sequence one U+FFFD.
        raw = value.encode("utf-8", "surrogateescape" if _escaped_only(value) else "surrogatepass")
        return raw.decode("utf-8", "replace")
    return value


def _escaped_only(value: str) -> bool:
    """True when every surrogate in `value` is one surrogateescape makes (U+DC80..DCFF)."""
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in value)


def _clean(row: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in row.items():
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, str):
            v = safe_text(v)
        out[k] = v
    return out


class _Writer:
    """The thread that writes the history's rows, with a connection of its own: a batch
    of rows (or a database that waits for a lock another process holds) never stalls
    the core's event loop, where the requests are served (docs/benchmarks.md#request-budget)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.db: sqlite_utils.Database | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="warmslot-history")
        self._pool.submit(self._open).result()  # its errors are the caller's, at once

    def _open(self) -> None:
        self.db = sqlite_utils.Database(connect(self._path))

    def submit(self, job: Callable[[sqlite_utils.Database], None]) -> Future[None]:
        """Run `job` with the writer's database, after every job submitted before."""

        def run() -> None:
            assert self.db is not None
            job(self.db)

        return self._pool.submit(run)

    def close(self) -> None:
        def close_db() -> None:
            if self.db is not None:
                self.db.conn.close()
                self.db = None

        self._pool.submit(close_db).result()
        self._pool.shutdown()


class Telemetry(Queries):
    """Owner of the telemetry database. Use from one thread (the core thread).

    Reads (the queries) and the rare writes of the owner's own (prune) go through the
    core thread's connection; the rows of events are buffered (`add`, `record`) and
    written in batches by a writer thread with its own connection (a file database;
    one in memory is written in place). `flush` waits for what is buffered to be
    written, so a query sees every row recorded before it; the periodic `maybe_flush`
    and a full buffer do not wait."""

    def __init__(self, path: Path | str, *, clock: Any = time.time) -> None:
        self.path = path
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        # WAL, and proven writable: a damaged, locked or read-only file raises here.
        self._conn = connect(path)
        self.db = sqlite_utils.Database(self._conn)
        try:
            migrations.apply(self.db)
            self._writer = _Writer(path) if isinstance(path, Path) else None
        except BaseException:
            self._conn.close()
            raise
        self._clock = clock
        # Rows to write, per table: any values (one SQLite cannot store is dropped, counted).
        # Guarded by `_lock`: the writer thread puts back what it could not write.
        self._lock = threading.Lock()
        self._writing: Future[None] | None = None  # the batch the writer has now
        self._pending: dict[str, list[dict[str, object]]] = {}
        self._upserts: list[tuple[str, dict[str, object], str]] = []
        self._last_flush = clock()
        # Rows that could not be written and were dropped (since this object was made),
        # and the causes already logged (each once).
        self.dropped = 0
        self._unnoted = 0
        self._last_cause = ""
        self._logged: set[str] = set()

    @classmethod
    def open(cls, path: Path, *, clock: Any = time.time) -> tuple[Telemetry, Recovery | None]:
        """The history database at `path`, or — when that file cannot be used (damaged,
        cut short, not a database, locked, a directory, read-only) — a fresh one in its
        place after moving it aside, or one in memory for this run. Returns it with what
        was done (None: the file was fine); never raises for the file's state."""
        return open_or_recover(path, lambda p: cls(p, clock=clock), what="history database")

    # --------------------------------------------------------------- writing
    def add(self, table: str, row: Mapping[str, object]) -> None:
        """Buffer one row for `table` (written by the writer, at the latest every BATCH
        rows; this never waits for the database)."""
        clean = _clean(row)
        with self._lock:
            self._pending.setdefault(table, []).append(clean)
            held = sum(len(v) for v in self._pending.values())
        if held >= BATCH:
            self._flush(wait=False)
        with self._lock:
            held = sum(len(v) for v in self._pending.values())
            if held > MAX_PENDING:  # the database cannot be written: keep the newest rows
                rows = self._pending[table]
                over = min(held - MAX_PENDING, len(rows))
                del rows[:over]
                self._drop(over, table, "BufferFull: the database could not be written")

    def upsert(self, table: str, row: Mapping[str, object], pk: str) -> None:
        """Buffer an insert-or-replace of one row of `table` by its key column `pk`."""
        with self._lock:
            self._upserts.append((table, _clean(row), pk))
            if len(self._upserts) > MAX_PENDING:
                del self._upserts[0]
                self._drop(1, table, "BufferFull: the database could not be written")

    def flush(self) -> None:
        """Write everything buffered and wait until it is written: in one transaction,
        or row by row if that fails.

        One row that cannot be written (a value SQLite refuses) must never stop the
        recording of every later one: when the batch fails, each row is written alone
        and the ones that fail are dropped, counted in `dropped`, logged (once per
        cause) and noted in the events table (category "telemetry"). When the database
        itself cannot be written (locked, full, read-only: `sqlite3.OperationalError`),
        the rows stay buffered for the next flush, up to `MAX_PENDING`.
        """
        self._flush(wait=True)

    def _flush(self, *, wait: bool) -> None:
        # One batch in the writer at a time: what it cannot write goes back in front of
        # what was buffered since, so the rows keep their order (and the newest are kept).
        writing = self._writing
        if writing is not None and not writing.done():
            if not wait:
                return  # buffered rows go with the next flush
            writing.result()
        with self._lock:
            self._last_flush = self._clock()
            if not self._pending and not self._upserts:
                return
            pending, upserts = self._pending, self._upserts
            self._pending, self._upserts = {}, []
        job = partial(self._write, pending, upserts)
        if self._writer is None:
            job(self.db)
            return
        self._writing = self._writer.submit(job)
        if wait:
            self._writing.result()

    def _write(
        self,
        pending: dict[str, list[dict[str, object]]],
        upserts: list[tuple[str, dict[str, object], str]],
        db: sqlite_utils.Database,
    ) -> None:
        """Write one batch (on the writer thread, or in place for a database in memory)."""
        try:
            with db.atomic():
                for table, rows in pending.items():
                    db_table(db, table).insert_all(rows, alter=False)
                for table, row, pk in upserts:
                    db_table(db, table).upsert(row, pk=pk)
        except _ROW_ERRORS as e:
            log.debug("telemetry batch failed (%r); writing row by row", e)
            self._write_each(pending, upserts, db)
        else:
            with self._lock:
                self._note_drops()

    def _write_each(
        self,
        pending: dict[str, list[dict[str, object]]],
        upserts: list[tuple[str, dict[str, object], str]],
        db: sqlite_utils.Database,
    ) -> None:
        """Write the rows one at a time, dropping each that fails on its own."""
        writes: list[tuple[str, Callable[[], Any]]] = []
        for table, rows in pending.items():
            for row in rows:
                writes.append((table, partial(db_table(db, table).insert, row, alter=False)))
        for table, row, pk in upserts:
            writes.append((table, partial(db_table(db, table).upsert, row, pk=pk)))
        for i, (table, write) in enumerate(writes):
            try:
                with db.atomic():
                    write()
            except sqlite3.OperationalError as e:
                # The database, not the row: keep this row and the rest for later.
                with self._lock:
                    if "OperationalError" not in self._logged:
                        self._logged.add("OperationalError")
                        log.warning("telemetry cannot write the database now (rows kept): %s", e)
                    self._keep_unwritten(pending, upserts, i)
                return
            except _ROW_ERRORS as e:
                with self._lock:
                    self._drop(1, table, f"{type(e).__name__}: {e}")
        with self._lock:
            self._note_drops()

    def _keep_unwritten(
        self,
        pending: dict[str, list[dict[str, object]]],
        upserts: list[tuple[str, dict[str, object], str]],
        first: int,
    ) -> None:
        """Buffer again every write from index `first` on (inserts, then upserts), before
        what was buffered since (called with `_lock` held)."""
        index = 0
        kept: dict[str, list[dict[str, object]]] = {}
        for table, rows in pending.items():
            for row in rows:
                if index >= first:
                    kept.setdefault(table, []).append(row)
                index += 1
        for table, rows in self._pending.items():
            kept.setdefault(table, []).extend(rows)
        self._pending = kept
        again = [item for k, item in enumerate(upserts, start=index) if k >= first]
        self._upserts = again + self._upserts
        # Still bounded: the oldest beyond MAX_PENDING go, counted (as in `add`).
        held = sum(len(v) for v in self._pending.values())
        for table, rows in self._pending.items():
            over = min(held - MAX_PENDING, len(rows))
            if over > 0:
                del rows[:over]
                held -= over
                self._drop(over, table, "BufferFull: the database could not be written")
        if len(self._upserts) > MAX_PENDING:
            over = len(self._upserts) - MAX_PENDING
            del self._upserts[:over]
            self._drop(over, "upserts", "BufferFull: the database could not be written")

    def _drop(self, n: int, table: str, cause: str) -> None:
        """Count rows that could not be written (called with `_lock` held)."""
        self.dropped += n
        self._unnoted += n
        self._last_cause = cause
        key = cause.split(":", 1)[0]
        if key not in self._logged:  # once per kind of cause: one bad client, one line
            self._logged.add(key)
            log.error(
                "telemetry dropped %d row(s) of %r that could not be written: %s "
                "(logged once per cause; the count is in status totals as dropped_rows)",
                n,
                table,
                cause,
            )

    def _note_drops(self) -> None:
        """Record in the events table that rows were dropped (written at the next flush;
        called with `_lock` held)."""
        if not self._unnoted:
            return
        n, self._unnoted = self._unnoted, 0
        self._pending.setdefault("events", []).append(
            {
                "ts": self._clock(),
                "category": "telemetry",
                "kind": "rows_dropped",
                "reason": safe_text(f"{n} row(s) could not be written: {self._last_cause}")[:500],
                "details": json.dumps({"rows": n, "total_dropped": self.dropped}),
            }
        )

    def maybe_flush(self, interval: float = 1.0) -> None:
        """Hand what is buffered to the writer when `interval` seconds passed (no wait)."""
        if self._clock() - self._last_flush >= interval:
            self._flush(wait=False)

    def record(self, event: Event) -> None:
        """Store an event in the table it belongs to (subscribe this to the bus)."""
        if isinstance(event, RequestCompleted):
            row = asdict(event)
            self.add("requests", row)
        elif isinstance(event, RequestExplained):
            self.add("explanations", asdict(event))
        elif isinstance(event, ServerLaunched):
            self.upsert(
                "server_runs",
                {
                    "run_id": event.run_id,
                    "started": event.ts,
                    "pid": event.pid,
                    "port": event.port,
                    "argv": json.dumps(list(event.argv)),
                    "binary": event.binary,
                    "binary_version": event.binary_version,
                    "model": event.model,
                    "attempt": event.attempt,
                },
                "run_id",
            )
            self.flush()
        elif isinstance(event, ServerExited):
            self.upsert(
                "server_runs",
                {
                    "run_id": event.run_id,
                    "ended": event.ts,
                    "outcome": event.outcome,
                    "returncode": event.returncode,
                    "signal": event.signal,
                    "requested_by": event.requested_by,
                    "last_lines": json.dumps(list(event.last_lines)),
                },
                "run_id",
            )
            self.flush()
        elif isinstance(event, CacheEvent):
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "cache",
                    "kind": event.kind,
                    "reason": event.reason,
                    "fingerprint": event.fingerprint,
                    "slot": event.slot,
                    "tokens": event.tokens,
                    "bytes": event.bytes,
                    "details": json.dumps(event.details, default=str),
                },
            )
        elif isinstance(event, ModelEvent):
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "models",
                    "kind": event.kind,
                    "reason": f"{event.model}: {event.reason}",
                    "details": json.dumps(event.numbers, default=str),
                },
            )
        elif isinstance(event, ServerStateChanged):
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "server",
                    "kind": event.state,
                    "reason": event.reason,
                    "details": json.dumps({"previous": event.previous, "pid": event.pid}),
                },
            )
        elif isinstance(event, SettingsChanged):
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "settings",
                    "kind": "changed",
                    "reason": event.text(),
                    "details": json.dumps({"changes": event.changes}, default=str),
                },
            )
        elif isinstance(event, Notice):
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "notice",
                    "kind": event.level,
                    "reason": event.text,
                    "details": json.dumps({"hint": event.hint}),
                },
            )
        elif isinstance(event, PressureSample):
            self.add(
                "pressure",
                {
                    "ts": event.ts,
                    "level": event.level,
                    "ram_available_pct": event.ram_available_pct,
                    "swap_used_pct": event.swap_used_pct,
                    "server_rss": event.server_rss_bytes,
                    "disk_free_pct": event.disk_free_pct,
                    "gpus": json.dumps(event.gpus),
                },
            )
        elif isinstance(event, SweepRun):
            self.add(
                "sweeps",
                {
                    "ts": event.ts,
                    "name": event.name,
                    "started": event.started,
                    "duration_s": event.duration_s,
                    "actions": event.actions,
                    "error": event.error,
                    "details": json.dumps(event.details, default=str),
                },
            )
        elif isinstance(event, PressureChanged):
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "pressure",
                    "kind": event.level,
                    "reason": "; ".join(event.reasons) or "back to nominal",
                    "details": json.dumps(
                        {"previous": event.previous, "paused": list(event.paused)}
                    ),
                },
            )
        elif isinstance(event, BuildProgress) and event.done:
            self.add(
                "events",
                {
                    "ts": event.ts,
                    "category": "build",
                    "kind": "ok" if event.ok else "failed",
                    "reason": event.step,
                    "details": json.dumps({"build_id": event.build_id}),
                },
            )

    def record_build(self, row: Mapping[str, object]) -> None:
        """A build's record (`core.build`): one row per build id, the latest kept."""
        if not row.get("build_id"):
            return
        self.upsert(
            "builds",
            {
                "build_id": row["build_id"],
                "ts": self._clock(),
                "outcome": row.get("outcome"),
                "duration_s": row.get("duration_s"),
                "log_path": row.get("log_path"),
                "inputs": json.dumps(row, default=str),
            },
            "build_id",
        )

    async def housekeeping(self, retention_days: Callable[[], float]) -> None:
        """Until cancelled, on the core's loop: flush every second, prune hourly."""
        last_prune = 0.0
        while True:
            await asyncio.sleep(1.0)
            try:
                self.maybe_flush(1.0)
                if time.time() - last_prune > 3600:
                    last_prune = time.time()
                    self.prune(retention_days())
            except Exception:
                log.exception("telemetry housekeeping failed")

    def prune(self, retention_days: float) -> int:
        """Delete rows older than the retention window; returns rows deleted."""
        self.flush()
        cutoff = self._clock() - retention_days * 86400
        deleted = 0
        with self.db.atomic():
            totals.carry(self._conn, cutoff)  # the lifetime counters keep what goes
            for table, col in (
                ("requests", "ts"),
                ("events", "ts"),
                ("pressure", "ts"),
                ("sweeps", "ts"),
                ("explanations", "ts"),
                ("server_runs", "started"),
            ):
                cur = self._conn.execute(f"DELETE FROM {table} WHERE {col} < ?", [cutoff])
                deleted += cur.rowcount
        return deleted

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
        self._conn.close()
