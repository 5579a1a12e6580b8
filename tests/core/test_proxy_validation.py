"""The proxy's pure parts: validation, client and session names, the SSE scanner."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from core.config.checks import is_loopback
from core.proxy.app import SSEScanner, error_response, timings_from_json
from core.proxy.checks import (
    MAX_DEPTH,
    Invalid,
    host_name,
    is_json_type,
    origin_allowed,
    parse_json,
    validate,
)
from core.routing.router import client_name, session_key

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def invalid(endpoint: str, body: Any, n_slots: int = 2) -> Invalid:
    with pytest.raises(Invalid) as e:
        validate(endpoint, body, n_slots)
    assert e.value.status == 400
    return e.value


# ------------------------------------------------------------------ validate
@pytest.mark.parametrize("body", [[], "text", 3, None, True])
def test_body_must_be_an_object(body: Any) -> None:
    assert "JSON object" in str(invalid("chat", body))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages"),
        ({**CHAT, "tools": {"type": "function"}}, "tools"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stream": 1}, "stream"),
        ({**CHAT, "max_tokens": "10"}, "max_tokens"),
        ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "n_predict": [1]}, "n_predict"),
        ({**CHAT, "max_completion_tokens": "x"}, "max_completion_tokens"),
    ],
)
def test_chat_wrong_shapes_and_types(body: dict[str, Any], param: str) -> None:
    assert invalid("chat", body).param == param


def test_message_index_named() -> None:
    err = invalid("chat", {"messages": [{"role": "user", "content": "x"}, {"content": "x"}]})
    assert "messages[1]" in str(err)


@pytest.mark.parametrize("endpoint", ["completions", "completion"])
@pytest.mark.parametrize("prompt", [None, 3, {"a": 1}])
def test_completion_prompt_type(endpoint: str, prompt: Any) -> None:
    body = {} if prompt is None else {"prompt": prompt}
    assert invalid(endpoint, body).param == "prompt"


def test_embeddings_input_type() -> None:
    assert invalid("embeddings", {"input": 5}).param == "input"
    assert invalid("embeddings", {}).param == "input"
    validate("embeddings", {"input": ["a", "b"]}, 2)
    validate("embeddings", {"content": "a"}, 2)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("chat", CHAT),
        ("chat", {**CHAT, "tools": [], "stream": True, "max_tokens": None}),
        ("chat", {**CHAT, "max_tokens": 1, "n_predict": -1}),
        ("completions", {"prompt": "x"}),
        ("completion", {"prompt": [1, 2, "x"]}),
        ("tokenize", {"content": "anything"}),
        ("apply-template", CHAT),
    ],
)
def test_valid_bodies_pass(endpoint: str, body: dict[str, Any]) -> None:
    validate(endpoint, body, 2)


@pytest.mark.parametrize("slot", [-1, 0, 1])
def test_id_slot_in_range(slot: int) -> None:
    validate("chat", {**CHAT, "id_slot": slot}, 2)


@pytest.mark.parametrize(("slot", "n_slots"), [(-2, 2), (2, 2), (7, 2), (1, 1), (-100, 4), (4, 4)])
def test_id_slot_out_of_range(slot: int, n_slots: int) -> None:
    """llama-server would wrap these modulo n_slots; the proxy refuses.

    See docs/llama-server-facts.md#slot-ids-wrap.
    """
    err = invalid("completion", {"prompt": "x", "id_slot": slot}, n_slots)
    assert err.param == "id_slot"
    assert f"0..{n_slots - 1}" in str(err) and f"got {slot}" in str(err)


@pytest.mark.parametrize("slot", ["0", 1.0, True, None, [0]])
def test_id_slot_must_be_an_integer(slot: Any) -> None:
    assert invalid("chat", {**CHAT, "id_slot": slot}).param == "id_slot"


def test_error_response_is_openai_format() -> None:
    resp = error_response(413, "too big", param="body", headers={"Retry-After": "1"})
    assert resp.status == 413
    assert resp.headers["Retry-After"] == "1"
    assert resp.text is not None
    assert json.loads(resp.text) == {
        "error": {
            "message": "too big",
            "type": "invalid_request_error",
            "param": "body",
            "code": 413,
        }
    }


# ------------------------------------------------------------------ names
@pytest.mark.parametrize(
    ("ua", "name"),
    [
        ("opencode/1.18.0 ai-sdk/provider-utils/3.0 runtime/bun/1.2", "opencode"),
        ("OpenAI/Python 1.99.0", "openai"),
        ("curl/8.5.0", "curl"),
        ("python-httpx/0.28.1", "python-httpx"),
        ("", "unknown"),
        ("   ", "unknown"),
        ("x" * 100 + "/1", "x" * 64),
    ],
)
def test_client_name(ua: str, name: str) -> None:
    assert client_name(ua) == name


def test_session_key_header_order_and_trimming() -> None:
    assert session_key({}) == ""
    assert session_key({"x-session-affinity": " aff "}) == "aff"
    # x-session-id wins over later headers.
    assert session_key({"x-session-affinity": "b", "x-session-id": "a"}) == "a"
    assert session_key({"x-session-id": "", "x-conversation-id": "c"}) == "c"
    assert session_key({"x-session-id": "s" * 500}) == "s" * 200


# ------------------------------------------------------------------ SSE scanner
def chat_stream() -> bytes:
    """A streamed chat response as llama-server sends it (timings in the usage chunk)."""
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"index": 0, "delta": {"content": " hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": 'lo: "data: {\\"timings\\""'}}]},
        {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 40, "completion_tokens": 3},
            "timings": {"cache_n": 33, "prompt_n": 7, "prompt_ms": 1.5, "predicted_n": 3},
        },
    ]
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + b"data: [DONE]\n\n"


def completion_stream() -> bytes:
    parts = [
        {"content": "a", "id_slot": -1, "stop": False},
        {"content": "b", "id_slot": -1, "stop": False},
        {
            "content": "",
            "id_slot": 1,
            "stop": True,
            "tokens_cached": 12,
            "timings": {"cache_n": 10, "prompt_n": 2, "prompt_ms": 0.5, "predicted_n": 2},
        },
    ]
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in parts)


def feed_in(body: bytes, cuts: list[int]) -> SSEScanner:
    scanner = SSEScanner()
    last = 0
    for cut in [*sorted(cuts), len(body)]:
        scanner.feed(body[last:cut])
        last = cut
    return scanner


@pytest.mark.parametrize("seed", range(25))
def test_scanner_finds_timings_whatever_the_chunking(seed: int) -> None:
    body = chat_stream()
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(body)), k=rng.randint(1, min(60, len(body) - 1)))
    scanner = feed_in(body, cuts)
    assert scanner.timings == {"cache_n": 33, "prompt_n": 7, "prompt_ms": 1.5, "predicted_n": 3}
    assert scanner.id_slot is None and scanner.upstream_error is None


def test_scanner_one_byte_at_a_time_and_whole() -> None:
    body = completion_stream()
    for scanner in (feed_in(body, list(range(1, len(body)))), feed_in(body, [])):
        assert scanner.timings is not None and scanner.timings["cache_n"] == 10
        assert scanner.id_slot == 1  # earlier chunks' id_slot -1 is ignored


def test_scanner_crlf_lines() -> None:
    body = chat_stream().replace(b"\n", b"\r\n")
    scanner = feed_in(body, [17, 100, 101, 300])
    assert scanner.timings is not None and scanner.timings["prompt_n"] == 7


def test_scanner_upstream_error_event_and_garbage() -> None:
    err = {"error": {"message": "context exceeded", "type": "exceed_context_size_error"}}
    body = b'data: {"timings": not json}\n\ndata: ' + json.dumps(err).encode() + b"\n\n"
    scanner = feed_in(body, [5, 30])
    assert scanner.upstream_error == "context exceeded"
    assert scanner.timings is None


def test_scanner_ignores_an_unfinished_last_line() -> None:
    body = completion_stream()
    scanner = feed_in(body.rstrip(b"\n"), [40])  # the final line never ends
    assert scanner.timings is None


def test_timings_from_json() -> None:
    data = json.dumps({"id_slot": 1, "timings": {"cache_n": 3, "prompt_n": 1}}).encode()
    assert timings_from_json(data) == ({"cache_n": 3, "prompt_n": 1}, 1)
    assert timings_from_json(b"[1]") == (None, None)
    assert timings_from_json(b"not json") == (None, None)
    assert timings_from_json(b'{"id_slot": -1, "timings": 5}') == (None, None)


# ------------------------------------------------------------------ strict JSON
def bad_json(raw: bytes) -> str:
    with pytest.raises(Invalid) as e:
        parse_json(raw)
    assert e.value.status == 400
    return str(e.value)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    raw = b'{"messages": [{"role": "user", "content": "x"}], "temperature": %s}' % (
        constant.encode()
    )
    assert constant in bad_json(raw)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 995, 5000, 100_000])
def test_deep_nesting_is_a_400_not_a_recursion_error(depth: int) -> None:
    raw = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    assert "nested deeper" in bad_json(raw)


def test_escaped_surrogate_pairs_are_text() -> None:
    """ASCII-only encoders (Python's json.dumps) escape emoji as surrogate pairs."""
    raw = json.dumps({"messages": [{"role": "user", "content": "\U0001f600 caf\u00e9"}]})
    assert "\\ud83d\\ude00" in raw
    assert parse_json(raw.encode())["messages"][0]["content"] == "\U0001f600 caf\u00e9"
    assert parse_json(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash


def test_nesting_up_to_the_limit_parses() -> None:
    depth = MAX_DEPTH - 1  # the body object is one level
    raw = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    assert isinstance(parse_json(raw), dict)
    # Many brackets side by side are not depth.
    wide = b'{"x": [' + b",".join([b"[]"] * 5000) + b"]}"
    assert len(parse_json(wide)["x"]) == 5000


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"\xff\xfe{}",
        b'{"a": 1,}',
        b"{'a': 1}",
        b'{"a": "\\x"}',
        b'{"a": "\\ud800"}',  # half a surrogate pair: not text
        b'{"\\udcff": 1}',
        b'{"a": ["x", {"b": "\\ude00\\ud83d"}]}',  # low half first: no pair
    ],
)
def test_malformed_json(raw: bytes) -> None:
    assert bad_json(raw).startswith("malformed JSON")


