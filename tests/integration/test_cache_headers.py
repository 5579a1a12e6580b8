"""The X-Warmslot-* cache headers against a real llama-server (core.proxy.headers).

Every number in them must be the server's own for that very request: the headers of
a non-streamed answer are checked against its body's `timings`, those of a stream
against the `timings` of its last event — although they leave with its first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.cache.manager import CacheManager, policy_factory
from core.engine import Core
from core.proxy.headers import HIT_SHARE
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration

# About 1,200 tokens of the tiny model: long enough to calibrate the cold prefill rate
# (COLD_MIN_TOKENS), short enough for a quick test.
SYSTEM = "You are a careful coding agent. " + " ".join(
    f"Rule {i}: read the file before you edit it." for i in range(120)
)


def body(question: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 3,
        "temperature": 0,
        "stream": stream,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        **extra,
    }


def url(core: Core) -> str:
    assert core.proxy is not None
    return f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions"


HEADERS = {"User-Agent": "header-test/1.0", "x-session-id": "hdr-1"}


def stream(core: Core, b: dict[str, Any]) -> tuple[httpx.Headers, list[dict[str, Any]], float]:
    """Headers, every event, and seconds from the headers to the first event."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url(core), json=b, headers=HEADERS, timeout=300) as resp:
        assert resp.status_code == 200
        t_headers = time.perf_counter()
        gap = -1.0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                if gap < 0:
                    gap = time.perf_counter() - t_headers
                events.append(json.loads(line[6:]))
        return resp.headers, events, gap


def verdict(cached: int, prefilled: int) -> str:
    if cached == 0:
        return "miss"
    return "hit" if cached >= HIT_SHARE * (cached + prefilled) else "partial"


@pytest.fixture
def core(make_core: Any) -> Core:
    c: Core = make_core(policy_factory=policy_factory)
    c.start(wait_ready=True, timeout=120)
    return c


def test_non_streamed_headers_are_the_answers_timings(core: Core) -> None:
    r1 = post_chat(core, body("first question"), headers=HEADERS)
    t1 = r1.json()["timings"]
    h = r1.headers
    assert (h["X-Warmslot-Cache"], h["X-Warmslot-Cached-Tokens"]) == ("miss", "0")
    assert h["X-Warmslot-Prefilled-Tokens"] == str(t1["prompt_n"])
    assert h["X-Warmslot-Slot"] == str(r1.json().get("id_slot", h["X-Warmslot-Slot"]))
    assert h["X-Warmslot-Session"] == "hdr-1" and h["X-Warmslot-Restored"] == "0"
    assert "X-Warmslot-Est-Saved-Ms" not in h  # no cold prefill measured before it
    assert t1["prompt_n"] >= 256  # so this one calibrates the rate
    r2 = post_chat(core, body("second question"), headers=HEADERS)
    t2, h = r2.json()["timings"], r2.headers
    assert t2["cache_n"] > 0
    assert h["X-Warmslot-Cached-Tokens"] == str(t2["cache_n"])
    assert h["X-Warmslot-Prefilled-Tokens"] == str(t2["prompt_n"])
    assert h["X-Warmslot-Cache"] == verdict(t2["cache_n"], t2["prompt_n"])
    rate = t1["prompt_ms"] / t1["prompt_n"]  # the one cold prefill so far
    assert h["X-Warmslot-Est-Saved-Ms"] == f"{t2['cache_n'] * rate:.0f}"
    # The same request again: all but the last token from the cache.
    r3 = post_chat(core, body("second question"), headers=HEADERS)
    assert r3.headers["X-Warmslot-Cache"] == "hit"
    assert r3.headers["X-Warmslot-Cached-Tokens"] == str(r3.json()["timings"]["cache_n"])


def test_streamed_headers_leave_with_the_first_event_and_match_the_last(core: Core) -> None:
    post_chat(core, body("warm the slot"), headers=HEADERS)
    h, events, gap = stream(core, body("a streamed question", stream=True))
    final = [e["timings"] for e in events if "timings" in e][-1]
    assert h["X-Warmslot-Cached-Tokens"] == str(final["cache_n"]) and final["cache_n"] > 0
    assert h["X-Warmslot-Prefilled-Tokens"] == str(final["prompt_n"])
    assert h["X-Warmslot-Cache"] == verdict(final["cache_n"], final["prompt_n"])
    assert h["X-Warmslot-Request-Id"] and h["X-Warmslot-Session"] == "hdr-1"
    # The first event was written right behind the headers, not after the generation.
    assert 0 <= gap < 1.0, gap
    # Every event is still the OpenAI chunk the client expects, as llama-server sends it
    # to a client that did not ask for timings_per_token: `timings` only in the last
    # result (the chunk with the finish reason).
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    with_timings = [e for e in events if "timings" in e]
    assert len(with_timings) == 1 and with_timings[0]["choices"][0]["finish_reason"]
    assert (
        "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
        is not None
    )


