"""Telemetry on a real SQLite file: batching, queries against hand-computed numbers, prune."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from core import dbfile
from core import telemetry as telemetry_mod
from core.events import (
    CacheEvent,
    Notice,
    PressureSample,
    RequestCompleted,
    ServerExited,
    ServerLaunched,
    ServerStateChanged,
)
from core.telemetry import Telemetry
from core.telemetry import store as telemetry_store
from tests.helpers import wait_until

T = 1_800_000_000.0  # a multiple of 3600: minute and hour buckets start here
DAY = 86400.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(ts: float, **kw: Any) -> RequestCompleted:
    base: dict[str, Any] = {
        "request_id": f"r{ts}",
        "client": "opencode",
        "session": "s1",
        "endpoint": "chat",
        "stream": True,
        "has_tools": True,
        "status": 200,
        "slot": 0,
        "ttfb_ms": 10.0,
        "total_ms": 50.0,
    }
    base.update(kw)
    return RequestCompleted(ts=ts, **base)


@pytest.fixture
def clock() -> Clock:
    return Clock(T + 1800)


@pytest.fixture
def tel(tmp_path: Path, clock: Clock) -> Any:
    t = Telemetry(tmp_path / "state" / "telemetry.sqlite3", clock=clock)
    yield t
    t.close()


@pytest.fixture
def known_rows(tel: Telemetry) -> Telemetry:
    """Five requests whose sums are worked out by hand in the tests below."""
    rows = [
        req(T + 5, prompt_n=100, cache_n=0, prompt_ms=100.0, ttfb_ms=300.0),
        req(T + 30, prompt_n=10, cache_n=90, prompt_ms=10.0, ttfb_ms=12.0),
        req(T + 65, prompt_n=20, cache_n=180, prompt_ms=20.0, ttfb_ms=8.0),
        req(T + 70, status=502, error="llama-server stopped mid-stream", ttfb_ms=None),
        req(T + 3700, client="curl", prompt_n=50, cache_n=50, prompt_ms=50.0, ttfb_ms=200.0),
    ]
    for r in rows:
        tel.record(r)
    return tel


def test_hit_rate_per_minute(known_rows: Telemetry) -> None:
    got = known_rows.hit_rate("minute", since=T, until=T + 3600)
    assert got == [
        # r1 + r2; r4 has no timings and is left out; r5 is after `until`.
        {"bucket": T, "requests": 2, "cached": 90, "new": 110, "total": 200, "hit_ratio": 0.45},
        {"bucket": T + 60, "requests": 1, "cached": 180, "new": 20, "total": 200, "hit_ratio": 0.9},
    ]


def test_hit_rate_per_hour_and_default_window(known_rows: Telemetry, clock: Clock) -> None:
    got = known_rows.hit_rate("hour", since=T, until=T + 7200)
    assert [(r["bucket"], r["requests"], r["cached"], r["new"]) for r in got] == [
        (T, 3, 270, 130),
        (T + 3600, 1, 50, 50),
    ]
    assert got[0]["hit_ratio"] == pytest.approx(0.675)
    assert got[1]["hit_ratio"] == 0.5
    # Default window: the last hour before the clock (T+1800) → only the first hour's rows.
    clock.now = T + 1800
    assert sum(r["requests"] for r in known_rows.hit_rate("minute")) == 3


def test_totals(known_rows: Telemetry) -> None:
    t = known_rows.totals()
    assert t["requests"] == 5
    assert t["prompt_tokens"] == 180
    assert t["cached_tokens"] == 320
    assert t["errors"] == 1
    assert t["hit_ratio"] == pytest.approx(320 / 500)
    assert t["prompt_ms"] == pytest.approx(180.0)
    # No cold prefill of ≥ 256 tokens yet: no rate, nothing claimed.
    assert t["cold_rate"]["ms_per_token"] is None and t["seconds_saved"] == 0.0

    later = known_rows.totals(since=T + 60)
    assert (later["requests"], later["prompt_tokens"], later["cached_tokens"]) == (3, 70, 230)
    assert later["errors"] == 1


def test_seconds_saved_priced_at_the_cold_prefill_rate(known_rows: Telemetry) -> None:
    """Cached tokens cost what a cold prefill costs per token, not a small follow-up's."""
    # cold: 1,000 new tokens in 19 s, and 3,000 in 57 s (nothing reused) → 19 ms/token
    known_rows.record(req(T + 100, prompt_n=1000, cache_n=0, prompt_ms=19_000.0))
    known_rows.record(req(T + 110, prompt_n=3000, cache_n=200, prompt_ms=57_000.0))
    # not cold: reuses more than a tenth, or too short to measure the batched rate
    known_rows.record(req(T + 120, prompt_n=400, cache_n=5000, prompt_ms=20_400.0))
    known_rows.record(req(T + 130, prompt_n=200, cache_n=0, prompt_ms=10_200.0))
    known_rows.flush()
    t = known_rows.totals()
    assert t["cold_rate"] == {"ms_per_token": pytest.approx(19.0), "requests": 2, "tokens": 4000}
    cached = 320 + 200 + 5000
    assert t["cached_tokens"] == cached
    assert t["seconds_saved"] == pytest.approx(cached * 19.0 / 1000)
    # A window without a cold prefill borrows the rate from the whole history.
    late = known_rows.totals(since=T + 3600)
    assert late["cold_rate"]["ms_per_token"] == pytest.approx(19.0)
    assert late["seconds_saved"] == pytest.approx(50 * 19.0 / 1000)


