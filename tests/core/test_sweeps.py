"""The fake clock, the sweep scheduler, and the Core running every model's cache sweeps."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.cache.deps import DiskTier, deps_from
from core.cache.manager import CacheManager, policy_factory
from core.clock import FakeClock, RealClock
from core.config import ModelProfile
from core.errors import CacheError
from core.events import Event, SweepRun
from core.machine.sweeps import Outcome, Sweeps, clamp_interval, thin_runs
from core.server.supervisor import ServerState
from core.telemetry import Telemetry
from tests.conftest import MakeCore
from tests.core.bg_support import SERVER, FakeLlama, FakeManager, prefix
from tests.helpers import wait_until


async def test_fake_clock_wakes_sleepers_in_order_and_never_goes_back() -> None:
    clock = FakeClock(start=1000.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await clock.sleep(delay)
        woke.append((name, clock.time()))

    tasks = [asyncio.ensure_future(sleeper(n, d)) for n, d in (("b", 20), ("a", 10), ("c", 30))]
    await asyncio.sleep(0)
    assert clock.sleepers == 3 and clock.next_deadline() == 1010.0
    await clock.advance(25)
    assert woke == [("a", 1010.0), ("b", 1020.0)]
    assert clock.time() == 1025.0 and clock.monotonic() == 25.0
    await clock.advance(5)
    assert woke[-1] == ("c", 1030.0)
    await asyncio.gather(*tasks)
    with pytest.raises(ValueError):
        await clock.set(0)


async def test_fake_clock_waits_for_woken_tasks_to_park_again() -> None:
    """A sweep that does (real) I/O between sleeps still runs once per interval, in order."""
    clock = FakeClock()
    runs: list[float] = []

    async def loop() -> None:
        while True:
            await clock.sleep(60)
            await asyncio.sleep(0.01)  # real time passes (an HTTP call, say)
            runs.append(clock.monotonic())

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0)
    await clock.advance(300)
    assert runs == [60, 120, 180, 240, 300]
    task.cancel()


async def test_cancelled_sleeper_is_forgotten() -> None:
    clock = FakeClock()
    task = asyncio.ensure_future(clock.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    assert clock.sleepers == 0
    await clock.advance(20)  # nothing to wake, no error


async def test_real_clock_sleeps() -> None:
    c = RealClock()
    t0 = c.monotonic()
    await c.sleep(0.01)
    assert c.monotonic() > t0 and abs(c.time() - __import__("time").time()) < 1


def test_clamp() -> None:
    assert clamp_interval(10, 60) == 60
    assert clamp_interval(300, 60) == 300


class Bus:
    def __init__(self) -> None:
        self.tel = Telemetry(":memory:")
        self.events: list[Event] = []

    def __call__(self, e: Event) -> None:
        self.events.append(e)
        self.tel.record(e)

    def runs(self, name: str) -> list[SweepRun]:
        return [e for e in self.events if isinstance(e, SweepRun) and e.name == name]


async def test_sweeps_run_every_interval_and_are_recorded() -> None:
    clock = FakeClock()
    bus = Bus()
    sw = Sweeps(clock, bus)
    calls: list[float] = []
    interval = [120.0]

    async def work() -> Outcome:
        calls.append(clock.monotonic())
        return Outcome(2, {"note": "did two things"})

    sw.add("work", work, lambda: interval[0], minimum=60)
    sw.add("fast", lambda: asyncio.sleep(0, 1), lambda: 5, first_delay=0)
    sw.start()
    await asyncio.sleep(0)
    await clock.advance(360)
    assert calls == [120, 240, 360]
    interval[0] = 10  # below the minimum: clamped to 60, from the wait after the next run
    await clock.advance(180)
    assert calls == [120, 240, 360, 480, 540]
    runs = bus.runs("work")
    assert [r.actions for r in runs] == [2] * 5 and runs[0].details == {"note": "did two things"}
    assert runs[0].started == clock.time() - 540 + 120
    rows = bus.tel.sweep_runs("work")
    assert len(rows) == 5 and rows[0]["actions"] == 2 and rows[0]["details"]["note"]
    assert len(bus.runs("fast")) == 1 + 540 // 5
    st = {s["name"]: s for s in sw.status()}
    assert st["work"]["interval_s"] == 60 and st["work"]["configured_s"] == 10
    assert st["work"]["runs"] == 5 and st["work"]["next_in_s"] == 60
    await sw.stop()


async def test_a_failing_sweep_is_recorded_and_retried_and_never_kills_the_others(
    caplog: Any,
) -> None:
    clock = FakeClock()
    bus = Bus()
    sw = Sweeps(clock, bus)
    attempts = []
    other = []

    async def flaky() -> int:
        attempts.append(clock.monotonic())
        if len(attempts) <= 2:
            raise OSError("disk went away")
        return 1

    async def steady() -> int:
        other.append(clock.monotonic())
        return 0

    sw.add("flaky", flaky, lambda: 60)
    sw.add("steady", steady, lambda: 30)
    sw.start()
    await asyncio.sleep(0)
    caplog.set_level("ERROR")
    await clock.advance(180)
    assert attempts == [60, 120, 180]
    assert len(other) == 6
    runs = bus.runs("flaky")
    assert [r.error for r in runs] == ["OSError: disk went away"] * 2 + [""]
    assert "sweep flaky failed" in caplog.text
    st = {s["name"]: s for s in sw.status()}
    assert st["flaky"]["failures"] == 2 and st["flaky"]["last_error"] == ""
    errors = bus.tel.sweep_runs("flaky")
    assert [r["error"] for r in errors][::-1] == [r.error for r in runs]
    await sw.stop()


async def test_a_stuck_sweep_shows_how_long_it_has_been_running() -> None:
    clock = FakeClock()
    sw = Sweeps(clock, lambda e: None)
    gate = asyncio.Event()

    async def stuck() -> int:
        await gate.wait()
        return 0

    sw.add("stuck", stuck, lambda: 60)
    task = asyncio.ensure_future(sw.run_once("stuck"))
    await asyncio.sleep(0)
    await clock.advance(90)
    (st,) = sw.status()
    assert st["running_for_s"] == 90 and st["last_start"] is None
    gate.set()
    run = await task
    assert run.duration_s == 90 and sw.status()[0]["running_for_s"] is None


# ----------------------------------------------------------------- wired into the Core
def test_core_runs_the_cache_managers_sweeps_on_its_clock(make_core: MakeCore) -> None:
    """No llama-server: the sweeps still run (headless) and are recorded; commands answer."""
    clock = FakeClock()
    core = make_core(policy_factory=policy_factory)
    core.clock = clock
    core.start(start_server=False)
    mgr = core.policy
    assert isinstance(mgr, CacheManager)

    async def registered() -> bool:
        return len(mgr.state.sweeps.sweeps) == 4 and clock.sleepers == 4

    wait_until(lambda: core.submit(registered()).result(5), 10, message="sweeps started")
    core.submit(clock.advance(600)).result(60)
    rows = core.query("sweep_runs", limit=1000).result(10)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["name"]] = counts.get(r["name"], 0) + 1
        assert r["error"] == "", r
    assert counts == {"pressure": 121, "sessions": 10, "keepalive": 2, "retention": 2}
    status = core.status().result(10)
    cache = status["cache"]
    assert cache["pressure"]["level"] in ("nominal", "low", "critical")
    names = {s["name"] for s in cache["sweeps"]}
    assert names == {"pressure", "sessions", "keepalive", "retention"}
    assert "sweep retention every 5 min: last run" in cache["text"]
    with pytest.raises(CacheError, match="refusing"):
        core.evict("../../etc/passwd").result(10)
    with pytest.raises(CacheError, match="no saved state"):
        core.pin("ws-" + "0" * 32 + ".bin").result(10)
    with pytest.raises(CacheError, match="not ready"):
        core.rewarm("0123456789abcdef").result(10)
    core.stop()
    assert not core.running


def test_core_without_cache_manager_refuses_cache_commands(make_core: MakeCore) -> None:
    core = make_core()
    core.start(start_server=False)
    with pytest.raises(CacheError, match="not attached"):
        core.pin("ws-" + "0" * 32 + ".bin").result(10)


def test_old_uneventful_runs_are_thinned_eventful_ones_kept() -> None:
    tel = Telemetry(":memory:")
    t0 = 1_800_000_000.0
    for i in range(2 * 720):  # two hours of a 5 s sweep
        ts = t0 + i * 5
        tel.record(
            SweepRun(
                name="pressure",
                started=ts,
                duration_s=0.001,
                actions=1 if i == 100 else 0,
                error="boom" if i == 200 else "",
                ts=ts,
            )
        )
    deleted = thin_runs(tel, t0 + 7200)
    rows = tel.sweep_runs("pressure", limit=10_000)
    old = [r for r in rows if r["ts"] < t0 + 3600]
    assert len(old) == 6 + 2  # one per 10 minutes, plus the eventful two
    assert {r["ts"] for r in old} >= {t0 + 500, t0 + 1000}
    assert deleted == 720 - 8
    assert len(rows) - len(old) == 720
    tel.close()


class StandInServer:
    """What a cache manager and the pool read of a running llama-server."""

    def __init__(self, slot_dir: Path) -> None:
        self.state = ServerState.READY
        self.base_url = "http://fake/b"
        self.port: int | None = None
        self.pid: int | None = None
        self.run_id = "run-b"
        self.resolved = SimpleNamespace(slot_dir=slot_dir)

    async def stop(self, requested_by: str = "") -> None:
        self.state = ServerState.STOPPED

    async def close(self) -> None:
        await self.stop()


def test_core_runs_keepalive_and_idle_release_for_a_pooled_model(make_core: MakeCore) -> None:
    """Every model's cache sweeps run on the engine's one scheduler, not the primary's only.

    Model b's llama-server is a model of its slots (`FakeLlama`): slot 0 holds a prefix
    that keep-alive must re-warm once it idles, slot 1 a conversation that must be
    released after its TTL. One fake hour, deterministic.
    """
    clock = FakeClock()
    core = make_core(
        policy_factory=policy_factory,
        server__slots=3,
        pressure__sample_interval_s=600,  # a few samples, not 720: not what this is about
    )
    core.settings.models = [
        ModelProfile(name="a"),
        ModelProfile(name="b", model="/m/b.gguf", ttl_s=-1),
    ]
    core.clock = clock
    core.start(start_server=False)
    pool = core.pool
    assert pool is not None
    prefix_tokens = list(range(1, 201))

    async def load_b() -> FakeManager:
        # What the pool's load does, with stand-ins for b's server and its HTTP client.
        entry = pool.entries["b"]
        entry.server = StandInServer(core.paths.slot_dir / "b-launch")  # type: ignore[assignment]
        mgr = FakeManager(deps_from(core, entry.server, model="b"))  # type: ignore[arg-type]
        mgr.fake = FakeLlama(core.paths.slot_dir / "b-launch", n_slots=3)
        mgr.state.identity = SERVER
        mgr.state.disk = DiskTier(False, "not what this test is about")
        info = prefix(prefix_tokens)
        mgr.state.by_fp[info.fingerprint] = info
        mgr.fake.contents[0] = list(prefix_tokens)  # resident in slot 0
        st = mgr.state.slots.slots[0]
        st.prefix_fp, st.tokens_hint, st.last_used = info.fingerprint, 200, clock.monotonic()
        conv = mgr.state.slots.slots[1]  # a conversation in slot 1
        conv.session, conv.last_kind, conv.tokens_hint = "ses-b", "agent", 100
        conv.last_used = clock.monotonic()
        mgr.state.slots.sessions["ses-b"] = 1
        entry.manager = mgr
        return mgr

    b = core.submit(load_b()).result(10)
    assert [m.model for m in core.cache_managers()] == ["", "b"]

    async def started() -> bool:
        return clock.sleepers == 5  # pressure, sessions, keepalive, retention, models

    wait_until(lambda: core.submit(started()).result(5), 10, message="sweeps started")
    core.submit(clock.advance(3600)).result(120)

    assert b.fake is not None and ("completion", 0) in b.fake.calls  # re-warmed slot 0
    kept = core.query("recent_events", limit=50, category="cache", kind="keepalive").result(10)
    assert kept and all(e["slot"] == 0 and e["details"]["resident"] for e in kept)
    runs = core.query("sweep_runs", sweep="keepalive", limit=50).result(10)
    assert len(runs) == 3600 // 240 and not any(r["error"] for r in runs)
    assert all(set(r["details"]["models"]) == {"primary", "b"} for r in runs)
    assert sum(r["actions"] for r in runs) == len(kept)

    assert "ses-b" not in b.state.slots.sessions and b.state.slots.slots[1].session == ""
    evicted = core.query("recent_events", limit=50, category="cache", kind="evicted").result(10)
    (released,) = [e for e in evicted if e["details"].get("rule") == "idle_session"]
    assert released["details"]["session"] == "ses-b" and released["slot"] == 1
    sessions = core.query("sweep_runs", sweep="sessions", limit=100).result(10)
    assert [r["details"]["models"]["b"]["released"] for r in sessions if r["actions"]] == [
        ["ses-b"]
    ]
    core.stop()