# ------------------------------------------------------------------ shapes
def msg(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content, **extra}]}


TOOL = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "body",
    [
        msg(5),
        msg({"type": "text", "text": "x"}),
        msg([{"type": "text"}]),
        msg([{"type": "text", "text": 5}]),
        msg(["just a string"]),
        msg([{"text": "no type"}]),
        msg([{"type": 3, "text": "x"}]),
        msg([{"type": "media_marker", "text": "<__media__>"}]),
        msg([{"type": "refusal", "refusal": "no"}]),
        msg([{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]),
        msg([{"type": "image_url", "image_url": {"detail": "low"}}]),
        msg([{"type": "input_audio", "input_audio": {"data": 5}}]),
        {"messages": [{"role": "assistant"}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": ["x"]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {}}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
    ],
)
def test_malformed_messages(body: dict[str, Any]) -> None:
    assert invalid("chat", body).param == "messages"


@pytest.mark.parametrize(
    "tools",
    [
        [TOOL, "read"],
        [{"function": {"name": "read"}}],
        [{"type": "retrieval", "function": {"name": "read"}}],
        [{"type": "function"}],
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": 5}}],
        [{"type": "function", "function": {"name": "f", "parameters": "object"}}],
        [{"type": "function", "function": {"name": "f", "description": ["x"]}}],
    ],
)
def test_malformed_tools(tools: list[Any]) -> None:
    assert invalid("chat", {**msg(), "tools": tools}).param == "tools"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", 5),
        ("model", ["a"]),
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", [1]),
        ("top_k", "40"),
        ("logprobs", "yes"),
        ("seed", "1"),
        ("stop", 5),
        ("stop", ["a", 1]),
        ("stream_options", True),
        ("response_format", "json"),
        ("tool_choice", 1),
        ("cache_prompt", "yes"),
        ("n", "2"),
    ],
)
def test_common_fields_of_the_wrong_type(field: str, value: Any) -> None:
    assert invalid("chat", {**msg(), field: value}).param == field


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("tokenize", {"content": 5}, "content"),
        ("tokenize", {}, "content"),
        ("detokenize", {"tokens": "1 2"}, "tokens"),
        ("detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("detokenize", {"tokens": [1, -2]}, "tokens"),
        ("apply-template", {"messages": "hi"}, "messages"),
        ("completion", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ],
)
def test_other_endpoints_shapes(endpoint: str, body: dict[str, Any], param: str) -> None:
    assert invalid(endpoint, body).param == param


