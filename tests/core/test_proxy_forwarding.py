"""The proxy's request handling against an injected fake upstream (no llama-server).

The fake is an aiohttp test server on 127.0.0.1 that records what reaches it and
answers as each test scripts it; the proxy gets it through an `Upstream`, as the
engine gives it the real one. Order between the two sides is kept with events,
never with sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from core.cache.deps import deps_from
from core.cache.manager import CacheManager
from core.config.sections import ProxySettings
from core.events import Event, RequestCompleted
from core.proxy.app import Proxy, ProxyDeps, ProxyRequest, Route
from core.routing.router import Decision, Kind, Router, Target
from core.server.client import Timings
from core.server.upstream import Upstream
from tests.core.bg_support import SERVER, FakeCore

CHAT = "/v1/chat/completions"
TIMINGS = {
    "cache_n": 90,
    "prompt_n": 10,
    "prompt_ms": 12.5,
    "predicted_n": 3,
    "predicted_ms": 4.0,
}
ANSWER = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
    "id_slot": 1,
    "timings": TIMINGS,
}
WAIT_S = 10.0  # the longest any step may take; they take milliseconds
# The proxy's settings in these tests: a 1 MiB body limit, no slot watchdog.
SETTINGS = ProxySettings(max_body_mb=1, upstream_timeout_s=60, stall_timeout_s=0)

Handler = Callable[[web.BaseRequest, dict[str, Any]], Awaitable[web.StreamResponse]]


async def answer_json(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response(ANSWER)


@dataclass
class FakeUpstream:
    """A llama-server stand-in: records each request, answers with `handler`."""

    handler: Handler = answer_json
    received: list[tuple[str, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when a request's handler is cancelled: aiohttp's test server cancels it when
    # the peer (the proxy) closes the connection.
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body, dict(request.headers)))
        self.arrived.set()
        try:
            return await self.handler(request, body)
        except asyncio.CancelledError:
            self.closed.set()
            raise


@dataclass
class RecordingPolicy:
    """A cache policy that puts every request in slot 1 and records both calls."""

    prepared: list[dict[str, Any]] = field(default_factory=list)
    completed_calls: asyncio.Queue[tuple[int | None, Timings | None, int]] = field(
        default_factory=asyncio.Queue
    )

    async def prepare(self, req: ProxyRequest) -> None:
        self.prepared.append(
            {
                "endpoint": req.endpoint,
                "client": req.client,
                "session": req.session,
                "kind": req.kind,
                "stream": req.stream,
                "body": json.loads(json.dumps(req.body)),
            }
        )
        req.slot = 1
        req.body["id_slot"] = 1
        req.response_headers["X-Warmslot-Slot"] = "1"

    async def completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        self.completed_calls.put_nowait((req.slot, timings, status))


class FailingPolicy:
    async def prepare(self, req: ProxyRequest) -> None:
        req.body["messages"] = []  # a half-done edit that must not reach the server
        raise RuntimeError("cache manager bug")

    async def completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        pass


@dataclass
class Rig:
    fake: FakeUpstream
    upstream: Upstream
    proxy: Proxy
    client: aiohttp.ClientSession
    done: asyncio.Queue[RequestCompleted]
    deps: ProxyDeps

    async def rebuild(self, **changes: Any) -> None:
        """A proxy made of these deps with `changes` (a policy, a router …) in place of
        this one: nothing is set on a proxy after it is made."""
        await self.proxy.stop()
        self.deps = dataclasses.replace(self.deps, **changes)
        self.proxy = Proxy(self.deps)
        await self.proxy.start("127.0.0.1", 0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    async def next_record(self) -> RequestCompleted:
        return await asyncio.wait_for(self.done.get(), WAIT_S)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    fake = FakeUpstream()
    server = RawTestServer(fake.handle, host="127.0.0.1")
    await server.start_server()
    upstream = Upstream(lambda: f"http://127.0.0.1:{server.port}")
    done: asyncio.Queue[RequestCompleted] = asyncio.Queue()

    def emit(event: Event) -> None:
        if isinstance(event, RequestCompleted):
            done.put_nowait(event)

    async def status() -> dict[str, Any]:
        return {}

    deps = ProxyDeps(
        upstream=upstream,
        settings=lambda: SETTINGS,
        server_state=lambda: "ready",
        n_slots=lambda: 2,
        emit=emit,
        status=status,
    )
    proxy = Proxy(deps)
    await proxy.start("127.0.0.1", 0)
    client = aiohttp.ClientSession()
    rig = Rig(fake, upstream, proxy, client, done, deps)
    try:
        yield rig
    finally:
        await client.close()
        await rig.proxy.stop()
        await rig.proxy.drain()
        await upstream.close()
        await server.close()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


# ------------------------------------------------------------------ plain JSON
async def test_json_chat_is_forwarded_with_its_body_and_timings_are_accounted(rig: Rig) -> None:
    headers = {
        "User-Agent": "opencode/1.2 ai-sdk/5",
        "x-session-id": "s-1",
        "Authorization": "Bearer secret",  # the proxy's key, never the server's business
    }
    async with rig.client.post(rig.url + CHAT, json=chat(), headers=headers) as resp:
        assert resp.status == 200
        assert await resp.json() == ANSWER

    ((path, body, sent_headers),) = rig.fake.received
    assert path == CHAT
    assert body == {**chat(), "cache_prompt": True}
    assert "Authorization" not in sent_headers and sent_headers["x-session-id"] == "s-1"
    rec = await rig.next_record()
    assert (rec.status, rec.endpoint, rec.stream, rec.error) == (200, "chat", False, "")
    assert (rec.client, rec.session, rec.slot) == ("opencode", "s-1", 1)
    assert (rec.cache_n, rec.prompt_n, rec.prompt_ms, rec.predicted_n) == (90, 10, 12.5, 3)
    c = rig.proxy.counters
    assert (c.requests, c.errors, c.cached_tokens, c.prompt_tokens) == (1, 0, 90, 10)


async def test_upstream_error_is_passed_through_and_counted(rig: Rig) -> None:
    async def refuse(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        error = {"error": {"code": 400, "message": "the request exceeds the context size"}}
        return web.json_response(error, status=400)

    rig.fake.handler = refuse
    async with rig.client.post(rig.url + CHAT, json=chat()) as resp:
        assert resp.status == 400
        assert "context size" in (await resp.json())["error"]["message"]
    rec = await rig.next_record()
    assert rec.status == 400 and "context size" in rec.error and rec.cache_n is None
    assert rig.proxy.counters.errors == 1


# ------------------------------------------------------------------ streaming
def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


FIRST = sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
# As llama-server ends a chat stream: a finish reason, then `timings` (sent whether or
# not timings_per_token was asked for).
LAST = sse(
    {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "id_slot": 0,
        "timings": TIMINGS,
    }
)


def streaming(release: asyncio.Event) -> Handler:
    """An SSE answer: the first chunk at once, the rest only once `release` is set."""

    async def handler(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(FIRST)
        await release.wait()
        await resp.write(LAST)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


async def test_stream_passes_through_chunk_by_chunk_unbuffered(rig: Rig) -> None:
    release = asyncio.Event()
    rig.fake.handler = streaming(release)
    async with rig.client.post(rig.url + CHAT, json=chat(stream=True)) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        # The upstream cannot send its last chunk before `release`: the first one
        # reaching the client now proves the proxy does not hold the stream back.
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S)
        assert first == FIRST and not release.is_set()
        release.set()
        rest = await asyncio.wait_for(resp.read(), WAIT_S)
    assert rest == LAST + b"data: [DONE]\n\n"
    assert rig.fake.received[0][1]["stream"] is True
    rec = await rig.next_record()
    assert (rec.status, rec.stream, rec.slot, rec.error) == (200, True, 0, "")
    assert (rec.cache_n, rec.prompt_n) == (90, 10)
    assert rec.ttfb_ms is not None and rec.ttfb_ms <= rec.total_ms


async def test_client_hanging_up_mid_stream_closes_the_upstream_request(rig: Rig) -> None:
    never = asyncio.Event()
    rig.fake.handler = streaming(never)
    resp = await rig.client.post(rig.url + CHAT, json=chat(stream=True))
    assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S) == FIRST
    resp.close()  # the client goes: its connection closes
    await asyncio.wait_for(rig.fake.closed.wait(), WAIT_S)
    rec = await rig.next_record()
    assert (rec.status, rec.error, rec.cache_n) == (499, "client disconnected", None)
    assert rig.proxy.counters.errors == 1


async def test_client_hanging_up_during_prefill_closes_the_upstream_request(rig: Rig) -> None:
    """A non-streamed request: llama-server sends no byte until it is done (minutes of
    prefill on a CPU), so only the client's socket tells that nobody waits any more."""
    policy = RecordingPolicy()
    await rig.rebuild(policy=policy)
    never = asyncio.Event()

    async def prefill(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        await never.wait()
        raise AssertionError("unreachable")

    rig.fake.handler = prefill
    payload = json.dumps(chat()).encode()
    _reader, writer = await asyncio.open_connection("127.0.0.1", rig.proxy.port)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    await asyncio.wait_for(rig.fake.arrived.wait(), WAIT_S)
    writer.close()  # the client gives up before any response byte
    await writer.wait_closed()
    await asyncio.wait_for(rig.fake.closed.wait(), WAIT_S)
    rec = await rig.next_record()
    assert (rec.status, rec.error) == (499, "client disconnected")
    # The policy hears of it, so the slot it gave the request is free again.
    slot, timings, status = await asyncio.wait_for(policy.completed_calls.get(), WAIT_S)
    assert (slot, timings, status) == (1, None, 499)


# ------------------------------------------------------------------ malformed
@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b"{not json", None, "malformed JSON"),
        (json.dumps({"messages": []}).encode(), "messages", "non-empty array"),
        (json.dumps(chat(stream="yes")).encode(), "stream", "boolean"),
        (json.dumps(chat(id_slot=7)).encode(), "id_slot", "-1 or 0..1"),
    ],
)
async def test_malformed_request_gets_a_4xx_in_openai_format_and_nothing_is_forwarded(
    rig: Rig, raw: bytes, param: str | None, words: str
) -> None:
    headers = {"Content-Type": "application/json"}
    async with rig.client.post(rig.url + CHAT, data=raw, headers=headers) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param and words in error["message"]
    assert rig.fake.received == []


