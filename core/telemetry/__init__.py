"""Telemetry: the SQLite history behind status, charts and benchmarks.

The core thread owns the one writer connection (sqlite connections are bound
to their thread). Writes are buffered and flushed in one transaction every
second or every `BATCH` rows; queries flush first so they see everything. WAL
lets the GUI open its own read-only connection. The schema evolves through
sqlite-utils `Migrations`; old rows are deleted by `prune`.

The package's modules: `schema` (the tables and their migrations), `store`
(`Telemetry`: the connection and the buffered writer) and `queries` (the read
queries, `QUERIES`). Callers import from ``core.telemetry``.
"""

from __future__ import annotations

from core.telemetry.queries import BUCKETS, QUERIES, Queries
from core.telemetry.schema import migrations
from core.telemetry.store import BATCH, MAX_PENDING, Telemetry, safe_text

__all__ = [
    "BATCH",
    "BUCKETS",
    "MAX_PENDING",
    "QUERIES",
    "Queries",
    "Telemetry",
    "migrations",
    "safe_text",
]
