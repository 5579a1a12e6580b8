"""History tool calls whose arguments are not JSON (core.proxy.tool_arguments), and the 400
the proxy answers for llama-server's 500 about them (core.proxy.errors.history_error).

The real-server side — the pinned llama-server's 500 for such a body, the 400 through
Warmslot, the repair — is tests/integration/test_history_errors.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.proxy import tool_arguments
from core.proxy.errors import history_error
from core.proxy.tool_arguments import close_json

# llama-server b11434's message for a history call cut inside a string (common/chat.cpp)
UPSTREAM = (
    "Failed to parse tool call arguments as JSON: [json.exception.parse_error.101] parse "
    "error at line 1, column 23: syntax error while parsing value - invalid string: missing "
    "closing quote; last read: '\"-l'"
)


@pytest.mark.parametrize(
    ("cut", "closed"),
    [
        ('{"command": ["ls", "-l', '{"command": ["ls", "-l"]}'),  # inside a string in a list
        (
            '{"path": "a.py", "content": "def f():\\n  ret',
            '{"path": "a.py", "content": "def f():\\n  ret"}',
        ),
        ('{"a": {"b": [1, 2', '{"a": {"b": [1, 2]}}'),
        ('{"a": 12', '{"a": 12}'),
        ('{"a": 1, "b', '{"a": 1}'),  # a key cut short: dropped with its comma
        ('{"a": 1, "b": ', '{"a": 1}'),
        ('{"a": tr', "{}"),  # a partial word
        ('{"s": "x\\', '{"s": "x"}'),  # an escape cut short
        ('{"s": "x\\u12', '{"s": "x"}'),
        ('{"s": "x\\\\', '{"s": "x\\\\"}'),  # a whole escaped backslash stays
        ("", "{}"),  # a call cut before its first character
        ("not json at all", "{}"),
    ],
)
def test_close_json_makes_a_cut_value_whole(cut: str, closed: str) -> None:
    assert close_json(cut) == closed
    json.loads(closed)


def test_close_json_is_bounded_on_a_long_cut_argument() -> None:
    # A file write cut after 200 kB: one parse for the closed string, not one per character.
    cut = json.dumps({"path": "big.txt", "content": "x" * 200_000})[:-10]
    closed = json.loads(close_json(cut))
    assert closed["path"] == "big.txt" and len(closed["content"]) > 199_000


def _chat() -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "list the files"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c0", "type": "function",
                 "function": {"name": "bash", "arguments": '{"command": "pwd"}'}},
                {"id": "c1", "type": "function",
                 "function": {"name": "bash", "arguments": '{"command": ["ls", "-l'}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "error"},
            {"role": "user", "content": "again"},
        ]
    }  # fmt: skip


def _responses() -> dict[str, Any]:
    return {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
            {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "error"},
            {"type": "function_call", "call_id": "c2", "name": "exec_command",
             "arguments": '{"cmd": "cat hel'},
        ]
    }  # fmt: skip


def test_find_names_each_call_in_the_clients_own_body() -> None:
    bad = tool_arguments.find("chat", _chat())
    assert [(b.where, b.index, b.name) for b in bad] == [
        ("messages[1].tool_calls[1].function.arguments", 1, "bash")
    ]
    bad = tool_arguments.find("responses", _responses())
    assert [(b.where, b.index) for b in bad] == [
        ("input[1].arguments", 1),
        ("input[3].arguments", 3),
    ]
    assert tool_arguments.find("messages", {"messages": []}) == []  # input is an object there
    # NaN is Python's, not JSON: llama-server refuses it.
    nan = {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"x": NaN}'}}]}]}  # fmt: skip
    assert len(tool_arguments.find("chat", nan)) == 1


def test_repair_closes_only_what_is_not_json() -> None:
    body = _chat()
    repaired = tool_arguments.repair("chat", body)
    assert [r.where for r in repaired] == ["messages[1].tool_calls[1].function.arguments"]
    calls = body["messages"][1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == '{"command": "pwd"}'  # untouched
    assert json.loads(calls[1]["function"]["arguments"]) == {"command": ["ls", "-l"]}
    assert tool_arguments.repair("chat", body) == []  # nothing left to do
    body = _responses()
    assert len(tool_arguments.repair("responses", body)) == 2
    assert body["input"][1]["arguments"] == "{}"
    assert json.loads(body["input"][3]["arguments"]) == {"cmd": "cat hel"}


def test_a_history_500_becomes_a_400_naming_the_call() -> None:
    refused = history_error("chat", 500, UPSTREAM, _chat())
    assert refused is not None and refused.status == 400
    assert refused.param == "messages[1].tool_calls[1].function.arguments"
    assert "messages[1].tool_calls[1].function.arguments (a call of tool 'bash')" in str(refused)
    assert "output limit" in str(refused) and "proxy.repair_tool_arguments" in str(refused)
    refused = history_error("responses", 500, UPSTREAM, _responses())
    assert refused is not None and refused.param == "input[1].arguments"
    # A message llama-server cannot read: its own words.
    missing = 'Failed to parse messages: Missing tool call type: {"id":"c1"}'
    refused = history_error("responses", 500, missing, _responses())
    assert refused is not None and refused.param == "input"
    assert "cannot read a message of this conversation: Missing tool call type" in str(refused)
    # Anything else stays llama-server's answer.
    assert history_error("chat", 500, "slot unavailable", _chat()) is None
    assert history_error("chat", 400, UPSTREAM, _chat()) is None
