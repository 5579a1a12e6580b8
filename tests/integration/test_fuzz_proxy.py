"""The proxy against bad input, on a real llama-server (tiny model).

- Header bytes that are not UTF-8 (aiohttp hands them on as lone surrogates) once
  made every later telemetry write fail: status 500, nothing recorded.
- The fuzz corpus (`tests.fixtures.bad_requests`, ≥ 2,000 seeded cases in 15
  categories) sent concurrently over raw sockets: no 5xx, nothing forwarded, every
  answer one the category allows, the proxy healthy and its memory bounded after.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import resource
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from core.cache.manager import policy_factory
from core.config import ModelProfile
from core.engine import Core
from core.events import RequestCompleted
from core.paths import Paths
from core.routing.router import Router
from tests.conftest import settings_for
from tests.fixtures.bad_requests import Case, corpus
from tests.helpers import EventLog, chat_body, post_chat, wait_until

MAX_BODY_MB = 1  # the fuzz core's cap: oversize cases stay small
CONCURRENCY = 16


def get_status(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/warmslot/status", timeout=30) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), {}


async def send_raw(port: int, raw: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
    """Send one request as bytes; the status and the head of the answer (0: none)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            partial = e.partial if isinstance(e, asyncio.IncompleteReadError) else b""
            return 0, partial
        status = int(head.split(b" ", 2)[1])
        body = b""
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            None,
        )
        if length:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                body = await asyncio.wait_for(reader.readexactly(min(length, 4096)), timeout)
        return status, head + body
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def requests_recorded(core: Core) -> int:
    return int(core.query("totals").result(30)["requests"])


def forwarded(core: Core) -> int:
    assert core.proxy is not None
    return core.proxy.counters.requests


# ------------------------------------------------------------ one header poisons nothing
def test_undecodable_header_bytes_poison_nothing(make_core: Any) -> None:
    """A request whose User-Agent and session header hold non-UTF-8 bytes is served;
    every later request is recorded; status answers 200; nothing was dropped."""
    core = make_core()
    events = EventLog()
    core.subscribe(events.append, (RequestCompleted,))
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None
    port = core.proxy.port
    body = json.dumps(chat_body("poison", max_tokens=1)).encode()
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nUser-Agent: agent\xff\xfe\xfd/1.0\r\n"
        b"X-Session-Id: s\xff\xfe\xfd\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
    ) % (port, len(body), body)
    status, head = asyncio.run(send_raw(port, raw))
    assert status == 200, head
    n = 30
    for i in range(n):
        post_chat(port, chat_body(f"after {i}", max_tokens=1), timeout=120)
    wait_until(lambda: requests_recorded(core) == n + 1, 30, message="every request recorded")
    code, st = get_status(port)
    assert code == 200
    assert st["totals"]["requests"] == n + 1 and st["totals"]["dropped_rows"] == 0
    # The undecodable bytes became U+FFFD at the edge: in the event, the row, the session.
    first = events.of(RequestCompleted)[0]
    assert first.client == "agent\ufffd\ufffd\ufffd"
    assert first.session == "s\ufffd\ufffd\ufffd"
    rows = core.query("recent_requests", limit=n + 1).result(30)
    assert rows[-1]["client"] == "agent\ufffd\ufffd\ufffd"


