"""The memory arbiter and the model pool's decisions: fake clock, fake footprints,
fake pressure, fake servers — deterministic, no processes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from core.clock import FakeClock
from core.config import ModelProfile, Settings
from core.events import Event, ModelEvent
from core.models import arbiter
from core.models.pool import ModelPool, ModelUnavailable
from core.models.profiles import MIB, Footprint, Profile
from core.models.servers import ServerSet
from core.routing.router import Decision, Refused
from core.server.supervisor import ServerState
from core.server.upstream import Upstream

GIB = 1024 * MIB


def fp(ram_gib: float, *vram_gib: float) -> Footprint:
    return Footprint(tuple(int(v * GIB) for v in vram_gib), int(ram_gib * GIB), "test")


def loaded(name: str, prio: int, f: Footprint, *, inflight: int = 0, last: float = 0.0,
           primary: bool = False, ttl: int = -1) -> arbiter.Loaded:  # fmt: skip
    return arbiter.Loaded(name, prio, f, inflight, last, primary, ttl)


BUDGET = arbiter.Budget(vram=(int(10 * GIB),), ram=int(8 * GIB))


def test_admits_when_it_fits_and_says_the_numbers() -> None:
    d = arbiter.admit("b", fp(2, 4), 80, [loaded("a", 100, fp(2, 4))], BUDGET)
    assert d.action == "admit" and d.evict == ()
    assert d.numbers["would_use"] == {"vram_mib": [8192.0], "ram_mib": 4096.0}
    assert d.numbers["budget"] == {"vram_mib": [10240.0], "ram_mib": 8192.0}


def test_vram_is_checked_per_device() -> None:
    two = arbiter.Budget(vram=(int(4 * GIB), int(4 * GIB)), ram=int(64 * GIB))
    a = [loaded("a", 80, fp(0, 2, 0), inflight=1)]
    assert arbiter.admit("b", fp(0, 3, 0), 80, a, two).action == "refuse"
    assert arbiter.admit("b", fp(0, 0, 3), 80, a, two).action == "admit"


def test_unloads_the_coldest_lower_priority_idle_models_first() -> None:
    models = [
        loaded("primary", 100, fp(3, 3), last=1, primary=True),
        loaded("side-old", 20, fp(2, 3), last=10),
        loaded("side-new", 20, fp(2, 3), last=50),
        loaded("embed", 50, fp(1, 1), last=5),
    ]
    d = arbiter.admit("coder", fp(2, 3), 80, models, BUDGET)
    assert d.action == "admit"
    assert d.evict == ("side-old",)  # lowest priority, least recently used, and enough
    assert "side-old" in d.reason
    d = arbiter.admit("coder", fp(4, 7), 80, models, BUDGET)
    assert d.evict == ("side-old", "side-new", "embed")


def test_never_unloads_a_model_with_requests_in_flight_or_higher_priority() -> None:
    busy = [loaded("a", 20, fp(6, 8), inflight=1)]
    d = arbiter.admit("b", fp(4, 4), 80, busy, BUDGET)
    assert d.action == "refuse" and "in use: a" in d.reason
    assert d.numbers["blocked_by"]["in_use"] == ["a"]
    higher = [loaded("p", 100, fp(6, 8), primary=True)]
    d = arbiter.admit("side", fp(4, 4), 20, higher, BUDGET)
    assert d.action == "refuse" and "higher priority: p" in d.reason


def test_idle_unload_after_ttl_only_when_idle() -> None:
    models = [
        loaded("a", 80, fp(1), last=0, ttl=600),
        loaded("b", 80, fp(1), last=0, ttl=600, inflight=2),
        loaded("p", 100, fp(1), last=0, ttl=-1, primary=True),
        loaded("c", 80, fp(1), last=100, ttl=600),
    ]
    assert arbiter.idle_unloads(models, 599) == []
    ds = arbiter.idle_unloads(models, 600)
    assert [d.model for d in ds] == ["a"]
    assert ds[0].numbers["idle_s"] == 600 and ds[0].numbers["ttl_s"] == 600


def test_pressure_order_and_preload_gate() -> None:
    models = [
        loaded("p", 100, fp(1), primary=True),
        loaded("embed", 50, fp(1), last=3),
        loaded("side", 20, fp(1), last=9),
        loaded("coder", 80, fp(1), inflight=1),
    ]
    assert arbiter.pressure_unloads(models, "low", 10) == []
    ds = arbiter.pressure_unloads(models, "critical", 10)
    assert [d.model for d in ds] == ["side", "embed"]  # lowest priority first; never p/coder
    assert arbiter.may_preload("nominal").action == "admit"
    assert arbiter.may_preload("low").action == "refuse"


# ------------------------------------------------------------------ the pool, faked
class FakeServer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.state = ServerState.STOPPED
        self.state_reason = ""
        self.port: int | None = None
        self.pid: int | None = None
        self.starts = 0

    @property
    def base_url(self) -> str | None:
        return f"http://fake/{self.name}" if self.state is ServerState.READY else None

    async def start(self, requested_by: str = "") -> None:
        self.starts += 1
        self.state, self.port = ServerState.READY, 1000 + self.starts

    async def stop(self, requested_by: str = "") -> None:
        self.state, self.port = ServerState.STOPPED, None

    async def close(self) -> None:
        await self.stop()


def make_pool(level: list[str]) -> tuple[ModelPool, FakeClock, list[ModelEvent]]:
    s = Settings()
    s.models = [
        ModelProfile(name="coder", model="/m/coder.gguf", footprint_mib=4096),
        ModelProfile(name="chat", model="/m/chat.gguf", footprint_mib=4096),
        ModelProfile(name="titles", model="/m/t.gguf", role="side", footprint_mib=2048),
        ModelProfile(name="embed", model="/m/e.gguf", role="embedding", footprint_mib=2048),
    ]
    s.pool.side_calls = True
    clock = FakeClock()
    events: list[ModelEvent] = []

    def emit(e: Event) -> None:
        if isinstance(e, ModelEvent):
            events.append(e)

    primary = FakeServer("coder")
    core: Any = SimpleNamespace(
        settings=s,
        clock=clock,
        supervisor=primary,
        upstream=Upstream(lambda: primary.base_url),
        policy=None,
        emit=emit,
        paths=None,
        stopping=False,
        subscribe=lambda *_a, **_k: lambda: None,
    )

    def factory(p: Profile) -> Any:
        return FakeServer(p.name)

    pool = ModelPool(
        ServerSet(core),
        server_factory=factory,
        budget=arbiter.Budget((), 9 * GIB),
        pressure_level=lambda: level[0],
    )
    return pool, clock, events


def routed(pool: ModelPool, model: str, aux: bool = False, **kw: Any) -> Decision | Refused:
    """What the pool's router decides for a chat request naming `model`."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **kw}
    headers = {"user-agent": "c", **({"x-warmslot-aux": "1"} if aux else {})}
    return pool.router.decide("chat", headers, body)


