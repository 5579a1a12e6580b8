"""Lifetime totals of the history: what every request, cache bypass and llama-server
crash ever recorded adds up to, also after `Telemetry.prune` deleted the rows.

`carry` runs inside the prune's transaction, just before the deletes: it adds what the
doomed rows sum to into the ``totals`` table. `lifetime` is that table plus the rows
still kept. So the sums never go down when rows are pruned, and a Warmslot that starts
again continues from where the last one stopped (`core.proxy.metrics` seeds its
counters from it once at start, then counts in memory).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Protocol

import sqlite_utils

__all__ = ["History", "LifetimeTotals", "UserTotals", "carry", "lifetime"]


@dataclass
class UserTotals:
    """The requests of one caller (an API key's name; "" without named keys)."""

    requests: int = 0
    errors: int = 0  # answered with status >= 400, or failed
    prompt_tokens: int = 0  # evaluated, not from the cache
    cached_tokens: int = 0  # reused from the KV cache
    prefill_ms: float = 0.0

    def add(self, other: UserTotals) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.prefill_ms += other.prefill_ms


@dataclass
class LifetimeTotals:
    """Everything the history ever counted, per user, plus the cache bypasses (cache
    failures after which a request went on untouched) and llama-server crashes."""

    users: dict[str, UserTotals] = field(default_factory=dict)
    cache_bypasses: int = 0
    server_crashes: int = 0

    def user(self, name: str) -> UserTotals:
        """The totals of `name`, made empty on first use."""
        return self.users.setdefault(name, UserTotals())

    def add(self, other: LifetimeTotals) -> None:
        for name, totals in other.users.items():
            self.user(name).add(totals)
        self.cache_bypasses += other.cache_bypasses
        self.server_crashes += other.server_crashes

    @property
    def all(self) -> UserTotals:
        """Every user's requests together."""
        out = UserTotals()
        for totals in self.users.values():
            out.add(totals)
        return out


# One SELECT per table, over the rows before a cutoff (`carry`) or all of them
# (`lifetime`); the same definitions as the events that make the rows count them.
_REQUESTS = """SELECT user, COUNT(*), SUM(CASE WHEN status >= 400 OR error != '' THEN 1 ELSE 0 END),
                      COALESCE(SUM(prompt_n), 0), COALESCE(SUM(cache_n), 0),
                      COALESCE(SUM(prompt_ms), 0.0)
               FROM requests WHERE ts < ? GROUP BY user"""
_BYPASSES = "SELECT COUNT(*) FROM events WHERE ts < ? AND category = 'cache' AND kind = 'bypass'"
_CRASHES = "SELECT COUNT(*) FROM server_runs WHERE started < ? AND outcome = 'crashed'"
_USER_COLUMNS = ("requests", "errors", "prompt_tokens", "cached_tokens", "prefill_ms")


def _rows_before(conn: sqlite3.Connection, cutoff: float) -> LifetimeTotals:
    out = LifetimeTotals()
    for user, *values in conn.execute(_REQUESTS, [cutoff]):
        out.users[user or ""] = UserTotals(
            requests=int(values[0]),
            errors=int(values[1] or 0),
            prompt_tokens=int(values[2]),
            cached_tokens=int(values[3]),
            prefill_ms=float(values[4]),
        )
    out.cache_bypasses = int(conn.execute(_BYPASSES, [cutoff]).fetchone()[0])
    out.server_crashes = int(conn.execute(_CRASHES, [cutoff]).fetchone()[0])
    return out


def carry(conn: sqlite3.Connection, cutoff: float) -> None:
    """Add what the rows older than `cutoff` sum to into the ``totals`` table; call it in
    the transaction that deletes them."""
    doomed = _rows_before(conn, cutoff)
    adds: list[tuple[str, str, float]] = [
        (column, user, float(getattr(totals, column)))
        for user, totals in doomed.users.items()
        for column in _USER_COLUMNS
    ]
    adds += [("cache_bypasses", "", doomed.cache_bypasses)]
    adds += [("server_crashes", "", doomed.server_crashes)]
    conn.executemany(
        """INSERT INTO totals (name, label, value) VALUES (?, ?, ?)
           ON CONFLICT (name, label) DO UPDATE SET value = value + excluded.value""",
        [a for a in adds if a[2]],
    )


class History(Protocol):
    """What `lifetime` needs of `core.telemetry.Telemetry`."""

    db: sqlite_utils.Database

    def flush(self) -> None: ...


def lifetime(history: History) -> LifetimeTotals:
    """What was carried out of pruned rows, plus the rows kept (one pass over each), with
    everything buffered written first. Read once at start: a SQL aggregate over all of
    the history, never run per scrape."""
    history.flush()
    conn = history.db.conn
    out = _rows_before(conn, float("inf"))
    for name, label, value in conn.execute("SELECT name, label, value FROM totals"):
        if name in _USER_COLUMNS:
            totals = out.user(label)
            carried = float(value) if name == "prefill_ms" else int(value)
            setattr(totals, name, getattr(totals, name) + carried)
        elif name == "cache_bypasses":
            out.cache_bypasses += int(value)
        elif name == "server_crashes":
            out.server_crashes += int(value)
    return out