def test_each_model_is_priced_at_its_own_cold_rate_and_the_headers_agree(
    tel: Telemetry,
) -> None:
    """Two models' rows: Gemma's cold prefills ran at 22.3 ms/token, the tiny model's at
    3.9; each one's cached tokens are priced at its own rate (one rate for both priced
    the tiny model's hits 5.8× too high). The proxy's estimator, seeded from the same
    history, gives the headers the same per-model rates."""
    from core.telemetry.rates import PrefillRates

    gemma, tiny = "gemma-3-270m-q4_k_m.gguf", "tiny.gguf"
    tel.record(req(T + 1, model=gemma, prompt_n=1000, cache_n=0, prompt_ms=22_300.0))
    tel.record(req(T + 2, model=gemma, prompt_n=50, cache_n=4000, prompt_ms=900.0))
    tel.record(req(T + 3, model=tiny, prompt_n=2000, cache_n=0, prompt_ms=7_800.0))
    tel.record(req(T + 4, model=tiny, prompt_n=40, cache_n=10_000, prompt_ms=400.0))
    t = tel.totals()
    by = {m["model"]: m for m in t["by_model"]}
    assert by[gemma]["cold_rate"]["ms_per_token"] == pytest.approx(22.3)
    assert by[tiny]["cold_rate"]["ms_per_token"] == pytest.approx(3.9)
    assert by[gemma]["seconds_saved"] == pytest.approx(4000 * 22.3 / 1000)
    assert by[tiny]["seconds_saved"] == pytest.approx(10_000 * 3.9 / 1000)
    assert t["seconds_saved"] == pytest.approx(4000 * 0.0223 + 10_000 * 0.0039)
    rates = PrefillRates()
    for model, sums in tel.cold_prefill_rates().items():
        rates.seed(model, sums["tokens"], sums["ms"])
    assert rates.ms_per_token(gemma) == pytest.approx(22.3)
    assert rates.ms_per_token(tiny) == pytest.approx(3.9)
    assert rates.ms_per_token("other.gguf") is None  # never measured: no estimate


def test_totals_of_an_empty_database(tel: Telemetry) -> None:
    t = tel.totals()
    assert (t["requests"], t["prompt_tokens"], t["cached_tokens"], t["errors"]) == (0, 0, 0, 0)
    assert t["hit_ratio"] is None and t["seconds_saved"] == 0.0
    assert tel.hit_rate("minute") == [] and tel.per_client() == []


