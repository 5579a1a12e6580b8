"""The slot watchdog (core.server.watchdog) behind the real proxy, against a scripted
llama-server: one slot stops moving while another works.

A real llama-server cannot be made to stall one slot and not the others on demand (the
SIGSTOP case, the whole server held, is in tests/integration/test_reliability.py); the
fake answers ``GET /slots`` with frozen counters for its stalled slot 0, counters that
move for its working slot 1, and slot 2 idle. Order is kept with events, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from core.config.sections import ProxySettings
from core.events import CacheEvent, CacheEventKind, Event
from core.proxy.app import Proxy, ProxyDeps
from core.server import watchdog
from core.server.upstream import Upstream

CHAT = "/v1/chat/completions"
LIMIT_S = 2.0  # proxy.stall_timeout_s here
WAIT_S = 30.0  # the longest any step may take on a loaded machine
ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
FIRST = b'data: {"choices": [{"index": 0, "delta": {"content": "He"}}], "timings": {}}\n\n'


@dataclass
class Fake:
    """llama-server with slot 0 stalled, slot 1 working (its counters move on every
    poll), slot 2 idle. Slot 0 runs one request at a time, as a server slot does."""

    polls: int = 0
    slot0: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: list[int] = field(default_factory=list)  # slots whose request was dropped
    started: dict[int, asyncio.Event] = field(default_factory=dict)
    stream_first: bool = False  # slot 0 sends one event before it stalls
    decoded: int = 0

    def began(self, slot: int) -> asyncio.Event:
        return self.started.setdefault(slot, asyncio.Event())

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/slots":
            self.polls += 1
            self.decoded += 1
            return web.json_response(
                [
                    _slot(0, True, task=7, processed=2048, decoded=0),
                    _slot(1, True, task=8, processed=100, decoded=self.decoded),
                    _slot(2, False, task=9, processed=0, decoded=0),
                ]
            )
        body = await request.json()
        slot = int(body.get("id_slot", -1))
        try:
            if slot == 0:
                return await self._stalled(request, body)
            if slot == 1:  # works, slowly: answers after slot 1 was polled a few times
                seen = self.polls
                self.began(1).set()
                while self.polls < seen + 30:  # several limits long
                    await asyncio.sleep(0.05)
            if slot == 2:  # waits, with its slot idle (a slow client, a queued task)
                self.began(2).set()
                await asyncio.sleep(3 * LIMIT_S)
            return web.json_response(ANSWER)
        except asyncio.CancelledError:
            self.closed.append(slot)
            raise

    async def _stalled(self, request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        async with self.slot0:  # a request pinned to a busy slot waits for it
            self.began(0).set()
            if body.get("stream") and self.stream_first:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(FIRST)
                await asyncio.Event().wait()  # stalled, mid-stream
            if body.get("hold"):
                await asyncio.Event().wait()  # stalled: never answers
            return web.json_response(ANSWER)


def _slot(i: int, busy: bool, *, task: int, processed: int, decoded: int) -> dict[str, Any]:
    return {
        "id": i,
        "n_ctx": 4096,
        "is_processing": busy,
        "id_task": task,
        "n_prompt_tokens": processed + decoded,
        "n_prompt_tokens_processed": processed,
        "next_token": [{"n_decoded": decoded}],
    }


@dataclass
class Rig:
    fake: Fake
    proxy: Proxy
    client: aiohttp.ClientSession
    events: list[Event]
    settings: ProxySettings  # read by the proxy per request (and by its watchdog per tick)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    def stalls(self) -> list[CacheEvent]:
        return [
            e
            for e in self.events
            if isinstance(e, CacheEvent) and e.kind is CacheEventKind.SLOT_STALLED
        ]


@pytest.fixture
async def rig(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    monkeypatch.setattr(watchdog, "POLL_MIN_S", 0.1)  # a quick tick for a 2 s limit
    fake = Fake()
    server = RawTestServer(fake.handle, host="127.0.0.1")
    await server.start_server()
    upstream = Upstream(lambda: f"http://127.0.0.1:{server.port}")
    events: list[Event] = []

    async def status() -> dict[str, Any]:
        return {}

    settings = ProxySettings(max_body_mb=1, upstream_timeout_s=600, stall_timeout_s=LIMIT_S)
    proxy = Proxy(
        ProxyDeps(
            upstream=upstream,
            settings=lambda: settings,
            server_state=lambda: "ready",
            n_slots=lambda: 3,
            emit=events.append,
            status=status,
        )
    )
    await proxy.start("127.0.0.1", 0)
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S))
    try:
        yield Rig(fake, proxy, client, events, settings)
    finally:
        await client.close()
        await proxy.stop()
        await proxy.drain()
        await upstream.close()
        await server.close()


async def until(cond: Any, what: str) -> None:
    """Wait (up to `WAIT_S`) for `cond()`: the fake hears of a closed connection a moment
    after the proxy closed it."""
    try:
        async with asyncio.timeout(WAIT_S):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


def chat(slot: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "id_slot": slot, **extra}


async def test_a_stalled_slot_is_cancelled_and_the_next_request_on_it_is_served(
    rig: Rig,
) -> None:
    """Two requests pinned to slot 0: the first stalls there, the second waits behind it.
    The first gets a 504 naming the slot and its upstream request is closed; the slot is
    free, and the second is answered (in the soak it waited 299.9 s)."""
    first = asyncio.ensure_future(rig.client.post(rig.url + CHAT, json=chat(0, hold=True)))
    await asyncio.wait_for(rig.fake.began(0).wait(), WAIT_S)
    second = asyncio.ensure_future(rig.client.post(rig.url + CHAT, json=chat(0)))
    stalled = await first
    assert stalled.status == 504
    error = (await stalled.json())["error"]
    assert error["type"] == "server_error" and error["code"] == 504
    assert "slot 0 made no progress" in error["message"], error
    assert "proxy.stall_timeout_s" in error["message"]
    served = await second
    assert served.status == 200 and await served.json() == ANSWER
    assert rig.fake.closed == [0]  # llama-server saw the stalled request go (and only it)
    (event,) = rig.stalls()
    assert event.slot == 0 and event.details["limit_s"] == LIMIT_S
    assert event.details["stalled_s"] >= LIMIT_S and "task 7" in str(event.details["seen"])


async def test_a_working_slot_and_an_idle_one_are_left_alone(rig: Rig) -> None:
    """Slot 1's counters move while its request takes several limits without a byte;
    slot 2 is idle while its request waits (a task queued, a slow client): neither is a
    stall."""
    working = asyncio.ensure_future(rig.client.post(rig.url + CHAT, json=chat(1)))
    waiting = asyncio.ensure_future(rig.client.post(rig.url + CHAT, json=chat(2)))
    for r in await asyncio.gather(working, waiting):
        assert r.status == 200, await r.text()
    assert rig.fake.polls >= 30 and not rig.stalls() and not rig.fake.closed


async def test_a_stream_stalled_after_its_headers_ends_with_an_error_event(rig: Rig) -> None:
    rig.fake.stream_first = True
    async with rig.client.post(rig.url + CHAT, json=chat(0, stream=True)) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        text = (await resp.read()).decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["content"] == "He"
    error = events[-1]["error"]
    assert "slot 0 made no progress" in error["message"] and error["code"] == 504
    await until(lambda: rig.fake.closed == [0], "the stalled stream's request was dropped")
    (event,) = rig.stalls()
    assert event.details["streamed"] is True


async def test_an_anthropic_request_stalled_before_its_headers_gets_its_apis_504(
    rig: Rig,
) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body |= {"id_slot": 0, "hold": True, "stream": True}
    async with rig.client.post(rig.url + "/v1/messages", json=body) as resp:
        assert resp.status == 504
        answer = await resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "api_error"
    assert "slot 0 made no progress" in answer["error"]["message"]


async def test_a_request_that_ends_sooner_costs_no_poll(rig: Rig) -> None:
    """The request budget (docs/benchmarks.md#request-budget): a request answered within
    a quarter of the limit never makes the watchdog read /slots."""
    for _ in range(5):
        r = await rig.client.post(rig.url + CHAT, json=chat(0))
        assert r.status == 200
    assert rig.fake.polls == 0


async def test_off_at_zero(rig: Rig) -> None:
    rig.settings.stall_timeout_s = 0.0  # a live setting: the running proxy reads it
    waiting = asyncio.ensure_future(rig.client.post(rig.url + CHAT, json=chat(0, hold=True)))
    await asyncio.wait_for(rig.fake.began(0).wait(), WAIT_S)
    done, _ = await asyncio.wait({waiting}, timeout=3 * LIMIT_S)
    assert not done and rig.fake.polls == 0 and not rig.stalls()
    waiting.cancel()


def test_the_limit_is_at_least_two_prompt_batches_at_the_measured_rate() -> None:
    """A slow CPU reads 2,048 prompt tokens in one step: 50 ms a token is 102 s between
    two moves of the counters, so 120 s would fire on a long prompt that is fine."""
    rate: list[float] = []
    dog = watchdog.SlotWatchdog(
        lambda: None,
        lambda: 120.0,
        floor_s=lambda: watchdog.BATCH_MARGIN * watchdog.N_BATCH * rate[0] / 1000 if rate else 0,
    )
    assert dog.limit() == 120.0  # nothing measured yet: the setting
    rate.append(50.0)
    assert dog.limit() == pytest.approx(204.8)
    off = watchdog.SlotWatchdog(lambda: None, lambda: 0.0, floor_s=lambda: 300.0)
    assert off.limit() == 0.0  # off stays off
