"""Requests that hit their slot's context are named (core.proxy.context_limit): never silent."""

from __future__ import annotations

import json

from core.proxy.context_limit import ContextHit, ContextLimits, note, warning_for

REFUSED = json.dumps(
    {
        "error": {
            "code": 400,
            "message": "request (9000 tokens) exceeds the available context size (8192 tokens), "
            "try increasing it",
            "type": "exceed_context_size_error",
        }
    }
).encode()


def _answer(finish: str, predicted: int, prompt: int = 8000, cached: int = 100) -> bytes:
    return json.dumps(
        {
            "choices": [{"finish_reason": finish, "message": {"content": "x"}}],
            "timings": {"prompt_n": prompt, "cache_n": cached, "predicted_n": predicted},
        }
    ).encode()


def test_refused_prompt_is_named_with_its_numbers() -> None:
    hit = warning_for(400, REFUSED, {})
    assert hit == ContextHit(9000, 8192, True)
    headers: dict[str, str] = {}
    note(headers, hit)
    assert headers["X-Warmslot-Context"] == "9000/8192"
    assert headers["X-Warmslot-Warning"].startswith(
        "prompt of 9000 tokens exceeds the slot's context (8192 tokens): llama-server refused it"
    )
    assert len(headers["X-Warmslot-Warning"]) <= 200 and headers["X-Warmslot-Warning"].isascii()
    assert warning_for(400, b'{"error": {"message": "bad request"}}', {}) is None


def test_answer_cut_by_the_context_but_not_by_max_tokens() -> None:
    assert warning_for(200, _answer("length", 91), {}) == ContextHit(8191, 0, False)
    assert warning_for(200, _answer("length", 91), {"max_tokens": 200}) == ContextHit(
        8191, 0, False
    )
    assert warning_for(200, _answer("length", 91), {"max_tokens": 91}) is None  # its own limit
    assert warning_for(200, _answer("stop", 91), {}) is None
    native = json.dumps({"content": "x", "truncated": True, "timings": {"prompt_n": 5}}).encode()
    assert warning_for(200, native, {}) is not None


def test_streams_are_checked_against_the_slot_context() -> None:
    limits = ContextLimits(n_ctx_slot=8192)
    assert limits.check({}, 8191, 91, {}) == ContextHit(8191, 8192, False)
    assert limits.check({}, 8100, 91, {}) is None
    assert limits.check({}, 8191, 91, {"max_tokens": 91}) is None
    # What the proxy found in a whole response wins, with the server's n_ctx filled in.
    headers = {"X-Warmslot-Context": "8191/0", "X-Warmslot-Warning": "answer cut short …"}
    assert limits.check(headers, None, None, {}) == ContextHit(8191, 8192, False)
    hit = ContextHit(9000, 8192, True)
    limits.record(hit, client="opencode", session="s1", request_id="r1")
    st = limits.status()
    assert st["total"] == 1 and st["recent"][0]["text"] == hit.text and st["n_ctx_slot"] == 8192