def req(pool: ModelPool, model: str, aux: bool = False, **kw: Any) -> Decision:
    decision = routed(pool, model, aux, **kw)
    assert isinstance(decision, Decision)
    return decision


def test_pool_swaps_by_priority_idle_ttl_and_pressure() -> None:
    async def scenario() -> None:
        level = ["nominal"]
        pool, clock, events = make_pool(level)
        # the primary (4 GiB) and the side model (2 GiB) fit; then the 4 GiB chat model
        # needs room: the idle side model goes (lower priority), not the primary.
        r = await pool.servers.route(req(pool, "coder"))
        assert r.upstream is not None and r.upstream.base_url == "http://fake/coder"
        assert r.release is not None
        r.release()
        # unknown → primary → side call?
        side = await pool.servers.route(req(pool, "anything", tools=None))
        assert side.model == "coder"  # a plain user turn is not a side call
        assert side.release is not None
        side.release()
        title = await pool.servers.route(req(pool, "titles"))
        assert title.release is not None
        title.release()
        await clock.advance(10)
        chat = await pool.servers.route(req(pool, "chat"))
        assert chat.model == "chat"
        kinds = [(e.kind, e.model) for e in events]
        assert ("unload", "titles") in kinds and ("unload", "coder") not in kinds
        admit = next(e for e in events if e.kind == "admit" and e.model == "chat")
        assert admit.numbers["unload"][0]["model"] == "titles"
        assert admit.numbers["budget"]["ram_mib"] == 9216.0
        # embed (priority 50) does not fit next to coder (100) and chat (80, in flight)
        emb = await pool.servers.route(req(pool, "embed"))
        assert emb.status == 503 and "higher priority" in emb.error
        assert chat.release is not None
        chat.release()
        # 4 + 4 + 2 > 9: chat (idle, 80 ≥ 20)? no:
        title = await pool.servers.route(req(pool, "titles"))
        assert title.status == 503  # a side model may not push out higher priorities
        # idle TTLs: chat (text, 1800 s); the primary never
        await clock.advance(1799)
        assert await pool.sweep() == []
        await clock.advance(1)
        done = await pool.sweep()
        assert [d.model for d in done] == ["chat"]
        assert "TTL of 1800 s" in done[0].reason
        assert pool.primary.loaded
        # in flight: never unloaded, even under critical pressure
        busy = await pool.servers.route(req(pool, "chat"))
        level[0] = "critical"
        await clock.advance(5000)
        assert await pool.sweep() == []  # chat busy; primary never for pressure or TTL
        assert busy.release is not None
        busy.release()
        done = await pool.sweep()
        assert [d.model for d in done] == ["chat"]
        assert "critical" in done[0].reason
        # preloading waits for nominal pressure
        assert await pool.preload("titles") is False
        level[0] = "nominal"
        assert await pool.preload("titles") is True
        status = {m["name"]: m for m in pool.status()}
        assert status["coder"]["primary"] and status["titles"]["state"] == "ready"
        assert status["chat"]["loads"] == 2 and status["chat"]["unloads"] == 2
        assert status["titles"]["loads"] == 2 and status["titles"]["unloads"] == 1

    asyncio.run(scenario())


