"""Hit-rate buckets that are over do not change: ask the core only for the new ones.

`hit_rate(bucket, since, until)` over 30 days of day buckets scans every request
of the month (about a second at a million rows). A finished bucket's numbers
are final once its rows are flushed, so `BucketCache` keeps them and a refresh
asks only for the buckets from the first unfinished one on. Every
`FULL_RELOAD_S` (and whenever the window moves past what is cached) it reloads
everything, so rows deleted by retention pruning also disappear from the chart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from core.telemetry import BUCKETS

SETTLE_S = 10.0  # a bucket is final this long after it ends (telemetry flushes every second)
FULL_RELOAD_S = 600.0


@dataclass
class _Cached:
    rows: dict[float, dict[str, Any]] = field(default_factory=dict)
    since: float = 0.0  # the window start the rows were loaded from
    final_until: float = 0.0  # buckets before this are final
    loaded_at: float = -math.inf


class BucketCache:
    """Finished `hit_rate` buckets, per bucket size."""

    def __init__(self) -> None:
        self._by_bucket: dict[str, _Cached] = {}

    def clear(self) -> None:
        self._by_bucket.clear()

    def query_since(self, bucket: str, since: float, now: float) -> float:
        """Where the next query for [since, now) has to start."""
        c = self._by_bucket.get(bucket)
        if c is None or now - c.loaded_at > FULL_RELOAD_S or since < c.since:
            return since
        return max(since, c.final_until)

    def merge(
        self, bucket: str, since: float, query_since: float, rows: list[dict[str, Any]], now: float
    ) -> list[dict[str, Any]]:
        """Combine cached final buckets with fresh `rows` (which start at `query_since`)."""
        size = BUCKETS[bucket]
        c = self._by_bucket.get(bucket)
        if c is None or query_since == since:
            c = _Cached(since=since, loaded_at=now)
            self._by_bucket[bucket] = c
        kept = {b: r for b, r in c.rows.items() if since <= b < query_since}
        kept.update({float(r["bucket"]): r for r in rows})
        c.rows = kept
        c.since = since
        c.final_until = max(since, math.floor((now - SETTLE_S) / size) * size)
        return [c.rows[b] for b in sorted(c.rows)]
