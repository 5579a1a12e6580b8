"""Telemetry: the SQLite history behind status, charts and benchmarks.

The core thread owns the one writer connection (sqlite connections are bound
to their thread). Writes are buffered and flushed in one transaction every
second or every `BATCH` rows; queries flush first so they see everything. WAL
lets the GUI open its own read-only connection. The schema evolves through
sqlite-utils `Migrations`; old rows are deleted by `prune`.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, cast

import sqlite_utils
from sqlite_utils import Migrations
from sqlite_utils.db import Table

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
from core.status import ClientRow, ColdRate, RequestRow, SessionRow, Totals, UserRow
from core.telemetry_rows import (
    EventRow,
    ExplanationRow,
    HitRateRow,
    PressureRow,
    ServerRunRow,
    SweepRunRow,
    TtfbMedians,
)

log = logging.getLogger("warmslot.telemetry")

BATCH = 200
# The most rows held for writing. Past it the oldest are dropped (and counted): a
# database that cannot be written must not grow the core's memory without end.
MAX_PENDING = 20 * BATCH
BUCKETS = {"minute": 60, "hour": 3600, "day": 86400}
# The queries that may be run by name (`Telemetry.query`, `Core.query`, the GUI): the
# read-only methods in the "queries" part of `Telemetry`. Kept here, beside them, so a
# new query is added in one place.
QUERIES = frozenset(
    {
        "hit_rate",
        "totals",
        "per_client",
        "sessions",
        "cold_prefill_rate",
        "recent_requests",
        "recent_events",
        "server_runs",
        "sweep_runs",
        "pressure_series",
        "ttfb",
        "explanations",
        "explanation",
        "per_user",
    }
)

# A prefill this long, with no reuse, measures the cold rate (batched, as a re-read is).
COLD_MIN_TOKENS = 256

migrations = Migrations("warmslot.telemetry")


@migrations()
def m001_initial(db: sqlite_utils.Database) -> None:
    _table(db, "requests").create(
        {
            "id": int,
            "ts": float,
            "request_id": str,
            "client": str,
            "session": str,
            "endpoint": str,
            "stream": int,
            "has_tools": int,
            "kind": str,
            "status": int,
            "slot": int,
            "prompt_n": int,
            "cache_n": int,
            "prompt_ms": float,
            "predicted_n": int,
            "ttfb_ms": float,
            "total_ms": float,
            "error": str,
        },
        pk="id",
    )
    _table(db, "requests").create_index(["ts"])
    _table(db, "server_runs").create(
        {
            "run_id": str,
            "started": float,
            "ended": float,
            "pid": int,
            "port": int,
            "argv": str,
            "binary": str,
            "binary_version": str,
            "model": str,
            "attempt": str,
            "outcome": str,
            "returncode": int,
            "signal": int,
            "requested_by": str,
            "last_lines": str,
        },
        pk="run_id",
    )
    _table(db, "server_runs").create_index(["started"])
    _table(db, "events").create(
        {
            "id": int,
            "ts": float,
            "category": str,
            "kind": str,
            "reason": str,
            "fingerprint": str,
            "slot": int,
            "tokens": int,
            "bytes": int,
            "details": str,
        },
        pk="id",
    )
    _table(db, "events").create_index(["ts"])
    _table(db, "events").create_index(["category", "ts"])
    _table(db, "pressure").create(
        {
            "id": int,
            "ts": float,
            "level": str,
            "ram_available_pct": float,
            "swap_used_pct": float,
            "server_rss": int,
            "disk_free_pct": float,
            "gpus": str,
        },
        pk="id",
    )
    _table(db, "pressure").create_index(["ts"])
    _table(db, "builds").create(
        {
            "build_id": str,
            "ts": float,
            "inputs": str,
            "duration_s": float,
            "outcome": str,
            "log_path": str,
        },
        pk="build_id",
    )


@migrations()
def m002_sweeps(db: sqlite_utils.Database) -> None:
    """One row per run of a background sweep (see core.sweeps)."""
    _table(db, "sweeps").create(
        {
            "id": int,
            "ts": float,
            "name": str,
            "started": float,
            "duration_s": float,
            "actions": int,
            "error": str,
            "details": str,
        },
        pk="id",
    )
    _table(db, "sweeps").create_index(["name", "ts"])


@migrations()
def m003_explanations(db: sqlite_utils.Database) -> None:
    """Why each managed request reused what it did (core.cache.explain): its prompt's
    sections and the first token where it left its slot's previous prompt."""
    _table(db, "explanations").create(
        {
            "id": int,
            "ts": float,
            "request_id": str,
            "client": str,
            "session": str,
            "slot": int,
            "n_tokens": int,
            "cache_n": int,
            "prompt_n": int,
            "previous_tokens": int,
            "div_token": int,
            "div_section": str,
            "lost_tokens": int,
            "cost_s": float,
            "summary": str,
            "sections": str,
            "divergence": str,
            "compute_ms": float,
        },
        pk="id",
    )
    _table(db, "explanations").create_index(["ts"])
    _table(db, "explanations").create_index(["request_id"])


