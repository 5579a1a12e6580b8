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
import urllib.error
import urllib.request
from typing import Any

import pytest

from core.cache.manager import policy_factory
from core.engine import Core
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.helpers import REPO

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


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


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
    proxy = f"http://127.0.0.1:{core.proxy.port}"
    body, headers, at = _codex_cut()
    # llama-server itself: a 500, for this body and every resend of it.
    status, _, data = _post(
        core.upstream.base_url + "/v1/responses", body, core.supervisor.auth_headers()
    )
    assert status == 500 and "Failed to parse tool call arguments as JSON" in data.decode()
    # Through Warmslot: a 400 in OpenAI's shape, naming the call — as Codex asks (streamed).
    for stream in (True, False):
        status, got, data = _post(proxy + "/v1/responses", {**body, "stream": stream}, headers)
        assert status == 400, data[:300]
        error = json.loads(data)["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == f"input[{at}].arguments"
        assert (
            f"input[{at}].arguments (a call of tool 'exec_command') is not JSON" in error["message"]
        )
        assert "output limit" in error["message"]
        assert got["X-Warmslot-Request-Id"]  # `warmslot explain ID` finds it
    # Chat completions (opencode's recorded conversation) the same way.
    chat, at = _opencode_cut()
    status, _, data = _post(proxy + "/v1/chat/completions", chat)
    assert status == 400, data[:300]
    assert json.loads(data)["error"]["param"] == f"messages[{at}].tool_calls[0].function.arguments"
    # A history call llama-server cannot read at all (no "type"): its 500, our 400.
    untyped = copy.deepcopy(chat)
    del untyped["messages"][at]["tool_calls"][0]["type"]
    status, _, data = _post(proxy + "/v1/chat/completions", untyped)
    assert status == 400, data[:300]
    assert "cannot read a message of this conversation: Missing tool call type" in data.decode()
    # Repair on: the call is closed, the conversation goes on.
    core.update_settings({"proxy.repair_tool_arguments": True}, persist=False).result(30)
    for path, b in (("/v1/responses", body), ("/v1/chat/completions", chat)):
        status, got, data = _post(proxy + path, b, headers)
        assert status == 200, data[:300]
        assert "tool-arguments" in got["X-Warmslot-Edited"]