# ------------------------------------------------------------------ cache policy
async def test_policy_prepare_and_completed_see_the_request_and_its_timings(rig: Rig) -> None:
    policy = RecordingPolicy()
    await rig.rebuild(policy=policy)
    headers = {"User-Agent": "opencode/1.2", "x-warmslot-aux": "1", "x-session-id": "s-2"}
    async with rig.client.post(rig.url + CHAT, json=chat(), headers=headers) as resp:
        assert resp.status == 200 and resp.headers["X-Warmslot-Slot"] == "1"
        await resp.read()

    (seen,) = policy.prepared
    assert seen == {
        "endpoint": "chat",
        "client": "opencode",
        "session": "s-2",
        "kind": "aux",
        "stream": False,
        "body": {**chat(), "cache_prompt": True},
    }
    sent = rig.fake.received[0][1]
    assert sent["id_slot"] == 1 and sent["cache_prompt"] is True
    assert "x-warmslot-aux" not in rig.fake.received[0][2]  # ours, not the server's
    slot, timings, status = await asyncio.wait_for(policy.completed_calls.get(), WAIT_S)
    assert (slot, status) == (1, 200)
    assert timings == Timings(
        cache_n=90, prompt_n=10, prompt_ms=12.5, predicted_n=3, predicted_ms=4.0
    )


