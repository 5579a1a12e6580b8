"""Requests to llama-server go again only when they provably did not run
(core.server.client.send), and pooled connections are dropped before the server closes
them (core.server.upstream.KEEPALIVE_S).

The server here is a small real HTTP/1.1 server on a socket (asyncio streams), since
the faults under test — a connection cut after the server read a request, an idle
connection closed after a few seconds — are ones llama-server shows only by chance.
The real llama-server's own keep-alive is measured in
tests/integration/test_upstream_keepalive.py. The rule itself (which try may go again)
is checked with a stand-in session that fails on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from core.config.sections import ProxySettings
from core.errors import UpstreamError
from core.proxy.app import Proxy, ProxyDeps
from core.server.client import RESENDS, Attempt, RequestLost, current_attempt, send
from core.server.upstream import KEEPALIVE_S, Upstream

CHAT = "/v1/chat/completions"
ANSWER = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}


@dataclass
class Seen:
    """One request the server read in full: on which connection, which of it."""

    conn: int
    nth: int  # 1 for the connection's first request
    method: str
    path: str
    body: bytes


@dataclass
class CuttingServer:
    """HTTP/1.1 with keep-alive. `cut(conn, nth)` says whether to close the connection
    after reading that request whole, without a byte of answer; idle connections close
    after `idle_close_s` (None: never)."""

    cut: Callable[[int, int], bool] = lambda conn, nth: False
    idle_close_s: float | None = None
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    idle_closed: int = 0
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn, nth = self.connections, 0
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_close_s)
                except TimeoutError:
                    self.idle_closed += 1
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                nth += 1
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.lower(): v.strip()
                    for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append(Seen(conn, nth, method, path, body))
                if self.cut(conn, nth):
                    return
                payload = json.dumps(self.answer(path)).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Keep-Alive: timeout=5, max=100\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @staticmethod
    def answer(path: str) -> object:
        if path == "/tokenize":
            return {"tokens": [1, 2, 3]}
        if path == "/health":
            return {"status": "ok"}
        return ANSWER

    def bodies(self, marker: bytes) -> list[Seen]:
        return [s for s in self.seen if marker in s.body]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[CuttingServer], Any]]:
    servers: list[asyncio.Server] = []

    async def start(server: CuttingServer) -> str:
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        servers.append(srv)
        server.port = srv.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{server.port}"

    yield start
    for srv in servers:
        srv.close()
        await srv.wait_closed()


@pytest.fixture
async def upstreams() -> AsyncIterator[list[Upstream]]:
    made: list[Upstream] = []
    yield made
    for up in made:
        await up.close()


async def _proxy(upstream: Upstream) -> Proxy:
    settings = ProxySettings(max_body_mb=1, upstream_timeout_s=60.0, stall_timeout_s=0)
    proxy = Proxy(
        ProxyDeps(
            upstream=upstream,
            settings=lambda: settings,
            server_state=lambda: "ready",
            n_slots=lambda: 1,
            emit=lambda e: None,
            status=lambda: asyncio.sleep(0, {}),
        )
    )
    await proxy.start("127.0.0.1", 0)
    return proxy


def _chat(word: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": word}], "stream": False}


@pytest.mark.parametrize("on", ["a pooled connection", "a new connection"])
async def test_a_post_cut_after_it_reached_the_server_is_not_sent_again_and_gets_a_502(
    serve: Callable[[CuttingServer], Any], upstreams: list[Upstream], on: str
) -> None:
    """The server read the whole request, then the connection went without an answer:
    it may have run (a generation, a slot filled), so the client gets a 502 in OpenAI's
    shape that says so, and the server saw it once. Before, the proxy took any such
    disconnect for a stale pooled connection and sent the POST again, up to 4 times."""
    pooled = on == "a pooled connection"
    # Pooled: the second request on a connection is cut. New: every first one is.
    server = CuttingServer(cut=(lambda c, n: n == 2) if pooled else (lambda c, n: c == 1))
    base = await serve(server)
    upstream = Upstream(lambda: base)
    upstreams.append(upstream)
    proxy = await _proxy(upstream)
    url = f"http://127.0.0.1:{proxy.port}{CHAT}"
    try:
        async with aiohttp.ClientSession() as client:
            if pooled:
                async with client.post(url, json=_chat("first")) as resp:
                    assert resp.status == 200, await resp.text()
            async with client.post(url, json=_chat("cutword")) as resp:
                status, answer = resp.status, await resp.json()
    finally:
        await proxy.stop()
    assert [(s.conn, s.nth) for s in server.bodies(b"cutword")] == [(1, 2 if pooled else 1)]
    assert status == 502
    error = answer["error"]
    assert error["type"] == "server_error"
    assert "not sent again" in error["message"] and "may have run" in error["message"]
    assert "ServerDisconnected" in error["message"]  # the cause, as aiohttp named it


async def test_warmslots_own_calls_resend_a_get_but_not_a_post_that_went_out(
    serve: Callable[[CuttingServer], Any], upstreams: list[Upstream]
) -> None:
    """LlamaClient follows the same rule: a GET whose pooled connection was cut goes again
    on a new one (sending it twice does what once does), a POST (here /tokenize) that
    went out is an error for its caller, seen once by the server."""
    server = CuttingServer(cut=lambda c, n: n == 2)  # each connection's second request
    base = await serve(server)
    upstream = Upstream(lambda: base)
    upstreams.append(upstream)
    client = upstream.client()
    assert client is not None
    assert await client.health() is True  # connection 1, request 1
    assert await client.health() is True  # connection 1, request 2: cut, then connection 2
    assert [(s.conn, s.nth) for s in server.seen] == [(1, 1), (1, 2), (2, 1)]
    with pytest.raises(UpstreamError, match="not sent again"):
        await client.tokenize("cutword")  # connection 2, request 2: cut
    assert [(s.conn, s.nth) for s in server.bodies(b"cutword")] == [(2, 2)]


async def test_an_idle_pooled_connection_is_dropped_before_the_server_would_close_it(
    serve: Callable[[CuttingServer], Any], upstreams: list[Upstream]
) -> None:
    """A server that closes idle connections after a few seconds, as llama-server does
    after 5: the pool lets go of one sooner, so no request goes out on a connection the
    server may be closing at that very moment. Before, the pool kept idle connections
    30 s, and a request sent as the server's close crossed it was lost or sent twice."""
    server_idle = KEEPALIVE_S + 2.0
    server = CuttingServer(idle_close_s=server_idle)
    base = await serve(server)
    upstream = Upstream(lambda: base)
    upstreams.append(upstream)
    client = upstream.client()
    assert client is not None
    assert await client.tokenize("one") == [1, 2, 3]
    # Idle past the pool's keep-alive, not yet past the server's: the scenario itself.
    await asyncio.sleep(KEEPALIVE_S + 0.5)
    assert server.idle_closed == 0  # the server still holds the first connection open
    assert await client.tokenize("two") == [1, 2, 3]
    assert [(s.conn, s.nth) for s in server.seen] == [(1, 1), (2, 1)]
    assert len(server.seen) == 2  # each sent once