def test_per_client(known_rows: Telemetry) -> None:
    got = known_rows.per_client()
    assert [(r["client"], r["requests"], r["cached"], r["new"]) for r in got] == [
        ("opencode", 4, 270, 130),
        ("curl", 1, 50, 50),
    ]
    assert got[0]["hit_ratio"] == pytest.approx(0.675)
    assert got[1]["hit_ratio"] == 0.5
    assert [r["client"] for r in known_rows.per_client(since=T + 100)] == ["curl"]


def test_sessions_apart(known_rows: Telemetry) -> None:
    """Two sessions of one client are two rows; sums by hand from the known rows."""
    known_rows.record(req(T + 80, session="s2", slot=1, prompt_n=7, cache_n=93, prompt_ms=7.0))
    known_rows.record(req(T + 90, session="", client="curl", kind="aux", prompt_n=5, cache_n=0))
    known_rows.flush()
    got = known_rows.sessions()
    assert [(r["client"], r["session"], r["requests"], r["cached"], r["new"]) for r in got] == [
        ("curl", "s1", 1, 50, 50),  # T+3700: the newest first
        ("curl", "", 1, 0, 5),
        ("opencode", "s2", 1, 93, 7),
        ("opencode", "s1", 4, 270, 130),  # r4 (502) counts as a request without tokens
    ]
    s1 = got[3]
    assert s1["hit_ratio"] == pytest.approx(0.675) and s1["prefill_ms"] == 130.0
    assert (s1["first_seen"], s1["last_seen"], s1["slot"]) == (T + 5, T + 70, 0)
    assert got[2]["slot"] == 1 and got[1]["kinds"] == "aux" and s1["kinds"] == "agent"
    assert [r["session"] for r in known_rows.sessions(since=T + 85)] == ["s1", ""]
    assert known_rows.query("sessions", since=T + 85, limit=1)[0]["client"] == "curl"


def test_ttfb_medians(known_rows: Telemetry) -> None:
    # warm (cache_n > prompt_n): r2 12 ms, r3 8 ms → sorted [8, 12], the upper middle is 12.
    # cold: r1 300 ms, r5 200 ms (50 cached of 100: not more than new) → [200, 300] → 300.
    # prefill (prompt_ms): warm r2 10, r3 20 → 20; cold r1 100, r5 50 → [50, 100] → 100.
    assert known_rows.ttfb() == {
        "warm": 12.0, "warm_n": 2, "cold": 300.0, "cold_n": 2,
        "warm_prefill": 20.0, "warm_prefill_n": 2, "cold_prefill": 100.0, "cold_prefill_n": 2,
    }  # fmt: skip
    later = known_rows.ttfb(since=T + 60)
    assert (later["warm"], later["warm_n"], later["cold"], later["cold_n"]) == (8.0, 1, 200.0, 1)
    assert (later["warm_prefill"], later["cold_prefill"]) == (20.0, 50.0)
    # A non-streamed request's first byte comes after its generation: not in the TTFB medians.
    known_rows.record(req(T + 90, stream=False, prompt_n=5, cache_n=95, prompt_ms=5.0,
                          ttfb_ms=9000.0))  # fmt: skip
    known_rows.flush()
    again = known_rows.ttfb(since=T + 60)
    assert (again["warm"], again["warm_n"]) == (8.0, 1)
    assert (again["warm_prefill"], again["warm_prefill_n"]) == (20.0, 2)  # [5, 20] → 20


def test_recent_requests_newest_first(known_rows: Telemetry) -> None:
    rows = known_rows.recent_requests(2)
    assert [r["ts"] for r in rows] == [T + 3700, T + 70]
    assert rows[1]["status"] == 502 and rows[1]["prompt_n"] is None
    assert rows[0]["stream"] == 1 and rows[0]["has_tools"] == 1


