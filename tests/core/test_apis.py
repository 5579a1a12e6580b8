"""The wire APIs (core/chat.py): each route's kind, the chat view of an Anthropic
Messages or OpenAI Responses body (what llama-server renders for it), and reuse
numbers from `usage`. That the chat view renders token for token as llama-server's own
conversion is proven against the real server in tests/integration/test_api_routes.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core import chat as apis
from core.proxy import billing
from core.proxy.app import SSEScanner
from core.proxy.checks import Invalid, validate
from core.routing.router import Kind, Router, metadata_session

READ_TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def test_routes_name_every_api_and_only_generation_is_managed() -> None:
    assert apis.ROUTES["/v1/messages"] == ("messages", True)
    assert apis.ROUTES["/v1/responses"] == ("responses", True)
    assert apis.ROUTES["/v1/messages/count_tokens"] == ("messages-count", False)
    assert apis.ROUTES["/v1/responses/input_tokens"] == ("responses-count", False)
    assert apis.chat_view("messages-count", {"messages": []}) is None
    assert apis.chat_view("completion", {"prompt": "x"}) is None


def test_chat_body_view_is_the_fields_that_render() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    view = apis.chat_view("chat", {**body, "tools": [], "reasoning_effort": "low"})
    assert view is not None and view.api == "chat"
    assert view.body == {"messages": body["messages"], "tools": [], "reasoning_effort": "low"}


def test_anthropic_system_blocks_tools_and_content_blocks() -> None:
    body = {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc=1; cch=a5145; You are CC."},
            {"type": "text", "text": "\nBe brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [READ_TOOL, {"name": "noschema"}],
        "tool_choice": {"type": "any"},
        "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": "read it"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"p": "ö"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"type": "tool_result", "tool_use_id": "t2"},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "QQ=="},
                    }
                ],
            },
        ],
    }
    view = apis.chat_view("messages", body)
    assert view is not None and view.user_id == "u"
    m = view.messages
    # The billing stamp changes every request; llama-server overwrites it (so must we).
    assert m[0] == {
        "role": "system",
        "content": "x-anthropic-billing-header: cc=1; cch=fffff; You are CC.\nBe brief.",
    }
    assert m[1] == {"role": "user", "content": "read it"}
    assert m[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "t1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"p":"ö"}'},
            }
        ],
        "reasoning_content": "hm",
    }
    # A user turn of tool results only becomes tool messages, text joined.
    assert m[3] == {"role": "tool", "tool_call_id": "t1", "content": "ab"}
    assert m[4] == {"role": "tool", "tool_call_id": "t2", "content": ""}
    assert m[5]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QQ=="}}
    ]
    assert view.tools == [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": READ_TOOL["input_schema"],
            },
        },
        {"type": "function", "function": {"name": "noschema", "description": "", "parameters": {}}},
    ]
    assert view.body["tool_choice"] == "required"
    with pytest.raises(apis.ConversionError):
        apis.chat_view("messages", {"system": "x"})


def test_billing_header_is_taken_out_of_the_system_text_exactly() -> None:
    # A string system text: the line's fields go, the text running on after them stays
    # (upstream llama.cpp PR 21793's example shape).
    body: dict[str, Any] = {
        "system": "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
        "cch=a5145;You are Claude Code, Anthropic's official CLI for Claude.",
        "messages": [{"role": "user", "content": "hi"}],
    }
    removed = billing.strip_billing_header(body)
    assert removed == [
        "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
    ]
    assert body == {
        "system": "You are Claude Code, Anthropic's official CLI for Claude.",
        "messages": [{"role": "user", "content": "hi"}],
    }
    # Blocks: a block that was only the line is dropped, one with a line end and more
    # text keeps the text; other blocks, cache_control and all, are left as they were.
    keep = {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
    body = {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.6c5;"},
            {"type": "text", "text": "x-anthropic-billing-header: cch=00000;\nYou are CC."},
            keep,
        ],
        "messages": [],
    }
    assert len(billing.strip_billing_header(body)) == 2
    assert body["system"] == [{"type": "text", "text": "You are CC."}, keep]
    # Only a system text that starts with the line: the same words elsewhere, in a
    # message, or in a system text that merely mentions them are the client's text.
    for system in (
        "Be brief. x-anthropic-billing-header: cc_version=1;",
        [{"type": "text", "text": " x-anthropic-billing-header: cc_version=1;"}],
        [{"type": "image", "text": "x-anthropic-billing-header: cc_version=1;"}],
        None,
    ):
        body = {"messages": [{"role": "user", "content": "x-anthropic-billing-header: a=1;"}]}
        if system is not None:
            body["system"] = system
        before = json.dumps(body)
        assert billing.strip_billing_header(body) == []
        assert json.dumps(body) == before
    # With the line gone the chat view's system text is what follows it.
    body = {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=9;"},
            {"type": "text", "text": "You are CC."},
        ],
        "messages": [],
    }
    billing.strip_billing_header(body)
    view = apis.chat_view("messages", body)
    assert view is not None and view.messages[0] == {"role": "system", "content": "You are CC."}


def test_responses_items_merge_into_assistant_turns_as_the_server_does() -> None:
    body = {
        "instructions": "You are Codex.",
        "reasoning": {"effort": "low"},
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            {"type": "web_search"},  # no chat equivalent: skipped, as llama-server does
        ],
        "input": [
            {"type": "message", "role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_text", "text": "ls"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "r"}],
            },
            {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
        ],
    }
    view = apis.chat_view("responses", body)
    assert view is not None
    m = view.messages
    assert m[0] == {"role": "system", "content": "You are Codex."}
    assert m[1] == {"role": "developer", "content": [{"text": "rules", "type": "text"}]}
    assert m[2] == {"role": "user", "content": [{"text": "ls", "type": "text"}]}
    call = {"function": {"arguments": "{}", "name": "shell"}, "id": "c1", "type": "function"}
    assert m[3] == {
        "role": "assistant",
        "content": [],
        "reasoning_content": "r",
        "tool_calls": [call],
    }
    assert m[4] == {"content": "a.txt", "role": "tool", "tool_call_id": "c1"}
    assert m[5] == {"role": "assistant", "content": [{"text": "ok", "type": "text"}]}
    assert view.tools == [
        {
            "type": "function",
            "function": {"name": "shell", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert view.body["reasoning_effort"] == "low"
    assert apis.chat_view("responses", {"input": "hi"}).messages == [  # type: ignore[union-attr]
        {"role": "user", "content": "hi"}
    ]
    for bad in (
        {"instructions": "x"},
        {"input": 3},
        {"input": [{"type": "mystery"}]},
        {"input": "x", "previous_response_id": "r1"},
    ):
        with pytest.raises(apis.ConversionError):
            apis.chat_view("responses", bad)


def test_usage_gives_reuse_numbers_for_each_api() -> None:
    anthropic = {"usage": {"cache_read_input_tokens": 700, "input_tokens": 63, "output_tokens": 8}}
    assert apis.usage_timings(anthropic) == {
        "prompt_n": 63,
        "cache_n": 700,
        "predicted_n": 8,
        "source": "usage",
    }
    start = {"type": "message_start", "message": {**anthropic}}
    assert apis.usage_timings(start)["cache_n"] == 700  # type: ignore[index]
    responses = {
        "object": "response",
        "usage": {
            "input_tokens": 575,
            "output_tokens": 2,
            "input_tokens_details": {"cached_tokens": 500},
        },
    }
    assert apis.usage_timings(responses) == {
        "prompt_n": 75,
        "cache_n": 500,
        "predicted_n": 2,
        "source": "usage",
    }
    done = {"type": "response.completed", "response": responses}
    assert apis.usage_timings(done)["prompt_n"] == 75  # type: ignore[index]
    assert apis.usage_timings({"usage": {"output_tokens": 3}}) is None
    assert apis.usage_timings({"choices": []}) is None


def _sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    out = b""
    for name, data in events:
        if name:
            out += f"event: {name}\n".encode()
        out += f"data: {json.dumps(data)}\n\n".encode()
    return out


def test_sse_scanner_finds_reuse_in_anthropic_and_responses_streams() -> None:
    anthropic = _sse(
        [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "usage": {
                            "cache_read_input_tokens": 90,
                            "input_tokens": 10,
                            "output_tokens": 0,
                        }
                    },
                },
            ),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"text": '"usage"'}}),
            ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 7}}),
            ("message_stop", {"type": "message_stop"}),
        ]
    )
    scanner = SSEScanner()
    for i in range(0, len(anthropic), 7):  # events split across chunks anywhere
        scanner.feed(anthropic[i : i + 7])
    assert scanner.timings == {"prompt_n": 10, "cache_n": 90, "predicted_n": 7, "source": "usage"}
    # With patch 0004 the message_delta carries `timings`: those win.
    timings = {"prompt_n": 10, "cache_n": 90, "prompt_ms": 3.0, "predicted_n": 7}
    patched = anthropic.replace(
        b'"output_tokens": 7}', b'"output_tokens": 7}, "timings": ' + json.dumps(timings).encode()
    )
    scanner = SSEScanner()
    scanner.feed(patched)
    assert scanner.timings == timings
    responses = _sse(
        [
            ("response.created", {"type": "response.created"}),
            (
                "response.completed",
                {
                    "type": "response.completed",
                    "response": {
                        "usage": {
                            "input_tokens": 100,
                            "output_tokens": 4,
                            "input_tokens_details": {"cached_tokens": 96},
                        }
                    },
                },
            ),
        ]
    )
    scanner = SSEScanner()
    scanner.feed(responses)
    assert scanner.timings == {"prompt_n": 4, "cache_n": 96, "predicted_n": 4, "source": "usage"}


def test_router_reads_the_chat_view_of_every_api() -> None:
    router = Router.single(None)
    ua = {"user-agent": "claude-cli/2.0.1 (external, cli)"}
    agent = {
        "system": "You are CC.",
        "tools": [READ_TOOL],
        "max_tokens": 9,
        "messages": [{"role": "user", "content": "fix it"}],
        "metadata": {"user_id": "user_1f_account__session_0a1b2c3d-9e8f"},
    }
    d = router.decide("messages", ua, agent)
    assert not isinstance(d, type(None)) and d.kind is Kind.AGENT  # type: ignore[union-attr]
    assert d.why == "agent turn: Messages request with tools"  # type: ignore[union-attr]
    assert d.session == "session-0a1b2c3d-9e8f"  # type: ignore[union-attr]
    # A header still names the session first.
    d = router.decide("messages", {**ua, "x-session-id": "h"}, agent)
    assert d.session == "h"  # type: ignore[union-attr]
    # The same client's tool-less call is a side call, whichever API it used.
    side = {"input": "Write a short title for this conversation"}
    d = router.decide("responses", ua, side)
    assert d.kind is Kind.SIDE  # type: ignore[union-attr]
    # Not readable as chat: plain, left to the server.
    d = router.decide("responses", ua, {"input": 3})
    assert d.kind is Kind.PLAIN and "not readable" in d.why  # type: ignore[union-attr]
    d = router.decide("responses", ua, side, chat=None)
    assert d.kind is Kind.PLAIN  # type: ignore[union-attr]


def test_metadata_user_id_forms() -> None:
    assert metadata_session("user_ab_account_cd_session_1234abcd-00") == "session-1234abcd-00"
    assert metadata_session('{"device_id":"d","session_id":"s-42"}') == "session-s-42"
    assert metadata_session("someone") == "user-someone"
    assert metadata_session("") == ""


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("messages", {"messages": []}, "messages"),
        ("messages", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ("messages", {"messages": [{"role": "user", "content": 3}]}, "messages"),
        ("messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
        ("messages", {"messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
        ("messages", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
        ("messages-count", {"messages": "x"}, "messages"),
        (
            "messages",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"},
            "max_tokens",
        ),
        ("responses", {}, "input"),
        ("responses", {"input": [3]}, "input"),
        ("responses", {"input": "x", "instructions": ["a"]}, "instructions"),
        ("responses", {"input": "x", "tools": [{"type": "function"}]}, "tools"),
        ("responses-count", {"input": None}, "input"),
    ],
)
def test_new_bodies_are_validated(endpoint: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(Invalid) as e:
        validate(endpoint, body, 2)
    assert e.value.status == 400 and e.value.param == param


def test_valid_new_bodies_pass() -> None:
    validate(
        "messages",
        {
            "system": [{"type": "text", "text": "s"}],
            "tools": [READ_TOOL],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        },
        2,
    )
    validate(
        "responses", {"input": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, 2
    )


def test_a_responses_answer_stopped_by_its_own_limit_is_no_context_hit() -> None:
    from core.proxy.context_limit import ContextLimits

    limits = ContextLimits(n_ctx_slot=100)
    # The slot is full, but the answer stopped at the request's max_output_tokens.
    assert limits.check({}, 99, 4, {"max_output_tokens": 4}) is None
    assert limits.check({}, 99, 4, {"max_output_tokens": 9}) is not None


def test_the_chat_view_reads_its_keys_once_and_keeps_their_values() -> None:
    """The router and the cache read a request's system text, tools key and shape key
    from its view, computed once per request; the keys are the values the learner
    stored before they moved here (so saved prefix definitions still match)."""
    import hashlib

    tools = [{"type": "function", "function": {"name": "read", "parameters": {"b": 1, "a": 2}}}]
    body = {
        "messages": [
            {"role": "system", "content": "rules"},
            {"role": "developer", "content": [{"type": "text", "text": "more"}]},
            {"role": "user", "content": "fix it"},
        ],
        "tools": tools,
    }
    view = apis.chat_view("chat", body)
    assert view is not None
    tools_json = json.dumps(tools, sort_keys=True).encode()
    want = hashlib.sha256(b"opencode\0" + tools_json + b"\0" + b"rules\nmore").hexdigest()
    assert view.shape_key("opencode") == want
    assert view.tools_key("opencode") == hashlib.sha256(b"opencode\0" + tools_json).hexdigest()
    assert (view.system_text, view.first_user_text) == ("rules\nmore", "fix it")
    # Cached: a second read does not walk the messages again.
    body["messages"][0]["content"] = "changed"
    assert view.system_text == "rules\nmore"
    assert view.shape_key("opencode") == want
    other = apis.chat_view("chat", {**body, "messages": body["messages"][1:]})
    assert other is not None and other.head_key != view.head_key


def test_the_scanner_takes_out_the_timings_it_asked_for_but_not_the_last_results() -> None:
    """As llama-server streams a chat with timings_per_token and include_usage: timings
    in every content chunk and the usage chunk (docs/llama-server-facts.md#timings).
    What the client gets is what it would have got without timings_per_token."""
    t = {"cache_n": 5, "prompt_n": 3, "prompt_ms": 1.0}
    events = [
        {"choices": [{"finish_reason": None, "delta": {"role": "assistant"}}]},
        {"choices": [{"finish_reason": None, "delta": {"content": "a"}}], "timings": t},
        {"choices": [{"finish_reason": "length", "delta": {}}]},
        {"choices": [], "usage": {"prompt_tokens": 8}, "timings": t},
    ]
    raw = b"".join(f"data: {json.dumps(e)}\r\n\r\n".encode() for e in events) + b"data: [DONE]\n\n"
    scanner = SSEScanner(strip_timings=True)
    out = b"".join(scanner.feed(raw[i : i + 9]) for i in range(0, len(raw), 9)) + scanner.flush()
    got = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert got == [events[0], {k: v for k, v in events[1].items() if k != "timings"}, *events[2:]]
    assert out.endswith(b"data: [DONE]\n\n") and b"\r\n\r\n" in out
    assert scanner.timings == t and scanner.opening is not None and scanner.opening.cached == 5
    untouched = SSEScanner()
    assert untouched.feed(raw) == raw  # not asked to strip: every byte as it came