@migrations()
def m004_request_users(db: sqlite_utils.Database) -> None:
    """Who sent each request: the name of its API key (docs/security.md#serving-a-team)."""
    _table(db, "requests").add_column("user", str, not_null_default="")


# What writing one row can raise because of that row: a value sqlite3 cannot bind or
# encode (UnicodeEncodeError is a ValueError), a constraint, an unknown column.
_ROW_ERRORS = (sqlite3.Error, ValueError, TypeError, OverflowError)


def _table(db: sqlite_utils.Database, name: str) -> Table:
    return cast(Table, db[name])


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


class Telemetry:
    """Owner of the telemetry database. Use from one thread (the core thread)."""

    def __init__(self, path: Path | str, *, clock: Any = time.time) -> None:
        self.path = path
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), isolation_level=None)
        self.db = sqlite_utils.Database(self._conn)
        if str(path) != ":memory:":
            self.db.enable_wal()
        self._conn.execute("PRAGMA synchronous=NORMAL")
        migrations.apply(self.db)
        self._clock = clock
        # Rows to write, per table: any values (one SQLite cannot store is dropped, counted).
        self._pending: dict[str, list[dict[str, object]]] = {}
        self._upserts: list[tuple[str, dict[str, object], str]] = []
        self._last_flush = clock()
        # Rows that could not be written and were dropped (since this object was made),
        # and the causes already logged (each once).
        self.dropped = 0
        self._unnoted = 0
        self._last_cause = ""
        self._logged: set[str] = set()

    # --------------------------------------------------------------- writing
    def add(self, table: str, row: Mapping[str, object]) -> None:
        """Buffer one row for `table` (written by `flush`, at the latest every BATCH rows)."""
        self._pending.setdefault(table, []).append(_clean(row))
        held = sum(len(v) for v in self._pending.values())
        if held >= BATCH:
            self.flush()
            held = sum(len(v) for v in self._pending.values())
        if held > MAX_PENDING:  # the database cannot be written: keep the newest rows
            rows = self._pending[table]
            over = min(held - MAX_PENDING, len(rows))
            del rows[:over]
            self._drop(over, table, "BufferFull: the database could not be written")

    def upsert(self, table: str, row: Mapping[str, object], pk: str) -> None:
        """Buffer an insert-or-replace of one row of `table` by its key column `pk`."""
        self._upserts.append((table, _clean(row), pk))
        if len(self._upserts) > MAX_PENDING:
            del self._upserts[0]
            self._drop(1, table, "BufferFull: the database could not be written")

    def flush(self) -> None:
        """Write everything buffered: in one transaction, or row by row if that fails.

        One row that cannot be written (a value SQLite refuses) must never stop the
        recording of every later one: when the batch fails, each row is written alone
        and the ones that fail are dropped, counted in `dropped`, logged (once per
        cause) and noted in the events table (category "telemetry"). When the database
        itself cannot be written (locked, full, read-only: `sqlite3.OperationalError`),
        the rows stay buffered for the next flush, up to `MAX_PENDING`.
        """
        if not self._pending and not self._upserts:
            self._last_flush = self._clock()
            return
        try:
            with self.db.atomic():
                for table, rows in self._pending.items():
                    _table(self.db, table).insert_all(rows, alter=False)
                for table, row, pk in self._upserts:
                    _table(self.db, table).upsert(row, pk=pk)
        except _ROW_ERRORS as e:
            log.debug("telemetry batch failed (%r); writing row by row", e)
            self._write_each()
        else:
            self._pending.clear()
            self._upserts.clear()
            self._note_drops()
        self._last_flush = self._clock()

    def _write_each(self) -> None:
        """Write the buffered rows one at a time, dropping each that fails on its own."""
        writes: list[tuple[str, Callable[[], Any]]] = []
        for table, rows in self._pending.items():
            for row in rows:
                writes.append((table, partial(_table(self.db, table).insert, row, alter=False)))
        for table, row, pk in self._upserts:
            writes.append((table, partial(_table(self.db, table).upsert, row, pk=pk)))
        pending, upserts = self._pending, self._upserts
        self._pending, self._upserts = {}, []
        for i, (table, write) in enumerate(writes):
            try:
                with self.db.atomic():
                    write()
            except sqlite3.OperationalError as e:
                # The database, not the row: keep this row and the rest for later.
                if "OperationalError" not in self._logged:
                    self._logged.add("OperationalError")
                    log.warning("telemetry cannot write the database now (rows kept): %s", e)
                self._keep_unwritten(pending, upserts, i)
                return
            except _ROW_ERRORS as e:
                self._drop(1, table, f"{type(e).__name__}: {e}")
        self._note_drops()

    def _keep_unwritten(
        self,
        pending: dict[str, list[dict[str, object]]],
        upserts: list[tuple[str, dict[str, object], str]],
        first: int,
    ) -> None:
        """Buffer again every write from index `first` on (inserts, then upserts)."""
        index = 0
        for table, rows in pending.items():
            for row in rows:
                if index >= first:
                    self._pending.setdefault(table, []).append(row)
                index += 1
        for item in upserts:
            if index >= first:
                self._upserts.append(item)
            index += 1

    def _drop(self, n: int, table: str, cause: str) -> None:
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
        """Record in the events table that rows were dropped (written at the next flush)."""
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
        if self._clock() - self._last_flush >= interval:
            self.flush()

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

    def prune(self, retention_days: float) -> int:
        """Delete rows older than the retention window; returns rows deleted."""
        self.flush()
        cutoff = self._clock() - retention_days * 86400
        deleted = 0
        with self.db.atomic():
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
        self._conn.close()

    # --------------------------------------------------------------- queries
    def query(self, name: str, **kwargs: Any) -> Any:
        """Run the read-only query `name` (one of `QUERIES`) with `kwargs`.

        How `Core.query` and the GUI's offline backend run a query by name: only the
        names in `QUERIES` are accepted, never another method (``prune``, ``close`` …).
        Raises ValueError for any other name.
        """
        if name not in QUERIES:
            raise ValueError(f"unknown query {name!r}")
        return getattr(self, name)(**kwargs)

    def _rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        self.flush()
        cur = self._conn.execute(sql, list(params))
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]

    def hit_rate(
        self, bucket: str = "minute", since: float | None = None, until: float | None = None
    ) -> list[HitRateRow]:
        """Per time bucket: requests, prompt tokens, cached tokens and hit ratio."""
        size = BUCKETS[bucket]
        since = self._clock() - 3600 if since is None else since
        until = self._clock() if until is None else until
        rows = self._rows(
            f"""SELECT CAST(ts / {size} AS INTEGER) * {size} AS bucket,
                       COUNT(*) AS requests,
                       COALESCE(SUM(cache_n), 0) AS cached,
                       COALESCE(SUM(prompt_n), 0) AS new,
                       COALESCE(SUM(cache_n), 0) + COALESCE(SUM(prompt_n), 0) AS total
                FROM requests WHERE ts >= ? AND ts < ? AND prompt_n IS NOT NULL
                GROUP BY bucket ORDER BY bucket""",
            [since, until],
        )
        for r in rows:
            r["hit_ratio"] = r["cached"] / r["total"] if r["total"] else None
        return cast(list[HitRateRow], rows)  # the SELECT names every key

    def totals(self, since: float | None = None) -> Totals:
        """Requests, prompt/cached tokens, hit ratio and an estimate of seconds saved."""
        since = 0.0 if since is None else since
        row = self._rows(
            """SELECT COUNT(*) AS requests,
                      COALESCE(SUM(prompt_n), 0) AS prompt_tokens,
                      COALESCE(SUM(cache_n), 0) AS cached_tokens,
                      COALESCE(SUM(prompt_ms), 0) AS prompt_ms,
                      SUM(CASE WHEN status >= 400 OR error != '' THEN 1 ELSE 0 END) AS errors
               FROM requests WHERE ts >= ?""",
            [since],
        )[0]
        total = row["prompt_tokens"] + row["cached_tokens"]
        row["hit_ratio"] = row["cached_tokens"] / total if total else None
        # Seconds saved: cached tokens priced at the cold prefill rate — what reading them
        # again would have cost. Small follow-up prefills run several times slower per
        # token than a long cold one (51 vs 19 ms/token measured: issue 18), so pricing
        # at the average rate overstated the saving 2–3×.
        rate = self.cold_prefill_rate(since)
        if rate["ms_per_token"] is None and since > 0:
            rate = self.cold_prefill_rate()  # none in this window: the longest history
        row["cold_rate"] = rate
        ms = rate["ms_per_token"]
        row["seconds_saved"] = row["cached_tokens"] * ms / 1000.0 if ms else 0.0
        row["errors"] = row["errors"] or 0
        row["dropped_rows"] = self.dropped  # rows telemetry could not write (since start)
        return cast(Totals, row)  # the SELECT names every key

    def cold_prefill_rate(self, since: float | None = None) -> ColdRate:
        """Milliseconds per token of cold prefills: requests of at least COLD_MIN_TOKENS
        new tokens that reused under a tenth of that. None when there was none."""
        row = self._rows(
            """SELECT COUNT(*) AS requests, COALESCE(SUM(prompt_n), 0) AS tokens,
                      COALESCE(SUM(prompt_ms), 0) AS ms
               FROM requests WHERE ts >= ? AND prompt_n >= ? AND prompt_ms > 0
                    AND COALESCE(cache_n, 0) * 10 <= prompt_n""",
            [0.0 if since is None else since, COLD_MIN_TOKENS],
        )[0]
        per = row["ms"] / row["tokens"] if row["tokens"] else None
        return {"ms_per_token": per, "requests": row["requests"], "tokens": row["tokens"]}

    def per_client(self, since: float | None = None) -> list[ClientRow]:
        since = 0.0 if since is None else since
        rows = self._rows(
            """SELECT client, COUNT(*) AS requests,
                      COALESCE(SUM(cache_n), 0) AS cached, COALESCE(SUM(prompt_n), 0) AS new
               FROM requests WHERE ts >= ? GROUP BY client ORDER BY requests DESC""",
            [since],
        )
        for r in rows:
            total = r["cached"] + r["new"]
            r["hit_ratio"] = r["cached"] / total if total else None
        return cast(list[ClientRow], rows)  # the SELECT names every key

    def per_user(self, since: float | None = None) -> list[UserRow]:
        """Per API key name ("" without keys): requests, prompt (new) and cached tokens,
        prefill seconds and the latest request's time, busiest first."""
        rows = self._rows(
            """SELECT user, COUNT(*) AS requests, COALESCE(SUM(prompt_n), 0) AS prompt_tokens,
                      COALESCE(SUM(cache_n), 0) AS cached_tokens,
                      COALESCE(SUM(prompt_ms), 0) / 1000.0 AS prefill_s, MAX(ts) AS last_used
               FROM requests WHERE ts >= ? GROUP BY user ORDER BY requests DESC""",
            [0.0 if since is None else since],
        )
        for r in rows:
            total = r["cached_tokens"] + r["prompt_tokens"]
            r["hit_ratio"] = r["cached_tokens"] / total if total else None
        return cast(list[UserRow], rows)  # the SELECT names every key

    def sessions(self, since: float | None = None, limit: int = 200) -> list[SessionRow]:
        """One row per (client, session) seen since `since`, most recent first.

        `slot` is the slot of the session's latest request (SQLite takes a bare
        column from the row that gave MAX(ts)); `kinds` lists its request kinds.
        """
        since = 0.0 if since is None else since
        rows = self._rows(
            """SELECT client, COALESCE(session, '') AS session, COUNT(*) AS requests,
                      COALESCE(SUM(cache_n), 0) AS cached, COALESCE(SUM(prompt_n), 0) AS new,
                      COALESCE(SUM(prompt_ms), 0) AS prefill_ms, MIN(ts) AS first_seen,
                      MAX(ts) AS last_seen, slot, GROUP_CONCAT(DISTINCT kind) AS kinds
               FROM requests WHERE ts >= ?
                    AND endpoint IN ('chat', 'messages', 'responses', 'completions', 'completion')
               GROUP BY client, COALESCE(session, '') ORDER BY last_seen DESC LIMIT ?""",
            [since, limit],
        )
        for r in rows:
            total = r["cached"] + r["new"]
            r["hit_ratio"] = r["cached"] / total if total else None
        return cast(list[SessionRow], rows)  # the SELECT names every key

    def recent_requests(self, limit: int = 50) -> list[RequestRow]:
        """The latest requests, newest first (every column of the table)."""
        rows = self._rows("SELECT * FROM requests ORDER BY id DESC LIMIT ?", [limit])
        return cast(list[RequestRow], rows)

    def recent_events(
        self,
        limit: int = 100,
        category: str | None = None,
        kind: str | None = None,
        since: float | None = None,
    ) -> list[EventRow]:
        """The latest events (of a category, of a kind, since a time), newest first."""
        where = ["ts >= ?"]
        params: list[Any] = [0.0 if since is None else since]
        if category:
            where.append("category = ?")
            params.append(category)
        if kind:
            where.append("kind = ?")
            params.append(kind)
        params.append(limit)
        rows = self._rows(
            f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?", params
        )
        for r in rows:
            r["details"] = json.loads(r["details"]) if r["details"] else {}
        return cast(list[EventRow], rows)  # every column of the table

    def server_runs(self, limit: int = 20) -> list[ServerRunRow]:
        """The latest runs of llama-server, newest first."""
        rows = self._rows("SELECT * FROM server_runs ORDER BY started DESC LIMIT ?", [limit])
        for r in rows:
            r["argv"] = json.loads(r["argv"]) if r["argv"] else []
            r["last_lines"] = json.loads(r["last_lines"]) if r["last_lines"] else []
        return cast(list[ServerRunRow], rows)  # every column of the table

    def sweep_runs(self, sweep: str | None = None, limit: int = 50) -> list[SweepRunRow]:
        """The latest runs of the background sweeps (or of one), newest first."""
        where, params = ("WHERE name = ?", [sweep]) if sweep else ("", [])
        rows = self._rows(
            f"SELECT * FROM sweeps {where} ORDER BY id DESC LIMIT ?", [*params, limit]
        )
        for r in rows:
            r["details"] = json.loads(r["details"]) if r["details"] else {}
        return cast(list[SweepRunRow], rows)  # every column of the table

    def pressure_series(self, since: float | None = None) -> list[PressureRow]:
        """Pressure samples since `since` (default: the last hour), oldest first."""
        since = self._clock() - 3600 if since is None else since
        rows = self._rows("SELECT * FROM pressure WHERE ts >= ? ORDER BY ts", [since])
        for r in rows:
            r["gpus"] = json.loads(r["gpus"]) if r["gpus"] else []
        return cast(list[PressureRow], rows)  # every column of the table

    def ttfb(self, since: float | None = None) -> TtfbMedians:
        """Medians for warm (mostly cached) and cold requests: prefill time (`prompt_ms`,
        keys ``warm_prefill``/``cold_prefill``) and the time to first byte of streamed
        requests (``warm``/``cold``). A non-streamed response's first byte comes after
        the whole generation, which hides what the cache saved (issue 18)."""
        since = 0.0 if since is None else since
        out: dict[str, float | int | None] = {}
        for name, cond in (("warm", "cache_n > prompt_n"), ("cold", "cache_n <= prompt_n")):
            for key, column, extra in (
                (name, "ttfb_ms", "AND stream = 1"),
                (f"{name}_prefill", "prompt_ms", ""),
            ):
                vals = [
                    r[column]
                    for r in self._rows(
                        f"SELECT {column} FROM requests WHERE ts >= ? AND {column} IS NOT NULL "
                        f"AND prompt_n IS NOT NULL AND {cond} {extra} ORDER BY {column}",
                        [since],
                    )
                ]
                out[key] = vals[len(vals) // 2] if vals else None
                out[f"{key}_n"] = len(vals)
        return cast(TtfbMedians, out)  # the loops above write every key

    def explanations(self, limit: int = 50, diverged: bool = False) -> list[ExplanationRow]:
        """The latest explanations (core.cache.explain), newest first; `diverged`: only
        those that left their slot's previous prompt. Sections and divergence as JSON text."""
        where = "WHERE div_token IS NOT NULL" if diverged else ""
        rows = self._rows(f"SELECT * FROM explanations {where} ORDER BY id DESC LIMIT ?", [limit])
        return cast(list[ExplanationRow], rows)  # every column of the table

    def explanation(self, request_id: str | None = None) -> ExplanationRow | None:
        """One request's explanation (the latest when `request_id` is None)."""
        if request_id is None:
            rows = self._rows("SELECT * FROM explanations ORDER BY id DESC LIMIT 1")
        else:
            rows = self._rows(
                "SELECT * FROM explanations WHERE request_id = ? ORDER BY id DESC LIMIT 1",
                [request_id],
            )
        return cast(ExplanationRow, rows[0]) if rows else None  # every column of the table