def test_writes_are_batched_and_readable_by_another_connection(
    tmp_path: Path, tel: Telemetry, clock: Clock
) -> None:
    reader = sqlite3.connect(tmp_path / "state" / "telemetry.sqlite3")
    try:

        def count() -> int:
            return int(reader.execute("SELECT COUNT(*) FROM requests").fetchone()[0])

        assert reader.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tel.record(req(clock.now, prompt_n=1, cache_n=0))
        assert count() == 0  # buffered
        clock.now += 0.5
        tel.maybe_flush(1.0)
        assert count() == 0  # not yet due
        clock.now += 0.6
        tel.maybe_flush(1.0)  # handed to the writer thread, not waited for
        wait_until(lambda: count() == 1, 30, message="the due row written by the writer")
        # A full batch is written without waiting for the clock.
        for i in range(telemetry_mod.BATCH):
            tel.record(req(clock.now + i, prompt_n=1, cache_n=1))
        wait_until(lambda: count() == 1 + telemetry_mod.BATCH, 30, message="the full batch")
    finally:
        reader.close()


def test_server_runs_merge_launch_and_exit(tel: Telemetry) -> None:
    tel.record(
        ServerLaunched(
            ts=T,
            run_id="run1",
            pid=123,
            port=4000,
            argv=("llama-server", "-np", "2"),
            binary="/bin/llama-server",
            binary_version="1.0",
            model="/m.gguf",
            attempt="start",
        )
    )
    tel.record(
        ServerExited(
            ts=T + 9,
            run_id="run1",
            pid=123,
            returncode=-9,
            signal=9,
            outcome="crashed",
            requested_by="nobody (crash)",
            last_lines=("a", "b"),
        )
    )
    (row,) = tel.server_runs()
    assert row["run_id"] == "run1" and row["argv"] == ["llama-server", "-np", "2"]
    assert (row["started"], row["ended"], row["outcome"], row["signal"]) == (T, T + 9, "crashed", 9)
    assert row["last_lines"] == ["a", "b"] and row["attempt"] == "start"


def test_events_are_stored_by_category(tel: Telemetry) -> None:
    tel.record(CacheEvent(ts=T, kind="save", reason="prefix saved", slot=1, tokens=900))
    tel.record(ServerStateChanged(ts=T + 1, state="ready", previous="starting", pid=5))
    tel.record(Notice(ts=T + 2, level="error", text="disk full", hint="free some space"))
    assert [e["category"] for e in tel.recent_events()] == ["notice", "server", "cache"]
    (cache,) = tel.recent_events(category="cache")
    assert (cache["kind"], cache["slot"], cache["tokens"]) == ("save", 1, 900)
    (server,) = tel.recent_events(category="server", kind="ready")
    assert server["details"] == {"previous": "starting", "pid": 5}
    (notice,) = tel.recent_events(since=T + 2)
    assert notice["details"] == {"hint": "free some space"}


def test_prune_deletes_only_old_rows(tel: Telemetry, clock: Clock) -> None:
    old, new = T, T + 9 * DAY
    for ts in (old, new):
        tel.record(req(ts, prompt_n=1, cache_n=1))
        tel.record(CacheEvent(ts=ts, kind="save"))
        tel.record(
            PressureSample(
                ts=ts,
                level="nominal",
                ram_available_pct=50.0,
                swap_used_pct=0.0,
                server_rss_bytes=None,
                disk_free_pct=40.0,
            )
        )
        tel.record(
            ServerLaunched(
                ts=ts,
                run_id=f"run{ts}",
                pid=1,
                port=1,
                argv=(),
                binary="b",
                binary_version="v",
                model="m",
            )
        )
    clock.now = T + 10 * DAY
    deleted = tel.prune(retention_days=7)  # cutoff: T + 3 days
    assert deleted >= 4  # one row in each of requests, events, pressure, server_runs
    assert [r["ts"] for r in tel.recent_requests()] == [new]
    assert [e["ts"] for e in tel.recent_events(category="cache")] == [new]
    assert [r["run_id"] for r in tel.server_runs()] == [f"run{new}"]
    assert [p["ts"] for p in tel.pressure_series(since=0)] == [new]
    assert tel.prune(retention_days=7) == 0


