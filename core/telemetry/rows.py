"""The rows telemetry's read queries return (`core.telemetry.QUERIES`, run by name by
`Core.query` and the dashboard): one TypedDict per query, its keys the columns the
query selects. The rows of the status (`totals`, `per_client`, `sessions`,
`recent_requests` …) are in `core.status`.

Like `core.status`, this module imports nothing from the rest of the core.
"""

from __future__ import annotations

from typing import TypedDict


class HitRateRow(TypedDict):
    """`hit_rate`: one time bucket of requests that reported timings."""

    bucket: int  # its start, epoch seconds
    requests: int
    cached: int  # tokens reused
    new: int  # tokens prefilled
    total: int
    hit_ratio: float | None


class EventRow(TypedDict):
    """`recent_events`: a recorded event (core.events), newest first."""

    id: int
    ts: float
    category: str  # cache | server | notice | …
    kind: str
    reason: str | None
    fingerprint: str | None
    slot: int | None
    tokens: int | None
    bytes: int | None
    details: dict[str, object]  # per kind (docs/cache.md); {} when none


class ServerRunRow(TypedDict):
    """`server_runs`: one run of llama-server, newest first."""

    run_id: str
    started: float
    ended: float | None  # None while it runs
    pid: int | None
    port: int | None
    argv: list[str]
    binary: str | None
    binary_version: str | None
    model: str | None
    attempt: str | None
    outcome: str | None  # requested | crashed | start_failed; None while it runs
    returncode: int | None
    signal: int | None
    requested_by: str | None
    last_lines: list[str]


class SweepRunRow(TypedDict):
    """`sweep_runs`: one run of a background sweep (core.sweeps), newest first."""

    id: int
    ts: float
    name: str
    started: float
    duration_s: float
    actions: int
    error: str
    details: dict[str, object]  # what the sweep reported (its Outcome's details)


class PressureRow(TypedDict):
    """`pressure_series`: one pressure sample (core.pressure), oldest first."""

    id: int
    ts: float
    level: str
    ram_available_pct: float
    swap_used_pct: float
    server_rss: int | None
    disk_free_pct: float | None
    gpus: list[list[int]]  # [index, total bytes, free bytes] per GPU


class TtfbMedians(TypedDict):
    """`ttfb`: medians (ms) of warm and cold requests, and how many each had."""

    warm: float | None  # time to first byte of streamed requests
    warm_n: int
    warm_prefill: float | None  # prefill time (prompt_ms)
    warm_prefill_n: int
    cold: float | None
    cold_n: int
    cold_prefill: float | None
    cold_prefill_n: int


class ExplanationRow(TypedDict):
    """`explanations` / `explanation`: why a request reused what it did
    (core.cache.explain); sections and divergence as JSON text."""

    id: int
    ts: float
    request_id: str
    client: str
    session: str
    slot: int | None
    n_tokens: int
    cache_n: int
    prompt_n: int
    previous_tokens: int | None
    div_token: int | None
    div_section: str
    lost_tokens: int
    cost_s: float | None
    summary: str
    sections: str  # JSON list
    divergence: str  # JSON object or null
    compute_ms: float
