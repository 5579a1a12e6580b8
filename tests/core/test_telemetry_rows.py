"""Every read query of telemetry returns rows of the type it declares
(core.telemetry.rows, core.status): a real SQLite database filled with a month of
synthetic history, each query's rows held against their TypedDict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.cache.explain import from_row
from core.events import RequestExplained, SweepRun
from core.status import ClientRow, ColdRate, Explanation, RequestRow, SessionRow, Totals, UserRow
from core.telemetry import QUERIES, Telemetry
from core.telemetry.queries import ColdSums
from core.telemetry.rows import (
    EventRow,
    ExplanationRow,
    HitRateRow,
    PressureRow,
    ServerRunRow,
    SweepRunRow,
    TtfbMedians,
)
from tests.fixtures import demo_data as demo
from tests.fixtures.status_shapes import shape_errors

NOW = 1_780_000_000.0

# query name → (keyword arguments, the type of one row; a bare type: not a list)
EXPECTED: dict[str, tuple[dict[str, Any], Any]] = {
    "hit_rate": ({"bucket": "hour", "since": NOW - 86400, "until": NOW}, HitRateRow),
    "totals": ({}, (Totals,)),
    "per_client": ({}, ClientRow),
    "per_user": ({}, UserRow),
    "sessions": ({"since": 0.0}, SessionRow),
    "cold_prefill_rate": ({}, (ColdRate,)),
    "recent_requests": ({"limit": 50}, RequestRow),
    "recent_events": ({"limit": 200}, EventRow),
    "server_runs": ({}, ServerRunRow),
    "sweep_runs": ({}, SweepRunRow),
    "pressure_series": ({"since": NOW - 86400}, PressureRow),
    "ttfb": ({}, (TtfbMedians,)),
    "explanations": ({}, ExplanationRow),
    "explanation": ({}, (ExplanationRow,)),
    "cold_prefill_rates": ({}, (dict[str, ColdSums],)),
}


def test_every_query_returns_its_declared_rows(tmp_path: Path) -> None:
    tel = Telemetry(tmp_path / "t.db", clock=lambda: NOW)
    try:
        demo.fill(tel, NOW, days=2)
        tel.record(SweepRun(name="retention", started=NOW - 5, duration_s=0.2, ts=NOW - 5,
                            actions=1, details={"deleted": 1}))  # fmt: skip
        divergence = {"token": 7, "section": "system", "offset": 7, "old_section": "system",
                      "before": "a", "old": "b", "new": "c"}  # fmt: skip
        tel.record(
            RequestExplained(
                request_id="r1", client="opencode", session="s", slot=0, n_tokens=40,
                cache_n=7, prompt_n=33, previous_tokens=40, div_token=7, div_section="system",
                lost_tokens=33, cost_s=0.4, summary="diverged", ts=NOW - 1,
                sections=json.dumps([{"name": "system", "start": 0, "n_tokens": 40}]),
                divergence=json.dumps(divergence), compute_ms=1.5,
            )
        )  # fmt: skip
        assert set(EXPECTED) == set(QUERIES)  # a new query gets its row type here too
        for name, (kwargs, row_type) in EXPECTED.items():
            got = tel.query(name, **kwargs)
            if isinstance(row_type, tuple):
                assert shape_errors(got, row_type[0], name) == []
            else:
                assert got, f"{name}: the demo history should give rows"
                errors = [
                    e for i, r in enumerate(got) for e in shape_errors(r, row_type, f"{name}[{i}]")
                ]
                assert errors == []
        # An explanation read back from the database has the in-memory shape.
        row = tel.explanation("r1")
        assert row is not None
        assert shape_errors(from_row(row), Explanation, "from_row") == []
    finally:
        tel.close()