def test_migrations_are_idempotent_on_reopen(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "t.sqlite3"
    first = Telemetry(path, clock=clock)
    first.record(req(T, prompt_n=3, cache_n=4))
    applied = [m.name for m in telemetry_mod.migrations.applied(first.db)]
    tables = set(first.db.table_names())
    first.close()
    assert applied and applied[0] == "m001_initial"
    assert {"requests", "server_runs", "events", "pressure"} <= tables

    for _ in range(2):
        again = Telemetry(path, clock=clock)
        assert [m.name for m in telemetry_mod.migrations.applied(again.db)] == applied
        assert telemetry_mod.migrations.pending(again.db) == []
        assert set(again.db.table_names()) == tables
        assert [(r["prompt_n"], r["cache_n"]) for r in again.recent_requests()] == [(3, 4)]
        again.close()


# The methods of Telemetry that write, or open/close it: never runnable by name.
WRITERS = {"add", "upsert", "flush", "maybe_flush", "record", "record_build", "prune", "close"}
WRITERS |= {"query", "open", "housekeeping"}


def test_the_query_whitelist_is_every_read_query_and_nothing_else() -> None:
    # Its own methods and the ones it inherits (the queries live in core.telemetry.queries).
    public = {n for n in dir(Telemetry) if not n.startswith("_")}
    public = {n for n in public if callable(getattr(Telemetry, n))}
    # A new read query must be added to QUERIES, or to WRITERS here if it is not one.
    assert public - WRITERS == telemetry_mod.QUERIES
    assert not telemetry_mod.QUERIES & WRITERS


def test_queries_run_by_name_and_nothing_else_does(known_rows: Telemetry, clock: Clock) -> None:
    assert known_rows.query("totals", since=T + 60) == known_rows.totals(since=T + 60)
    assert known_rows.query("sweep_runs") == []
    clock.now = T + 100 * DAY
    with pytest.raises(ValueError, match="unknown query 'prune'"):
        known_rows.query("prune", retention_days=0)
    with pytest.raises(ValueError, match="unknown query '_rows'"):
        known_rows.query("_rows", sql="DELETE FROM requests")
    assert known_rows.totals()["requests"] == 5  # nothing was deleted


def test_core_query_uses_the_same_whitelist(make_core: Any) -> None:
    core = make_core()  # not started: a name is checked before anything is submitted
    with pytest.raises(ValueError, match="unknown query 'prune'"):
        core.query("prune", retention_days=0)


# ------------------------------------------------------------ one bad row
def undecodable(raw: bytes) -> str:
    """A header value as aiohttp decodes non-UTF-8 bytes (surrogateescape)."""
    return raw.decode("utf-8", "surrogateescape")


def test_text_that_is_not_unicode_is_stored_as_replacement_characters(tel: Telemetry) -> None:
    """aiohttp hands non-UTF-8 header bytes on as lone surrogates, which sqlite3 cannot
    encode: such a row once failed every later flush."""
    bad = undecodable(b"agent\xff\xfe\xfd/1")
    tel.record(req(T + 1, client=bad, session=undecodable(b"s\xff")))
    for i in range(3):
        tel.record(req(T + 2 + i, request_id=f"ok{i}"))
    rows = tel.recent_requests(10)  # flushes
    assert len(rows) == 4
    assert rows[-1]["client"] == "agent\ufffd\ufffd\ufffd/1"
    assert rows[-1]["session"] == "s\ufffd"
    assert tel.dropped == 0 and tel.totals()["dropped_rows"] == 0


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("plain", "plain"),
        ("caf\u00e9 \U0001f600", "caf\u00e9 \U0001f600"),
        (undecodable(b"\xff\xfe\xfd"), "\ufffd\ufffd\ufffd"),
        ("a\ud800b", "a\ufffd\ufffd\ufffdb"),  # a lone high surrogate (not from bytes)
    ],
)
def test_safe_text(text: str, stored: str) -> None:
    assert telemetry_mod.safe_text(text) == stored
    stored.encode("utf-8")