@pytest.mark.parametrize(
    "body",
    [
        msg([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
        msg([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        msg([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]),
        msg(None, tool_calls=[]),
        {
            "messages": [
                {"role": "user", "content": "read it"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "read", "arguments": "{}"},
                        },
                        {"function": {"name": "read", "arguments": {"path": "x"}}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "text"},
            ],
            "tools": [TOOL, {"type": "function", "function": {"name": "bare"}}],
            "tool_choice": "auto",
            "temperature": 0,
            "top_p": 0.9,
            "seed": 1,
            "stop": ["\n"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "model": "any",
            "response_format": {"type": "json_object"},
        },
        {**msg(), "temperature": None, "stop": None, "tools": None},
        {**msg(), "top_k": 40.0, "logprobs": True, "top_logprobs": 2},
    ],
)
def test_real_shapes_pass(body: dict[str, Any]) -> None:
    validate("chat", body, 2)


# ------------------------------------------------------------------ who may call
@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("192.168.1.5", False),
        ("attacker.example", False),
        ("localhost.attacker.example", False),
        ("127.0.0.1.nip.io", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8089", "127.0.0.1"),
        ("LOCALHOST:1", "localhost"),
        ("[::1]:8089", "::1"),
        ("[::1]", "::1"),
        ("attacker.example", "attacker.example"),
        ("attacker.example:80", "attacker.example"),
    ],
)
def testhost_name(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    ("origin", "allowed", "ok"),
    [
        ("http://127.0.0.1:3000", (), True),
        ("http://localhost", (), True),
        ("https://[::1]:8443", (), True),
        ("http://evil.example", (), False),
        ("null", (), False),
        ("file://", (), False),
        ("http://127.0.0.1.evil.example", (), False),
        ("ftp://127.0.0.1", (), False),
        ("http://evil.example", ("http://evil.example",), True),
        ("http://Evil.example/", ("http://evil.example",), True),
        ("http://evil.example:81", ("http://evil.example",), False),
    ],
)
def testorigin_allowed(origin: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert origin_allowed(origin, allowed) is ok


@pytest.mark.parametrize(
    ("ctype", "ok"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/vnd.api+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        ("text/json", False),
        ("", False),
    ],
)
def test_json_content_types(ctype: str, ok: bool) -> None:
    assert is_json_type(ctype) is ok


def test_legacy_completions_logprobs_is_a_count() -> None:
    validate("completions", {"prompt": "x", "logprobs": 3}, 2)


# ------------------------------------------------------------ output limits, token ids
@pytest.mark.parametrize(
    ("endpoint", "key"),
    [
        ("chat", "max_tokens"),
        ("chat", "max_completion_tokens"),
        ("chat", "n_predict"),
        ("completions", "max_tokens"),
        ("responses", "max_output_tokens"),
        ("messages", "max_tokens"),
    ],
)
def test_an_output_limit_of_0_is_refused(endpoint: str, key: str) -> None:
    body: dict[str, Any] = {
        "chat": CHAT,
        "completions": {"prompt": "x"},
        "responses": {"input": "x"},
        "messages": {"messages": [{"role": "user", "content": "x"}]},
    }[endpoint]
    err = invalid(endpoint, {**body, key: 0})
    assert err.param == key and "at least 1" in str(err)
    validate(endpoint, {**body, key: 1}, 2)
    validate(endpoint, {**body, key: -1}, 2)  # llama.cpp's "no limit"


def test_llama_cpp_completion_keeps_n_predict_0() -> None:
    validate("completion", {"prompt": "x", "n_predict": 0}, 2)


def test_token_ids_outside_the_vocabulary() -> None:
    from core.proxy.checks import check_token_ids, token_ids

    assert token_ids("tokenize", {"content": [5, "x", 7]}) == [5, 7]
    assert token_ids("chat", {"tokens": [1]}) == []
    check_token_ids("detokenize", {"tokens": [0, 1769]}, 1770)
    with pytest.raises(Invalid) as e:
        check_token_ids("detokenize", {"tokens": [0, 1770]}, 1770)
    assert e.value.param == "tokens" and "0..1769" in str(e.value)
    with pytest.raises(Invalid) as e:
        check_token_ids("tokenize", {"content": [999_999, "x"]}, 1770)
    assert e.value.param == "content"


@pytest.mark.parametrize("endpoint", ["chat", "messages"])
def test_a_quarantined_body_is_refused_in_its_apis_shape(endpoint: str) -> None:
    from core.proxy.checks import crashed_before
    from core.proxy.errors import invalid_response
    from core.server.quarantine import Quarantined

    hit = Quarantined("ab" * 32, "signal SIGSEGV", at=100.0, until=700.0)
    resp = invalid_response(endpoint, crashed_before(hit, now=130.0))
    assert resp.status == 422
    assert resp.text is not None
    data = json.loads(resp.text)
    err = data["error"]
    assert "crashed llama-server (signal SIGSEGV) 30 s ago" in err["message"]
    assert "another 10 min" in err["message"]
    if endpoint == "messages":
        assert data["type"] == "error" and err["type"] == "invalid_request_error"
    else:
        assert err["code"] == 422