def test_an_unexpected_exception_is_a_logged_500_in_openai_format(
    make_core: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not aiohttp's plain-text 500 with its traceback on stderr: an OpenAI error, and
    the traceback in the proxy's log (warmslot.log under `warmslot serve`)."""

    def broken(*args: Any) -> Any:
        raise RuntimeError("router exploded")

    core = make_core()
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None
    monkeypatch.setattr(Router, "decide", broken)  # the router the core made
    caplog.set_level("ERROR", logger="warmslot.proxy")
    req = urllib.request.Request(
        f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions",
        data=json.dumps(chat_body("x")).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 500
    error = json.loads(e.value.read())["error"]
    assert error["type"] == "server_error" and "warmslot.log" in error["message"]
    logged = [r for r in caplog.records if r.name == "warmslot.proxy" and r.exc_info]
    assert logged and "router exploded" in str(logged[0].exc_info[1])  # type: ignore[index]
    assert forwarded(core) == 0


# ------------------------------------------------------------ the fuzz corpus
@pytest.fixture(scope="module")
def fuzz_core(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, server_binary: Path
) -> Iterator[Core]:
    """A Core as `warmslot serve` runs it (cache manager on), with a model pool of one
    profile and strict model names (unknown names get 404) and a 1 MiB body cap."""
    s = settings_for(tiny_model, proxy__max_body_mb=MAX_BODY_MB)
    s.models = [ModelProfile(name="tiny", role="text")]
    s.pool.strict_models = True
    core = Core(Paths.under(tmp_path_factory.mktemp("fuzz")), s, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    try:
        yield core
    finally:
        core.stop()


async def send_all(port: int, cases: list[Case]) -> list[tuple[int, bytes]]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(case: Case) -> tuple[int, bytes]:
        async with gate:
            return await send_raw(port, case.raw(port))

    return await asyncio.gather(*(one(c) for c in cases))


def test_fuzz_corpus_is_refused_without_a_5xx(fuzz_core: Core) -> None:
    core = fuzz_core
    assert core.proxy is not None
    port = core.proxy.port
    # Warm up: one valid request (the pool's model loads; the cache manager learns).
    post_chat(port, chat_body("warm up", model="tiny", max_tokens=1), timeout=120)
    wait_until(lambda: requests_recorded(core) == 1, 30, message="the warm-up is recorded")
    cases = corpus(19, n_slots=2, max_body=MAX_BODY_MB * 1024 * 1024)
    assert len(cases) >= 2000
    before_forwarded, before_recorded = forwarded(core), requests_recorded(core)
    rss_before = psutil.Process().memory_info().rss
    t0 = time.monotonic()
    results = asyncio.run(send_all(port, cases))
    elapsed = time.monotonic() - t0
    rss_after = psutil.Process().memory_info().rss

    per_category: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    unexpected: list[str] = []
    for case, (status, head) in zip(cases, results, strict=True):
        per_category[case.category][status] += 1
        if status not in case.expect:
            unexpected.append(f"{case.category} {case.method} {case.path}: {status} {head[:300]!r}")
    histogram = collections.Counter(status for status, _ in results)
    print(f"\nfuzz: {len(cases)} requests in {elapsed:.1f} s, concurrency {CONCURRENCY}")
    for name, counts in per_category.items():
        print(f"  {name:20s} {sum(counts.values()):4d}  {dict(sorted(counts.items()))}")
    print(f"  statuses: {dict(sorted(histogram.items()))}")
    print(f"  test-process RSS {rss_before / 2**20:.0f} → {rss_after / 2**20:.0f} MiB")

    fives = [u for u in unexpected if " 5" in u.split(":", 1)[1][:3]]
    assert not [s for s in histogram if s >= 500], fives[:10]
    assert not unexpected, f"{len(unexpected)} unexpected answers: {unexpected[:10]}"
    # Nothing that should be refused reached llama-server or the telemetry.
    assert forwarded(core) == before_forwarded
    assert requests_recorded(core) == before_recorded
    # Healthy after: a normal request is served and recorded; status answers.
    post_chat(port, chat_body("still fine", model="tiny", max_tokens=1), timeout=120)
    wait_until(lambda: requests_recorded(core) == before_recorded + 1, 30, message="recorded after")
    code, st = get_status(port)
    assert code == 200 and st["totals"]["dropped_rows"] == 0
    # Memory: the corpus holds 2,000 bodies of up to ~1 MiB; the process must not keep
    # them (nor grow with each refused request).
    assert rss_after - rss_before < 200 * 2**20, (rss_before, rss_after)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"  test-process peak RSS {peak / 2**20:.0f} MiB")


def test_who_may_call(fuzz_core: Core) -> None:
    """Loopback Host and Origin pass, others get 403 (unless allowed); JSON bodies with
    or without a Content-Type pass, other types get 415; the API key vouches for a
    client that reached the proxy under another name."""
    core = fuzz_core
    assert core.proxy is not None
    port = core.proxy.port
    ok = json.dumps(chat_body("who", model="tiny", max_tokens=1)).encode()

    def send(*headers: bytes, host: bytes = b"127.0.0.1", ctype: bytes | None = None) -> int:
        case = Case("who", "POST", "/v1/chat/completions", ok, frozenset(), host=host)
        case.headers = [tuple(h.split(b": ", 1)) for h in headers]  # type: ignore[misc]
        case.content_type = ctype
        return asyncio.run(send_raw(port, case.raw(port)))[0]

    json_type = b"application/json; charset=utf-8"
    assert send(ctype=json_type) == 200
    assert send() == 200  # no Content-Type: scripts posting a JSON string send none
    assert send(ctype=b"text/plain") == 415
    assert send(ctype=b"application/x-www-form-urlencoded") == 415
    assert send(host=b"localhost:%d" % port, ctype=json_type) == 200
    assert send(host=b"[::1]:%d" % port, ctype=json_type) == 200
    assert send(host=b"attacker.example:%d" % port, ctype=json_type) == 403
    assert send(b"Origin: http://127.0.0.1:3000", ctype=json_type) == 200
    assert send(b"Origin: http://evil.example", ctype=json_type) == 403
    before = {n: core.settings.get(n) for n in ("proxy.allowed_origins", "proxy.api_key")}
    try:
        allowed = {"proxy.allowed_origins": ["http://evil.example"]}
        core.update_settings(allowed, persist=False).result(10)
        assert send(b"Origin: http://evil.example", ctype=json_type) == 200
        assert send(b"Origin: http://other.example", ctype=json_type) == 403
        keyed = {"proxy.allowed_origins": before["proxy.allowed_origins"], "proxy.api_key": "k3y"}
        core.update_settings(keyed, persist=False).result(10)
        bearer = b"Authorization: Bearer k3y"
        assert send(bearer, host=b"mybox.lan:%d" % port, ctype=json_type) == 200
        assert send(host=b"mybox.lan:%d" % port, ctype=json_type) == 403
        assert send(bearer, b"Origin: http://evil.example", ctype=json_type) == 403
    finally:
        core.update_settings(before, persist=False).result(10)