def test_a_row_sqlite_refuses_is_dropped_counted_and_noted_and_the_rest_recorded(
    tel: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    """A flush never stops recording because of one row: the batch is written row by
    row, the bad rows are dropped, counted, logged once and noted as an event."""
    caplog.set_level("ERROR", logger="warmslot.telemetry")
    tel.add("requests", {"ts": T + 1, "request_id": "before"})
    tel.add("requests", {"ts": T + 2, "prompt_n": 2**70})  # too large for an INTEGER
    tel.add("requests", {"ts": T + 3, "request_id": "after"})
    tel.add("requests", {"ts": T + 4, "request_id": object()})  # no SQLite type
    tel.flush()
    assert [r["request_id"] for r in tel.recent_requests(10)] == ["after", "before"]
    assert tel.dropped == 2
    assert tel.totals()["dropped_rows"] == 2
    events = tel.recent_events(category="telemetry")
    assert [(e["kind"], e["details"]["rows"]) for e in events] == [("rows_dropped", 2)]
    assert "could not be written" in events[0]["reason"]
    # One line per cause: a second row of a cause already logged adds none.
    tel.add("requests", {"ts": T + 5, "prompt_n": 2**80})
    tel.flush()
    assert tel.dropped == 3
    errors = [r.getMessage() for r in caplog.records if r.name == "warmslot.telemetry"]
    assert len(errors) == 2, errors
    assert "OverflowError" in errors[0] and "ProgrammingError" in errors[1]
    # Later rows are recorded as usual.
    for i in range(BATCH_PLUS):
        tel.record(req(T + 10 + i, request_id=f"later{i}"))
    assert tel.totals()["requests"] == 2 + BATCH_PLUS
    assert tel.dropped == 3


BATCH_PLUS = telemetry_mod.BATCH + 5  # more than one batch: the automatic flush too


def test_a_database_that_cannot_be_written_keeps_a_bounded_buffer(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locked (or full) database: rows stay buffered for later, but never more than
    MAX_PENDING; the oldest beyond it are dropped and counted; writes resume after."""
    monkeypatch.setattr(telemetry_store, "BATCH", 3)  # the writer reads them there
    monkeypatch.setattr(telemetry_store, "MAX_PENDING", 10)
    monkeypatch.setattr(dbfile, "BUSY_TIMEOUT_S", 0)  # fail at once instead of waiting
    path = tmp_path / "t.sqlite3"
    tel = Telemetry(path, clock=clock)
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another writer holds the database
    try:
        for i in range(25):
            tel.record(req(T + i, request_id=f"r{i}"))  # never waits for the database
        tel.flush()  # every write tried (and refused) by now
        assert tel.dropped == 15
    finally:
        other.execute("ROLLBACK")
        other.close()
    tel.flush()
    rows = tel.recent_requests(50)
    assert [r["request_id"] for r in rows] == [f"r{i}" for i in range(24, 14, -1)]  # newest
    assert tel.totals()["dropped_rows"] == 15
    (event,) = tel.recent_events(category="telemetry")
    assert event["details"]["rows"] == 15 and "BufferFull" in event["reason"]
    tel.close()


def test_recording_never_waits_for_the_database(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core thread buffers rows and hands them to the history's writer thread: with
    the database locked by another process (the writer waits up to a minute for it), a
    full batch is still recorded at once, and written once the lock is gone."""
    import threading

    monkeypatch.setattr(dbfile, "BUSY_TIMEOUT_S", 60)
    path = tmp_path / "t.sqlite3"
    tel = Telemetry(path, clock=clock)
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another writer holds the database
    done = threading.Event()

    def record() -> None:
        for i in range(telemetry_mod.BATCH + 5):
            tel.record(req(T + i, request_id=f"r{i}"))
        tel.maybe_flush(0.0)
        done.set()

    try:
        threading.Thread(target=record, daemon=True).start()
        # Far shorter than the writer's wait for the lock: the recording did not wait.
        assert done.wait(10), "recording waited for the locked database"
    finally:
        other.execute("ROLLBACK")
        other.close()
    tel.flush()
    assert tel.totals()["requests"] == telemetry_mod.BATCH + 5 and tel.dropped == 0
    tel.close()