def test_refusal_is_a_503_with_retry_after_and_strict_unknown_is_404() -> None:
    async def scenario() -> None:
        pool, _clock, events = make_pool(["nominal"])
        first = await pool.servers.route(req(pool, "coder"))
        second = await pool.servers.route(req(pool, "chat"))  # 8 GiB in use, both busy
        r = await pool.servers.route(req(pool, "embed"))  # 2 GiB more does not fit, nothing may go
        assert r.status == 503 and r.retry_after and "in use" in r.error
        assert events[-1].kind == "refuse"
        with pytest.raises(ModelUnavailable):
            await pool.ensure("embed")
        for x in (first, second):
            assert x.release is not None
            x.release()
        pool.core.settings.pool.strict_models = True
        refused = routed(pool, "nope")
        assert isinstance(refused, Refused)
        assert refused.status == 404 and "GET /v1/models" in refused.error
        assert [m["id"] for m in pool.models_list()["data"]] == ["coder", "chat", "titles", "embed"]

    asyncio.run(scenario())


def test_side_calls_go_to_the_side_profile_and_are_counted() -> None:
    async def scenario() -> None:
        pool, _clock, _events = make_pool(["nominal"])
        agent = await pool.servers.route(req(pool, "coder", tools=[{"type": "function"}]))
        assert agent.model == "coder" and agent.release is not None
        agent.release()
        marked = req(pool, "coder", aux=True)
        assert marked.routed_to_side and marked.model == "titles"
        aux = await pool.servers.route(marked)
        assert aux.model == "titles"
        assert aux.release is not None
        aux.release()
        calls = {m["name"]: m["calls"] for m in pool.status()}
        assert calls["coder"] == {"agent": 1, "aux": 0} and calls["titles"]["aux"] == 1
        assert pool.routed_side == 1

    asyncio.run(scenario())
