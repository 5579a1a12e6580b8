"""The one /metrics (core.proxy.metrics) over a real telemetry file: counters that never
go down across the hourly prune and a restart (core.telemetry.totals keeps what pruned
rows added up to), HELP and TYPE on every series, and no history read per scrape.

The events are the ones the proxy, the cache and the supervisor emit, recorded as the
engine records them: into the history and into the counters. The whole Core over a real
llama-server: tests/integration/test_metrics_lifetime.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.events import (
    CacheEvent,
    CacheEventKind,
    Event,
    RequestCompleted,
    ServerExited,
    ServerLaunched,
)
from core.proxy.metrics import Counters, Metrics
from core.telemetry import Telemetry
from core.telemetry.totals import lifetime

DAY = 86400.0


class Clock:
    """The history's clock; events carry their own time (now), so it starts now."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _request(
    user: str, prompt: int, cached: int, status: int = 200, ts: float | None = None
) -> RequestCompleted:
    return RequestCompleted(
        ts=time.time() if ts is None else ts,
        request_id=f"r-{user}-{prompt}",
        client="test",
        session="s",
        endpoint="chat",
        stream=True,
        has_tools=False,
        status=status,
        prompt_n=prompt,
        cache_n=cached,
        prompt_ms=prompt * 2.0,
        user=user,
    )


def _launched(run_id: str) -> ServerLaunched:
    return ServerLaunched(
        run_id=run_id,
        pid=1,
        port=1,
        argv=("llama-server",),
        binary="b",
        binary_version="v",
        model="m",
    )


EVENTS: list[Event] = [
    _request("alice", 100, 900),
    _request("alice", 10, 990),
    _request("bob", 50, 0, status=500),
    _request("", 7, 3),
    CacheEvent(kind=CacheEventKind.BYPASS, reason="cache manager failed: boom"),
    _launched("r1"),
    _launched("r2"),
    ServerExited(run_id="r1", pid=1, returncode=-11, signal=11, outcome="crashed", requested_by=""),
    ServerExited(
        run_id="r2", pid=2, returncode=0, signal=None, outcome="requested", requested_by="x"
    ),
]


class Run:
    """One Warmslot run: its history file open, its counters seeded from it."""

    def __init__(self, path: Path, clock: Clock) -> None:
        self.telemetry = Telemetry(path, clock=clock)
        self.counters = Counters()
        self.counters.seed(lifetime(self.telemetry))
        self.metrics = Metrics(self.counters, server_ready=lambda: True)

    def emit(self, event: Event) -> None:
        self.telemetry.record(event)
        self.counters.record(event)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every counter sample by name and labels."""
        text = self.metrics.exposition().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            if family.type == "counter"
            for s in family.samples
        }


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[tuple[Path, Clock, list[Run]]]:
    made: list[Run] = []
    yield tmp_path / "telemetry.db", Clock(), made
    for r in made:
        r.telemetry.close()


def _never_down(before: dict[object, float], after: dict[object, float]) -> None:
    lower = {k: (v, after.get(k)) for k, v in before.items() if after.get(k, -1.0) < v}
    assert lower == {}, f"went down or vanished: {lower}"


def test_counters_never_go_down_across_a_prune_and_a_restart(
    runs: tuple[Path, Clock, list[Run]],
) -> None:
    path, clock, made = runs
    first = Run(path, clock)
    made.append(first)
    for e in EVENTS:
        first.emit(e)
    one = first.scrape()
    assert one[("warmslot_requests_total", ())] == 4
    assert one[("warmslot_request_errors_total", ())] == 1
    assert one[("warmslot_prompt_tokens_total", ())] == 167
    assert one[("warmslot_cached_tokens_total", ())] == 1893
    assert one[("warmslot_cache_bypass_total", ())] == 1
    assert one[("warmslot_server_crashes_total", ())] == 1
    assert one[("warmslot_user_requests_total", (("user", "alice"),))] == 2
    assert one[("warmslot_user_prefill_seconds_total", (("user", "alice"),))] == 0.22
    assert ("warmslot_user_requests_total", (("user", ""),)) not in one  # no key: no series

    # The hourly prune, past the retention window: every row goes.
    clock.now += 8 * DAY
    assert first.telemetry.prune(retention_days=7) > 0
    assert first.telemetry.per_user() == [] and first.telemetry.server_runs() == []
    two = first.scrape()
    _never_down(one, two)
    assert two == one

    # Warmslot starts again on the same file: it goes on from there.
    first.telemetry.close()
    made.remove(first)
    second = Run(path, clock)
    made.append(second)
    three = second.scrape()
    assert three == one
    second.emit(_request("alice", 5, 5))
    four = second.scrape()
    _never_down(three, four)
    assert four[("warmslot_user_requests_total", (("user", "alice"),))] == 3
    assert four[("warmslot_requests_total", ())] == 5

    # A prune of half the history, then a start: the carried part and the kept part add up.
    clock.now += 1 * DAY
    second.emit(_request("bob", 1, 1, ts=clock.now))
    second.telemetry.prune(retention_days=0.5)  # the request just above stays
    assert [u["user"] for u in second.telemetry.per_user()] == ["bob"]
    second.telemetry.close()
    made.remove(second)
    third = Run(path, clock)
    made.append(third)
    assert third.scrape() == second.scrape()


def test_every_series_has_help_and_type_and_a_scrape_reads_no_history(
    runs: tuple[Path, Clock, list[Run]],
) -> None:
    path, clock, _ = runs
    run = Run(path, clock)
    for e in EVENTS:
        run.emit(e)
    # The history is closed: a scrape still answers, from memory.
    run.telemetry.close()
    text = run.metrics.exposition().decode()
    helps = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")}
    types = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE ")}
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 12
    for family in families:
        for sample in family.samples:
            assert sample.name in helps, f"{sample.name} has no HELP"
            assert types.get(sample.name) == family.type, f"{sample.name} has no TYPE"
        assert family.documentation and family.type in ("counter", "gauge")
    gauges = {f.name: f.samples[0].value for f in families if f.type == "gauge"}
    assert gauges == {"warmslot_hit_ratio": 1893 / 2060, "warmslot_server_ready": 1.0}