async def test_failing_policy_forwards_the_request_untouched(rig: Rig) -> None:
    await rig.rebuild(policy=FailingPolicy())
    async with rig.client.post(rig.url + CHAT, json=chat()) as resp:
        assert resp.status == 200 and resp.headers["X-Warmslot-Cache"] == "bypass"
        await resp.read()
    assert rig.fake.received[0][1] == {**chat(), "cache_prompt": True}
    assert rig.proxy.counters.bypasses == 1
    assert (await rig.next_record()).status == 200


# ------------------------------------------------------------------ the real cache manager
SYSTEM = "You are a careful coding agent. Follow the rules. " * 3 + "<env>date: today</env>"


async def fake_llama(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
    """What the cache manager asks of llama-server (render, tokenize) and a chat answer.

    Rendering wraps each message in its role's tags; every character is one token.
    """
    if request.path == "/apply-template":
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in body["messages"])
        return web.json_response({"prompt": text})
    if request.path == "/tokenize":
        return web.json_response({"tokens": [ord(c) for c in body["content"]]})
    return web.json_response({**ANSWER, "id_slot": body.get("id_slot", -1)})


async def test_cache_manager_prepares_and_learns_over_the_same_upstream(
    rig: Rig, tmp_path: Path
) -> None:
    """The real cache manager with the proxy's upstream: its own calls (render, tokenize)
    and the forwarded request go to one server over one session; the slot it picks is
    the one the request runs in, and `completed` records what the slot now holds."""
    core = FakeCore(tmp_path)
    mgr = CacheManager(deps_from(core, upstream=rig.upstream))  # type: ignore[arg-type]
    mgr.state.identity = SERVER  # what warm-up learns from /props after a start
    await rig.rebuild(policy=mgr)
    rig.fake.handler = fake_llama
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "read", "parameters": {}}}],
    }
    headers = {"User-Agent": "opencode/1.2", "x-session-id": "s-1"}
    async with rig.client.post(rig.url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["X-Warmslot-Slot"] == "0"
        assert resp.headers["X-Warmslot-Kind"] == "agent"
        fp16, n = resp.headers["X-Warmslot-Prefix"].split(":")
        await resp.read()
    await rig.proxy.drain()

    paths = [path for path, _, _ in rig.fake.received]
    assert paths[0] == "/apply-template" and paths[-1] == CHAT and "/tokenize" in paths
    forwarded = rig.fake.received[-1][1]
    assert forwarded["id_slot"] == 0 and forwarded["cache_prompt"] is True
    head = len("<system>" + SYSTEM[: SYSTEM.index("<env>")])
    assert int(n) == head  # the stable prefix ends where opencode's volatile <env> starts
    (learned,) = core.cache_events("prefix_learned")
    assert learned.fingerprint == fp16 and learned.tokens == head
    slot = mgr.state.slots.slots[0]
    assert slot.prefix_fp.startswith(fp16) and slot.session_of_last == "s-1"
    assert slot.inflight == 0 and slot.tokens_hint == 90 + 10 + 3  # cache + prompt + output


async def test_a_title_call_is_classified_once_and_runs_in_the_side_slot(
    rig: Rig, tmp_path: Path
) -> None:
    """The router classifies; the real cache manager reads its decision: the title call
    goes to the reserved slot with the router's reason, learns no prefix, and is
    recorded as a side call."""
    core = FakeCore(tmp_path)
    core.settings.server.slots, core.settings.cache.aux_slot = 2, True
    mgr = CacheManager(deps_from(core, upstream=rig.upstream))  # type: ignore[arg-type]
    mgr.state.identity = SERVER
    await rig.rebuild(policy=mgr)
    rig.fake.handler = fake_llama
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a title generator."},
            {"role": "user", "content": "Generate a title for this conversation: hi"},
        ],
    }
    headers = {"User-Agent": "opencode/1.2", "x-session-id": "s-1"}
    async with rig.client.post(rig.url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200
        assert (resp.headers["X-Warmslot-Kind"], resp.headers["X-Warmslot-Slot"]) == ("aux", "1")
        assert "X-Warmslot-Prefix" not in resp.headers
        await resp.read()
    rec = await rig.next_record()
    assert (rec.kind, rec.slot, rec.session) == ("aux", 1, "s-1")
    await rig.proxy.drain()
    assert [path for path, _, _ in rig.fake.received] == [CHAT]  # nothing rendered
    (isolated,) = core.cache_events("aux_isolated")
    assert isolated.reason == "title/summary request shape" and isolated.slot == 1
    assert (
        mgr.state.slots.slots[1].inflight == 0 and mgr.state.slots.slots[1].session_of_last == "s-1"
    )


async def test_a_pool_router_refuses_an_unknown_model_and_admits_a_known_one(rig: Rig) -> None:
    """Pool mode: the router picks the model by the `model` field (strict: an unknown
    name is a 404 in OpenAI's format), the pool's admission gets the decision."""
    targets = [Target("coder", rig.upstream, primary=True)]
    router = Router(lambda: targets, strict=lambda: True)
    admitted: list[Decision] = []
    released: list[bool] = []

    async def admit(decision: Decision) -> Route:
        admitted.append(decision)
        return Route(
            model=decision.model, upstream=decision.upstream, release=lambda: released.append(True)
        )

    await rig.rebuild(router=router, admit=admit)
    async with rig.client.post(rig.url + CHAT, json=chat(model="nope")) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert error["type"] == "not_found_error" and error["param"] == "model"
    assert "'nope'" in error["message"] and rig.fake.received == [] and admitted == []
    async with rig.client.post(rig.url + CHAT, json=chat(model="coder")) as resp:
        assert resp.status == 200 and resp.headers["X-Warmslot-Model"] == "coder"
        await resp.read()
    (decision,) = admitted
    assert (decision.model, decision.kind, decision.upstream) == ("coder", Kind.AGENT, rig.upstream)
    assert released == [True] and len(rig.fake.received) == 1


# ------------------------------------------------------------------ the upstream
async def test_not_ready_upstream_gets_503_and_nothing_is_forwarded() -> None:
    upstream = Upstream(lambda: None)
    assert upstream.client() is None
    proxy = Proxy(
        ProxyDeps(
            upstream=upstream,
            settings=lambda: SETTINGS,
            server_state=lambda: "starting",
            n_slots=lambda: 2,
            emit=lambda e: None,
            status=lambda: asyncio.sleep(0, {}),
        )
    )
    await proxy.start("127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.post(f"http://127.0.0.1:{proxy.port}{CHAT}", json=chat()) as resp,
        ):
            assert resp.status == 503 and resp.headers["Retry-After"] == "2"
            assert "starting" in (await resp.json())["error"]["message"]
    finally:
        await proxy.stop()
        await upstream.close()


async def test_upstream_client_follows_the_servers_address() -> None:
    address = ["http://127.0.0.1:1001"]
    upstream = Upstream(lambda: address[0])
    first = upstream.client()
    assert first is not None and first.base_url == "http://127.0.0.1:1001"
    assert upstream.client() is first
    address[0] = "http://127.0.0.1:1002"  # restarted on another port
    second = upstream.client()
    assert second is not None and second.base_url == "http://127.0.0.1:1002"
    await upstream.close()
    assert upstream.client() is None and upstream.closed


def per_token(release: asyncio.Event) -> Handler:
    """A stream as llama-server sends it with timings_per_token: `timings` in every event."""

    async def handler(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        partial = {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
        await resp.write(sse({**partial, "timings": TIMINGS}))
        await release.wait()
        await resp.write(LAST + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.parametrize("asked", [None, True])
async def test_a_stream_reaches_the_client_as_llama_server_would_have_sent_it(
    rig: Rig, asked: bool | None
) -> None:
    """The proxy asks for timings_per_token to learn a stream's reuse numbers from its
    first event (the headers need them) and takes them out of every event but the last
    one again — unless the client asked for them itself."""
    release = asyncio.Event()
    rig.fake.handler = per_token(release)
    body = chat(stream=True)
    if asked is not None:
        body["timings_per_token"] = asked
    async with rig.client.post(rig.url + CHAT, json=body) as resp:
        assert resp.headers["X-Warmslot-Cached-Tokens"] == "90"  # from the first event
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S)
        release.set()
        rest = await asyncio.wait_for(resp.read(), WAIT_S)
    assert rig.fake.received[0][1]["timings_per_token"] is True
    event = json.loads(first[len(b"data: ") :])
    assert ("timings" in event) is bool(asked)
    assert event["choices"][0]["delta"] == {"content": "Hel"}
    assert rest == LAST + b"data: [DONE]\n\n"  # the last result keeps its timings
    rec = await rig.next_record()
    assert (rec.cache_n, rec.prompt_n) == (90, 10)
