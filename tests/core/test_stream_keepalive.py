"""A streamed request that waits long before llama-server's first event keeps its client.

Claude Code drops a stream silent for 300 s and sends it again, Codex too ("Reconnecting
5/5"): a cold ~19.6k-token prefill took 434–503 s on a 2-core machine, so it never
finished (docs/clients.md#timeouts). Scaled here: the proxy's keep-alive interval is
0.2 s, the client's idle watchdog 2 s (no byte for that long: it gives up), and the wait
lasts until the client has read three keep-alives — without them the client gives up
first and the test fails. The wait is llama-server's (a fake that holds its first event:
a real one cannot be made to take minutes on demand) or the cache's (a policy whose
`prepare` is slow, as a restore and its verification are). Every byte the client reads
goes through a strict SSE parser (the rules of the HTML spec's event stream; no SDK is
installed here), and each API's keep-alive is the one its clients skip: Anthropic's
``ping`` event on Messages, an SSE comment elsewhere.
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
from core.proxy import stream
from core.proxy.app import Proxy, ProxyDeps
from core.proxy.types import ProxyRequest, SlotPlan
from core.server.client import Timings
from core.server.upstream import Upstream

INTERVAL_S = 0.2  # the proxy's keep-alive interval here
IDLE_S = 2.0  # the client's idle watchdog: ten intervals
WAIT_S = 60.0  # the longest any step may take on a loaded machine
PINGS = 3  # keep-alives the client reads before the wait ends

PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
EVENTS = {  # what llama-server streams for each API (shortened)
    "chat": [
        (None, {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
        (None, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        (None, "[DONE]"),
    ],
    "messages": [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 9, "cache_read_input_tokens": 0}},
            },
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}},
        ),
        ("message_stop", {"type": "message_stop"}),
    ],
    "responses": [
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"}),
        ("response.completed", {"type": "response.completed", "response": {}}),
    ],
}


def _sse(endpoint: str) -> bytes:
    out = b""
    for name, data in EVENTS[endpoint]:
        text = data if isinstance(data, str) else json.dumps(data)
        out += (f"event: {name}\n" if name else "").encode() + f"data: {text}\n\n".encode()
    return out


@dataclass
class Event:
    name: str
    data: str


def parse_sse(text: str) -> tuple[list[Event], int]:
    """The events and the comment lines of an SSE body, parsed strictly: every line is a
    comment, a known field or the blank line that ends an event."""
    events: list[Event] = []
    comments = 0
    name, data = "message", []
    assert text.endswith("\n\n"), f"the stream ends mid-event: {text[-80:]!r}"
    for line in text.split("\n")[:-1]:
        if not line:
            if data:
                events.append(Event(name, "\n".join(data)))
            name, data = "message", []
        elif line.startswith(":"):
            comments += 1
        else:
            key, sep, value = line.partition(":")
            assert sep and key in ("event", "data", "id", "retry"), f"not SSE: {line!r}"
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
    return events, comments


@dataclass
class Fake:
    """llama-server: sends its stream's headers at once (as the real one does, before the
    prefill), then its events once `release` is set; or a 500 instead."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    fail: bool = False

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        endpoint = next(k for k, v in PATHS.items() if v == request.path)
        await request.read()
        if self.fail:
            await self.release.wait()
            return web.json_response({"error": {"message": "the model broke"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await self.release.wait()
        await response.write(_sse(endpoint))
        await response.write_eof()
        return response


@dataclass
class SlowPolicy:
    """A cache whose `prepare` takes until `release` (a restore being verified)."""

    release: asyncio.Event | None = None
    prepared: int = 0

    async def prepare(self, req: ProxyRequest) -> SlotPlan | None:
        if self.release is not None:
            await self.release.wait()
        self.prepared += 1
        return None

    async def completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        return None


@dataclass
class Rig:
    fake: Fake
    policy: SlowPolicy
    proxy: Proxy

    async def read(self, endpoint: str, release: asyncio.Event) -> tuple[int, dict[str, str], str]:
        """Stream a request as an agent with an idle watchdog does; `release` is set once
        it read `PINGS` keep-alives. Status, headers and the whole body."""
        ping = stream.keepalive_event(endpoint)
        body = {"stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        if endpoint == "responses":
            body = {"stream": True, "input": "hi"}
        timeout = aiohttp.ClientTimeout(total=WAIT_S, sock_read=IDLE_S)
        url = f"http://127.0.0.1:{self.proxy.port}{PATHS[endpoint]}"
        async with (
            aiohttp.ClientSession(timeout=timeout) as client,
            client.post(url, json=body) as r,
        ):
            got = b""
            async for chunk in r.content.iter_any():
                got += chunk
                if got.count(ping) >= PINGS:
                    release.set()
            return r.status, dict(r.headers), got.decode()


@pytest.fixture
async def rig(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    monkeypatch.setattr(stream, "KEEPALIVE_S", INTERVAL_S)
    fake = Fake()
    server = RawTestServer(fake.handle, host="127.0.0.1")
    await server.start_server()
    upstream = Upstream(lambda: f"http://127.0.0.1:{server.port}")
    policy = SlowPolicy()

    async def status() -> dict[str, Any]:
        return {}

    settings = ProxySettings(max_body_mb=1, upstream_timeout_s=600, stall_timeout_s=0)
    proxy = Proxy(
        ProxyDeps(
            upstream=upstream,
            settings=lambda: settings,
            server_state=lambda: "ready",
            n_slots=lambda: 2,
            emit=lambda e: None,
            status=status,
            policy=policy,
        )
    )
    await proxy.start("127.0.0.1", 0)
    try:
        yield Rig(fake, policy, proxy)
    finally:
        await proxy.stop()
        await proxy.drain()
        await upstream.close()
        await server.close()


def _check_stream(endpoint: str, text: str) -> None:
    """Well-formed for the API: the keep-alives its clients skip, then the events as
    llama-server sent them."""
    events, comments = parse_sse(text)
    if endpoint == "messages":
        assert comments == 0
        pings = [e for e in events if e.name == "ping"]
        assert len(pings) >= PINGS
        for e in events:  # Anthropic's rule: the event's name is its data's type
            assert json.loads(e.data)["type"] == e.name, e
        events = events[len(pings) :]
    else:
        assert comments >= PINGS
        assert text.startswith(": keep-alive\n\n")
    sent = [(n or "message", d) for n, d in EVENTS[endpoint]]
    got = [(e.name, e.data if e.data == "[DONE]" else json.loads(e.data)) for e in events]
    assert got == sent


@pytest.mark.parametrize("endpoint", list(PATHS))
async def test_a_long_wait_for_the_first_event_keeps_the_stream_alive(
    rig: Rig, endpoint: str
) -> None:
    status, headers, text = await rig.read(endpoint, rig.fake.release)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["X-Warmslot-Cache"] == "unknown"  # opened before the numbers came
    assert "X-Warmslot-Request-Id" in headers
    _check_stream(endpoint, text)


async def test_a_slow_cache_step_keeps_the_stream_alive(rig: Rig) -> None:
    """The wait before the request is forwarded (a restore, its verification, the
    stable prefix read alone) is covered too."""
    rig.policy.release = asyncio.Event()
    rig.fake.release.set()  # llama-server answers at once once asked
    status, _, text = await rig.read("messages", rig.policy.release)
    assert status == 200 and rig.policy.prepared == 1
    _check_stream("messages", text)


async def test_an_error_after_the_keepalives_ends_the_stream_with_an_error_event(
    rig: Rig,
) -> None:
    """The status went out with the first keep-alive: llama-server's 500 after it is an
    error event in the stream, in the API's shape, not a second status."""
    rig.fake.fail = True
    status, _, text = await rig.read("chat", rig.fake.release)
    assert status == 200
    events, comments = parse_sse(text)
    assert comments >= PINGS
    (error,) = [json.loads(e.data) for e in events]
    assert "the model broke" in error["error"]["message"], error


async def test_a_quick_stream_has_no_keepalive_and_its_numbers_in_the_headers(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "KEEPALIVE_S", WAIT_S)
    rig.fake.release.set()
    status, headers, text = await rig.read("messages", asyncio.Event())
    assert status == 200
    assert headers["X-Warmslot-Cache"] == "miss"  # from message_start's usage
    events, comments = parse_sse(text)
    assert comments == 0 and all(e.name != "ping" for e in events)