# --------------------------------------------------------------- the rule on its own


class FailingSession:
    """Stand-in for an aiohttp session: each try fills its `Attempt` as `AttemptRequest`
    would and raises what the next entry of `tries` says (None: answers)."""

    def __init__(self, tries: list[tuple[bool, bool, BaseException | None]]) -> None:
        self.tries = tries
        self.calls = 0

    async def request(self, method: str, url: str, **kwargs: Any) -> str:
        reused, written, error = self.tries[self.calls]
        self.calls += 1
        attempt = current_attempt()
        assert isinstance(attempt, Attempt)
        attempt.reused = reused
        attempt.written = attempt.written or written
        if error is not None:
            raise error
        return "answer"


GONE = aiohttp.ServerDisconnectedError()


@pytest.mark.parametrize(
    ("method", "tries", "calls", "outcome"),
    [
        # Reused, nothing of it went out: sent again (once per dead pooled connection).
        ("POST", [(True, False, GONE), (True, False, GONE), (False, False, None)], 3, "answer"),
        # Reused, but its body had gone out: not again.
        ("POST", [(True, True, GONE)], 1, RequestLost),
        # Went out on a new connection and failed: not again.
        ("POST", [(False, True, GONE)], 1, RequestLost),
        # Could not even connect: the error as it is.
        ("POST", [(False, False, aiohttp.ClientOSError(111, "refused"))], 1, aiohttp.ClientOSError),
        # A GET went out on a pooled connection that was cut: again.
        ("GET", [(True, True, GONE), (False, True, None)], 2, "answer"),
        # A timeout is never a stale connection.
        ("POST", [(True, False, aiohttp.ServerTimeoutError())], 1, aiohttp.ServerTimeoutError),
        # Every try on another dead pooled connection: it stops after RESENDS resends.
        (
            "POST",
            [(True, False, GONE)] * (RESENDS + 1),
            RESENDS + 1,
            aiohttp.ServerDisconnectedError,
        ),
    ],
    ids=["unsent", "sent-pooled", "sent-new", "refused", "get", "timeout", "bounded"],
)
async def test_which_failed_try_goes_again(
    method: str, tries: list[tuple[bool, bool, BaseException | None]], calls: int, outcome: Any
) -> None:
    session = FailingSession(tries)
    if isinstance(outcome, str):
        assert await send(session, method, "http://x/y", data=b"{}") == outcome  # type: ignore[arg-type]
    else:
        with pytest.raises(outcome):
            await send(session, method, "http://x/y", data=b"{}")  # type: ignore[arg-type]
    assert session.calls == calls


async def test_a_bodyless_post_counts_as_sent_from_its_first_byte() -> None:
    """Without a body there is no hook before its headers go out: never sent twice."""
    session = FailingSession([(True, False, GONE)])
    with pytest.raises(RequestLost):
        await send(session, "POST", "http://x/y")  # type: ignore[arg-type]
    assert session.calls == 1
