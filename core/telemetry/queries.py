"""The read queries of the telemetry database: the only methods that may be run by
name (`QUERIES`: `Telemetry.query`, `Core.query`, the GUI's offline backend)."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable
from typing import Any, TypedDict, cast

from core.status import ClientRow, ColdRate, ModelSaving, RequestRow, SessionRow, Totals, UserRow

# The cold-prefill rule is the one estimator's (core.telemetry.rates).
from core.telemetry.rates import COLD_MIN_TOKENS
from core.telemetry.rows import (
    EventRow,
    ExplanationRow,
    HitRateRow,
    PressureRow,
    ServerRunRow,
    SweepRunRow,
    TtfbMedians,
)

log = logging.getLogger("warmslot.telemetry")


class ColdSums(TypedDict):
    """One model's cold prefills: tokens read and the milliseconds they took."""

    tokens: int
    ms: float


BUCKETS = {"minute": 60, "hour": 3600, "day": 86400}
# The queries that may be run by name (`Telemetry.query`, `Core.query`, the GUI): the
# read-only methods of `Queries` (which `Telemetry` is). Kept here, beside them, so a
# new query is added in one place.
QUERIES = frozenset(
    {
        "hit_rate",
        "totals",
        "per_client",
        "sessions",
        "cold_prefill_rate",
        "cold_prefill_rates",
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


_warned: set[str] = set()  # the columns whose unreadable values were logged (once each)
# A row counts in a time window only when its time is a number: a row with text there (no
# version writes one) is in no window, instead of in every one (SQLite orders text after
# numbers).
TS = "typeof(ts) IN ('integer', 'real') AND ts"


def _warn(column: str, value: object) -> None:
    if column not in _warned:
        _warned.add(column)
        log.warning(
            "telemetry: ignoring an unreadable %s value in the history: %.80r", column, value
        )


def _json(value: object, default: Any, column: str) -> Any:
    """A JSON column's value, or `default` for an empty or unreadable one: a damaged row of
    history is shown without its details, never fails the query that lists it."""
    if not value:
        return default
    try:
        out = json.loads(value) if isinstance(value, str | bytes) else None
    except ValueError:
        out = None
    if out is None or type(out) is not type(default):
        _warn(column, value)
        return default
    return out


def _typed(table: str, types: dict[str, str], row: dict[str, Any]) -> dict[str, Any]:
    """`row` with each column of `table` as its declared type says: a number where text
    belongs becomes text, text where a number belongs becomes None (logged once)."""
    for key, value in row.items():
        kind = types.get(key, "")
        if value is None or not kind:
            continue
        if kind == "TEXT" and not isinstance(value, str):
            row[key] = str(value)
        elif kind in ("INTEGER", "FLOAT", "REAL") and not isinstance(value, int | float):
            _warn(f"{table}.{key}", value)
            row[key] = None
    return row


class Queries:
    """The read-only queries of `core.telemetry.Telemetry`, which owns the connection
    and the write buffer; each query writes what is buffered first, so it sees it."""

    # Set by Telemetry, the owner of the database.
    _conn: sqlite3.Connection
    _clock: Any
    dropped: int

    def flush(self) -> None:
        """Write everything buffered (`Telemetry.flush`)."""
        raise NotImplementedError

    def query(self, name: str, **kwargs: Any) -> Any:
        """Run the read-only query `name` (one of `QUERIES`) with `kwargs`.

        How `Core.query` and the GUI's offline backend run a query by name: only the
        names in `QUERIES` are accepted, never another method (``prune``, ``close`` …).
        Raises ValueError for any other name.
        """
        if name not in QUERIES:
            raise ValueError(f"unknown query {name!r}")
        return getattr(self, name)(**kwargs)

    def _rows(
        self, sql: str, params: Iterable[Any] = (), *, table: str = ""
    ) -> list[dict[str, Any]]:
        """The rows of a query; with `table`, its columns checked against their declared
        types (`_typed`): a damaged row of history never fails the caller that formats it."""
        self.flush()
        cur = self._conn.execute(sql, list(params))
        cols = [c[0] for c in cur.description]
        rows = [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
        if table:
            info = self._conn.execute(f"PRAGMA table_info({table})").fetchall()
            types = {str(c[1]): str(c[2]).upper() for c in info}
            rows = [_typed(table, types, r) for r in rows]
        return rows

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
                FROM requests WHERE {TS} >= ? AND ts < ? AND prompt_n IS NOT NULL
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
            f"""SELECT COUNT(*) AS requests,
                      COALESCE(SUM(prompt_n), 0) AS prompt_tokens,
                      COALESCE(SUM(cache_n), 0) AS cached_tokens,
                      COALESCE(SUM(prompt_ms), 0) AS prompt_ms,
                      SUM(CASE WHEN status >= 400 OR error != '' THEN 1 ELSE 0 END) AS errors
               FROM requests WHERE {TS} >= ?""",
            [since],
        )[0]
        total = row["prompt_tokens"] + row["cached_tokens"]
        row["hit_ratio"] = row["cached_tokens"] / total if total else None
        # Seconds saved: each model's cached tokens priced at that model's cold prefill
        # rate — what reading them again would have cost (the rule of the response
        # headers' X-Warmslot-Est-Saved-Ms, core.telemetry.rates.PrefillRate). Small
        # follow-up prefills run several times slower per token than a long cold one
        # (51 vs 19 ms/token measured), so pricing at the average rate overstated the
        # saving 2–3×; one rate for two models priced a fast one at a slow one's rate.
        rate = self.cold_prefill_rate(since)
        if rate["ms_per_token"] is None and since > 0:
            rate = self.cold_prefill_rate()  # none in this window: the longest history
        row["cold_rate"] = rate
        by_model: list[ModelSaving] = []
        for m in self._rows(
            f"""SELECT CAST(COALESCE(model, '') AS TEXT) AS model,
                       COALESCE(SUM(cache_n), 0) AS cached
                FROM requests WHERE {TS} >= ? GROUP BY 1 ORDER BY 2 DESC""",
            [since],
        ):
            own = self.cold_prefill_rate(since, model=m["model"])
            if own["ms_per_token"] is None and since > 0:
                own = self.cold_prefill_rate(model=m["model"])
            ms = own["ms_per_token"]
            by_model.append(
                {
                    "model": m["model"],
                    "cached_tokens": int(m["cached"]),
                    "cold_rate": own,
                    "seconds_saved": m["cached"] * ms / 1000.0 if ms else 0.0,
                }
            )
        row["by_model"] = by_model
        row["seconds_saved"] = sum(m["seconds_saved"] for m in by_model)
        row["errors"] = row["errors"] or 0
        row["dropped_rows"] = self.dropped  # rows telemetry could not write (since start)
        return cast(Totals, row)  # the SELECT names every key

    def cold_prefill_rate(
        self, since: float | None = None, *, model: str | None = None
    ) -> ColdRate:
        """Milliseconds per token of cold prefills (of one `model`'s requests, by file name;
        of all when None): requests of at least COLD_MIN_TOKENS new tokens that reused
        under a tenth of that. None when there was none."""
        by = "" if model is None else "AND CAST(COALESCE(model, '') AS TEXT) = ?"
        row = self._rows(
            f"""SELECT COUNT(*) AS requests, COALESCE(SUM(prompt_n), 0) AS tokens,
                      COALESCE(SUM(prompt_ms), 0) AS ms
               FROM requests WHERE {TS} >= ? AND prompt_n >= ? AND prompt_ms > 0
                    AND COALESCE(cache_n, 0) * 10 <= prompt_n {by}""",
            [0.0 if since is None else since, COLD_MIN_TOKENS, *([] if model is None else [model])],
        )[0]
        per = row["ms"] / row["tokens"] if row["tokens"] else None
        return {"ms_per_token": per, "requests": row["requests"], "tokens": row["tokens"]}

    def cold_prefill_rates(self) -> dict[str, ColdSums]:
        """Every model's cold prefills in the history (by file name): what the proxy's
        estimator starts from (`core.telemetry.rates.PrefillRates.seed`)."""
        rows = self._rows(
            f"""SELECT CAST(COALESCE(model, '') AS TEXT) AS model,
                      COALESCE(SUM(prompt_n), 0) AS tokens, COALESCE(SUM(prompt_ms), 0) AS ms
               FROM requests WHERE {TS} >= 0 AND prompt_n >= ? AND prompt_ms > 0
                    AND COALESCE(cache_n, 0) * 10 <= prompt_n GROUP BY 1""",
            [COLD_MIN_TOKENS],
        )
        out: dict[str, ColdSums] = {}
        for r in rows:
            out[r["model"]] = {"tokens": int(r["tokens"]), "ms": float(r["ms"])}
        return out

    def per_client(self, since: float | None = None) -> list[ClientRow]:
        since = 0.0 if since is None else since
        rows = self._rows(
            f"""SELECT CAST(COALESCE(client, '') AS TEXT) AS client, COUNT(*) AS requests,
                      COALESCE(SUM(cache_n), 0) AS cached, COALESCE(SUM(prompt_n), 0) AS new
               FROM requests WHERE {TS} >= ? GROUP BY 1 ORDER BY requests DESC""",
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
            f"""SELECT CAST(COALESCE(user, '') AS TEXT) AS user, COUNT(*) AS requests,
                      COALESCE(SUM(prompt_n), 0) AS prompt_tokens,
                      COALESCE(SUM(cache_n), 0) AS cached_tokens,
                      COALESCE(SUM(prompt_ms), 0) / 1000.0 AS prefill_s, MAX(ts) AS last_used
               FROM requests WHERE {TS} >= ? GROUP BY 1 ORDER BY requests DESC""",
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
            f"""SELECT CAST(COALESCE(client, '') AS TEXT) AS client,
                      CAST(COALESCE(session, '') AS TEXT) AS session, COUNT(*) AS requests,
                      COALESCE(SUM(cache_n), 0) AS cached, COALESCE(SUM(prompt_n), 0) AS new,
                      COALESCE(SUM(prompt_ms), 0) AS prefill_ms, MIN(ts) AS first_seen,
                      MAX(ts) AS last_seen, slot, GROUP_CONCAT(DISTINCT kind) AS kinds
               FROM requests WHERE {TS} >= ?
                    AND endpoint IN ('chat', 'messages', 'responses', 'completions', 'completion')
               GROUP BY 1, 2 ORDER BY last_seen DESC LIMIT ?""",
            [since, limit],
        )
        for r in rows:
            total = r["cached"] + r["new"]
            r["hit_ratio"] = r["cached"] / total if total else None
        return cast(list[SessionRow], rows)  # the SELECT names every key

    def recent_requests(self, limit: int = 50) -> list[RequestRow]:
        """The latest requests, newest first (every column of the table)."""
        rows = self._rows(
            f"SELECT * FROM requests WHERE {TS} > 0 ORDER BY id DESC LIMIT ?",
            [limit],
            table="requests",
        )
        return cast(list[RequestRow], rows)

    def recent_events(
        self,
        limit: int = 100,
        category: str | None = None,
        kind: str | None = None,
        since: float | None = None,
    ) -> list[EventRow]:
        """The latest events (of a category, of a kind, since a time), newest first."""
        where = [f"{TS} >= ?"]
        params: list[Any] = [0.0 if since is None else since]
        if category:
            where.append("category = ?")
            params.append(category)
        if kind:
            where.append("kind = ?")
            params.append(kind)
        params.append(limit)
        rows = self._rows(
            f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?",
            params,
            table="events",
        )
        for r in rows:
            r["details"] = _json(r["details"], {}, "events.details")
        return cast(list[EventRow], rows)  # every column of the table

    def server_runs(self, limit: int = 20) -> list[ServerRunRow]:
        """The latest runs of llama-server, newest first."""
        rows = self._rows(
            "SELECT * FROM server_runs WHERE typeof(started) IN ('integer', 'real') "
            "ORDER BY started DESC LIMIT ?",
            [limit],
            table="server_runs",
        )
        for r in rows:
            r["argv"] = _json(r["argv"], [], "server_runs.argv")
            r["last_lines"] = _json(r["last_lines"], [], "server_runs.last_lines")
        return cast(list[ServerRunRow], rows)  # every column of the table

    def sweep_runs(self, sweep: str | None = None, limit: int = 50) -> list[SweepRunRow]:
        """The latest runs of the background sweeps (or of one), newest first."""
        where, params = ("WHERE name = ?", [sweep]) if sweep else ("", [])
        rows = self._rows(
            f"SELECT * FROM sweeps {where} ORDER BY id DESC LIMIT ?",
            [*params, limit],
            table="sweeps",
        )
        for r in rows:
            r["details"] = _json(r["details"], {}, "sweeps.details")
        return cast(list[SweepRunRow], rows)  # every column of the table

    def pressure_series(self, since: float | None = None) -> list[PressureRow]:
        """Pressure samples since `since` (default: the last hour), oldest first."""
        since = self._clock() - 3600 if since is None else since
        rows = self._rows(
            f"SELECT * FROM pressure WHERE {TS} >= ? ORDER BY ts", [since], table="pressure"
        )
        for r in rows:
            r["gpus"] = _json(r["gpus"], [], "pressure.gpus")
        return cast(list[PressureRow], rows)  # every column of the table

    def ttfb(self, since: float | None = None) -> TtfbMedians:
        """Medians for warm (mostly cached) and cold requests: prefill time (`prompt_ms`,
        keys ``warm_prefill``/``cold_prefill``) and the time to first byte of streamed
        requests (``warm``/``cold``). A non-streamed response's first byte comes after
        the whole generation, which hides what the cache saved."""
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
                        f"SELECT {column} FROM requests WHERE {TS} >= ? "
                        f"AND typeof({column}) IN ('integer', 'real') "
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
        rows = self._rows(
            f"SELECT * FROM explanations {where} ORDER BY id DESC LIMIT ?",
            [limit],
            table="explanations",
        )
        return cast(list[ExplanationRow], rows)  # every column of the table

    def explanation(self, request_id: str | None = None) -> ExplanationRow | None:
        """One request's explanation (the latest when `request_id` is None)."""
        if request_id is None:
            rows = self._rows(
                "SELECT * FROM explanations ORDER BY id DESC LIMIT 1", table="explanations"
            )
        else:
            rows = self._rows(
                "SELECT * FROM explanations WHERE request_id = ? ORDER BY id DESC LIMIT 1",
                [request_id],
                table="explanations",
            )
        return cast(ExplanationRow, rows[0]) if rows else None  # every column of the table