def test_a_stream_without_numbers_says_unknown_and_invents_none(core: Core) -> None:
    """A client that turns `timings_per_token` off gets no numbers it would have to
    trust: the first event carries none, so the headers say so."""
    h, events, _ = stream(core, body("no timings please", stream=True, timings_per_token=False))
    assert h["X-Warmslot-Cache"] == "unknown"
    assert "X-Warmslot-Cached-Tokens" not in h and "X-Warmslot-Est-Saved-Ms" not in h
    assert "timings" in events[-1]  # llama-server's last event has them anyway
    assert sum("timings" in e for e in events) == 1


def test_restored_header_after_a_restart(make_core: Any, tmp_path: Path) -> None:
    """After a restart the slot is filled again before the next turn: from disk and
    verified (the header says how many tokens came back) or, when no usable state was
    saved, by a prefill (the header says 0). Either way it says what happened — the
    events of the restart tell which one did."""
    home = tmp_path / "home"
    first = make_core(home=home, policy_factory=policy_factory)
    first.start(wait_ready=True, timeout=120)
    turn1 = body("first turn")
    answer = post_chat(first, turn1, headers=HEADERS).json()["choices"][0]["message"]["content"]
    saver = first.policy
    assert isinstance(saver, CacheManager)

    async def quiet() -> bool:
        return saver.idle()

    wait_until(lambda: first.submit(quiet()).result(10), 120, message="background work")
    first.stop()  # saves the conversation
    second = make_core(home=home, policy_factory=policy_factory)
    second.start(wait_ready=True, timeout=120)
    manager = second.policy
    assert isinstance(manager, CacheManager)

    async def idle() -> bool:
        return manager.idle()

    wait_until(lambda: second.submit(idle()).result(10), 120, message="boot re-warm")
    turn2 = body("first turn")
    turn2["messages"] += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "second turn"},
    ]
    r = post_chat(second, turn2, headers=HEADERS)
    cached = r.json()["timings"]["cache_n"]
    assert r.headers["X-Warmslot-Cached-Tokens"] == str(cached)
    events = second.query("recent_events", limit=100, category="cache").result(10)
    restores = [e for e in events if e["kind"] == "restore_ok"]
    print("restart:", [e["kind"] for e in reversed(events)], dict(r.headers))
    if restores:
        assert int(r.headers["X-Warmslot-Restored"]) == restores[0]["tokens"] > 0
    else:
        assert r.headers["X-Warmslot-Restored"] == "0"


# ------------------------------------------------------------------ Messages, Responses


def _api_numbers(path: str, stream: bool, data: bytes) -> tuple[int, int]:
    """(cached, read) as the answer itself reports them: the last `timings` (or the
    Anthropic/Responses `usage`) in the body or stream."""
    from core.proxy.headers import reuse_from

    if not stream:
        found = reuse_from(json.loads(data))
        assert found is not None
        return found.cached, found.prefilled
    last = None
    for line in data.split(b"\n"):
        if line.startswith(b"data: {") and (found := reuse_from(json.loads(line[6:]))):
            last = found
    assert last is not None
    return last.cached, last.prefilled


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["messages", "responses"])
def test_messages_and_responses_carry_the_same_headers(
    make_core: Any, api: str, stream: bool
) -> None:
    """Both other chat APIs, on whichever server the test build cache has: the headers
    equal the numbers the answer itself reports (the stream's last event)."""
    from tests.integration.test_api_routes import (
        CLAUDE_UA,
        CODEX_UA,
        _binary_with,
        _messages,
        _post,
        _responses,
    )

    server = _binary_with(patched=True) or _binary_with(patched=False)
    changes = {"server__binary": str(server)} if server is not None else {}
    core = make_core(policy_factory=policy_factory, **changes)
    core.start(wait_ready=True, timeout=120)
    path = "/v1/messages" if api == "messages" else "/v1/responses"
    ua = {"User-Agent": CLAUDE_UA if api == "messages" else CODEX_UA, "x-session-id": "api-1"}
    for turn in (1, 2):
        b = _messages(turn, "s-hdr") if api == "messages" else _responses(turn)
        b["stream"] = stream
        status, headers, data = _post(core, path, b, ua)
        assert status == 200, data[:300]
        cached, read = _api_numbers(path, stream, data)
        h = {k.lower(): v for k, v in headers.items()}
        assert (h["x-warmslot-cached-tokens"], h["x-warmslot-prefilled-tokens"]) == (
            str(cached),
            str(read),
        ), (turn, h)
        assert h["x-warmslot-cache"] == verdict(cached, read)
        if turn == 2:
            assert cached > 0


def test_an_upstream_error_still_names_the_request(core: Core) -> None:
    """A prompt llama-server refuses (larger than the slot's context) was managed too:
    its error answer carries the ids and says the cache verdict is unknown."""
    too_long = body("x " * 6000)
    r = post_chat(core, too_long, headers=HEADERS, expect=400)
    assert r.headers["X-Warmslot-Cache"] == "unknown"
    assert r.headers["X-Warmslot-Request-Id"] and r.headers["X-Warmslot-Session"] == "hdr-1"
    assert "X-Warmslot-Cached-Tokens" not in r.headers
