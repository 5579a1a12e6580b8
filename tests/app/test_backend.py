"""The offline backend runs the core's telemetry queries by the core's own whitelist."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.backend import TelemetryBackend
from core.telemetry import QUERIES
from tests.app.conftest import NOW


def test_offline_backend_answers_every_query_the_core_answers(known_db: Path) -> None:
    backend = TelemetryBackend(known_db, clock=lambda: NOW)
    try:
        # sweep_runs was once missing here while Core.query had it.
        assert backend.query("sweep_runs", limit=5).result(10) == []
        assert backend.query("totals").result(10)["requests"] > 0
        for name in QUERIES:
            backend.query(name).result(10)  # each one runs with its defaults
        refused = backend.query("prune", retention_days=0)
        with pytest.raises(ValueError, match="unknown query 'prune'"):
            refused.result(10)
        assert backend.query("totals").result(10)["requests"] > 0  # nothing was pruned
    finally:
        backend.close()
