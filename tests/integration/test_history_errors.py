"""A llama-server 500 that the request's own history causes is a 400 that says so.

Found with Codex: an answer cut at ``max_output_tokens`` inside a tool call left a
``function_call`` whose arguments stop mid-JSON, and every later request of that
conversation failed in llama-server (500 ``Failed to parse tool call arguments as
JSON``, 52 times in 41 s) while Codex told its user "high demand … Reconnecting 5/5".

On the pinned llama-server with the recorded Codex conversation (and opencode's, on
chat completions) grown by such a call: the server itself answers 500; through
Warmslot with ``proxy.repair_tool_arguments`` off the client gets a 400 in its API's
shape whose ``param`` and message name the call (streamed, as Codex asks, and not);
with it on (the default) the call is closed and the request answered, the edit named
in ``X-Warmslot-Edited``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from core.cache.manager import policy_factory
from core.engine import Core
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.helpers import REPO, post_chat

pytestmark = pytest.mark.integration

CLIENTS = REPO / "tests" / "fixtures" / "clients"
CUT = '{"cmd": "cat hel'  # an exec_command call cut at the output limit


def _recorded(client: str, step: str) -> dict[str, Any]:
    entries = json.loads((CLIENTS / client / "requests.json").read_text())
    entry = [e for e in entries if e.get("step") == step and e.get("body")][-1]
    return copy.deepcopy(entry)


def _codex_cut() -> tuple[dict[str, Any], dict[str, str], int]:
    """The recorded Codex s1-turn3 request, grown by a turn whose call was cut short:
    (body, headers, the index of the cut call in `input`)."""
    entry = _recorded("codex", "s1-turn3")
    body = entry["body"]
    body["input"] += [
        {"type": "function_call", "call_id": "call_9", "name": "exec_command", "arguments": CUT},
        {"type": "function_call_output", "call_id": "call_9",
         "output": "failed to parse function arguments: EOF while parsing a string"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Try again."}]},
    ]  # fmt: skip
    body["max_output_tokens"] = 4
    headers = {"user-agent": entry["headers"]["user-agent"]}
    return body, headers, len(body["input"]) - 3


def _opencode_cut() -> tuple[dict[str, Any], int]:
    body = _recorded("opencode", "s1-turn3")["body"]
    body["messages"] += [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c9", "type": "function",
             "function": {"name": "bash", "arguments": '{"command": "ls -l'}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "invalid arguments"},
        {"role": "user", "content": "Try again."},
    ]  # fmt: skip
    body["max_tokens"] = 4
    return body, len(body["messages"]) - 3


def _core(make_core: MakeCore, **changes: Any) -> Core:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    core = make_core(
        policy_factory=policy_factory,
        server__model=str(model),
        server__ctx_per_slot=24576,
        **changes,
    )
    core.start(wait_ready=True, timeout=180)
    return core


def test_a_tool_call_cut_in_the_history_is_a_400_naming_it(make_core: MakeCore) -> None:
    core = _core(make_core, proxy__repair_tool_arguments=False)
    assert core.proxy is not None and core.upstream.base_url is not None
    body, headers, at = _codex_cut()
    # llama-server itself: a 500, for this body and every resend of it.
    r = post_chat(
        core.upstream.base_url,
        body,
        path="/v1/responses",
        headers=core.supervisor.auth_headers(),
        expect=500,
    )
    assert "Failed to parse tool call arguments as JSON" in r.text
    # Through Warmslot: a 400 in OpenAI's shape, naming the call — as Codex asks (streamed).
    for stream in (True, False):
        body_s = {**body, "stream": stream}
        r = post_chat(core, body_s, path="/v1/responses", headers=headers, expect=400)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == f"input[{at}].arguments"
        assert (
            f"input[{at}].arguments (a call of tool 'exec_command') is not JSON" in error["message"]
        )
        assert "output limit" in error["message"]
        assert r.headers["X-Warmslot-Request-Id"]  # `warmslot explain ID` finds it
    # Chat completions (opencode's recorded conversation) the same way.
    chat, at = _opencode_cut()
    r = post_chat(core, chat, expect=400)
    assert r.json()["error"]["param"] == f"messages[{at}].tool_calls[0].function.arguments"
    # A history call llama-server cannot read at all (no "type"): its 500, our 400.
    untyped = copy.deepcopy(chat)
    del untyped["messages"][at]["tool_calls"][0]["type"]
    r = post_chat(core, untyped, expect=400)
    assert "cannot read a message of this conversation: Missing tool call type" in r.text
    # Repair on: the call is closed, the conversation goes on.
    core.update_settings({"proxy.repair_tool_arguments": True}, persist=False).result(30)
    for path, b in (("/v1/responses", body), ("/v1/chat/completions", chat)):
        r = post_chat(core, b, path=path, headers=headers)
        assert "tool-arguments" in r.headers["X-Warmslot-Edited"]
