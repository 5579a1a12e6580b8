"""Anthropic Messages and OpenAI Responses through Warmslot, on a real llama-server.

- The chat view (core/chat.py) is what llama-server itself renders: the server's own
  token count of the body equals the count of the chat view rendered by /apply-template,
  and the chat view sent as chat completions right after the body reuses every token
  the body left in the (single) slot.
- A multi-turn agent session plus a side call, streamed and not: the agent's stable
  prefix stays in its slot (turn 2, after the side call, reuses ≥ 95 % of it), the side
  call runs on the side slot, accounting records each request with its reuse numbers.
- /v1/messages needs patch 0004 to pin a slot (stock llama-server drops id_slot there):
  on a server without it the request is forwarded unmanaged, still accounted (from
  `usage`), and `status` says why. A conversion that fails forwards untouched.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from httpx import Headers

from core import chat as apis
from core.cache.manager import CacheManager, policy_factory
from core.engine import Core
from core.events import CacheEvent, RequestCompleted
from core.server import discover
from tests.conftest import MakeCore, test_home
from tests.helpers import EventLog, post_chat, wait_until

pytestmark = pytest.mark.integration

BILLING = "x-anthropic-billing-header: cc_version=2.0.14.a1b; cc_entrypoint=cli; "
CLAUDE_UA = "claude-cli/2.0.14 (external, cli)"
CODEX_UA = "codex_exec/0.46.0 (Debian 12; x86_64)"
SYSTEM = (
    "You are an interactive CLI tool that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user.\n"
    + "".join(f"Rule {i}: keep answers short, cite files, never guess paths. " for i in range(24))
)
TOOLS = [
    {
        "name": name,
        "description": f"{name}: " + "does its job carefully and reports what happened. " * 4,
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["path"],
        },
    }
    for name in ("Read", "Write", "Bash", "Grep")
]


def _binary_with(patched: bool) -> Path | None:
    """A llama-server in the test build cache with (or without) patch 0004."""
    for server in sorted(test_home().builds_dir.glob("*/bin/llama-server")):
        if (apis.API_PARITY_PATCH in discover.patch_levels(server)) == patched:
            return server
    return None


def _post(
    core: Core, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, Headers, bytes]:
    """Status, headers and raw body (a stream's events as sent) of any answer."""
    r = post_chat(core, body, path=path, headers=headers, timeout=300, expect=None)
    return r.status_code, r.headers, r.content


def _upstream(core: Core, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST straight to llama-server (not through the proxy)."""
    base = core.upstream.base_url
    assert base is not None
    req = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **core.supervisor.auth_headers()},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _slot_tokens(core: Core) -> dict[int, int]:
    req = urllib.request.Request(
        f"{core.upstream.base_url}/slots", headers=core.supervisor.auth_headers()
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return {int(s["id"]): int(s.get("n_prompt_tokens", 0)) for s in json.loads(resp.read())}


def _messages(turn: int, session: str) -> dict[str, Any]:
    """Claude Code's turn `turn` (1-based) of a session: system, tools, growing history."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Find the bug in parser.py"}]
    for i in range(1, turn):
        msgs += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Looking at step {i}."},
                    {"type": "tool_use", "id": f"t{i}", "name": "Read", "input": {"path": "p.py"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"line {i}"}
                ],
            },
        ]
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 4,
        "temperature": 0,
        "system": [
            # Claude Code's billing line: its cch stamp changes on every request, and
            # llama-server blanks it out so the prefix survives (so must the chat view).
            {"type": "text", "text": f"{BILLING}cch={turn:05d};"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": TOOLS,
        "messages": msgs,
        "metadata": {"user_id": f"user_ab12_account__session_{session}"},
    }


def _responses(turn: int) -> dict[str, Any]:
    """Codex CLI's turn `turn` of a session: instructions, function tools, input items."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]}
    ]
    for i in range(1, turn):
        items += [
            {
                "type": "function_call",
                "name": "shell",
                "arguments": '{"cmd":["ls"]}',
                "call_id": f"c{i}",
            },
            {"type": "function_call_output", "call_id": f"c{i}", "output": f"file{i}.py"},
        ]
    tools = [
        {
            "type": "function",
            "name": t["name"].lower(),
            "description": t["description"],
            "parameters": t["input_schema"],
        }
        for t in TOOLS
    ] + [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
    return {
        "model": "gpt-5-codex",
        "max_output_tokens": 4,
        "temperature": 0,
        "instructions": SYSTEM,
        "tools": tools,
        "input": items,
    }


def _side_call(api: str) -> dict[str, Any]:
    """A quick tool-less call of the same client (a title, a topic check)."""
    text = "Write a short title for this conversation: Find the bug in parser.py"
    if api == "messages":
        return {
            "model": "claude-haiku",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
            "metadata": {"user_id": "user_ab12_account__session_s1"},
        }
    return {"model": "gpt-5-codex", "max_output_tokens": 4, "input": text}


def _body_of(data: bytes, stream: bool) -> str:
    """The answer's text, to check it is the API's own shape (not chat completions)."""
    if not stream:
        return data.decode()
    assert b"data: " in data
    return data.decode()


def _manager(core: Core) -> CacheManager:
    assert isinstance(core.policy, CacheManager)
    return core.policy


def _status(core: Core) -> dict[str, Any]:
    out: dict[str, Any] = core.submit(_manager(core).status()).result(30)
    return out


@pytest.fixture
def api_core(make_core: MakeCore) -> Iterator[tuple[Core, EventLog]]:
    core = make_core(policy_factory=policy_factory)
    log = EventLog()
    core.subscribe(log.append, (RequestCompleted, CacheEvent))
    core.start(wait_ready=True, timeout=120)
    yield core, log


def _completed(log: EventLog, n: int) -> list[RequestCompleted]:
    wait_until(lambda: len(log.of(RequestCompleted)) >= n, 60, message=f"{n} requests recorded")
    done: list[RequestCompleted] = log.of(RequestCompleted)
    return done


# ------------------------------------------------------------ the chat view is the server's
def test_chat_view_renders_token_for_token_as_the_server(api_core: tuple[Core, EventLog]) -> None:
    core, _ = api_core
    cases = [
        ("messages", "/v1/messages", "/v1/messages/count_tokens", _messages(3, "s1")),
        ("responses", "/v1/responses", "/v1/responses/input_tokens", _responses(3)),
    ]
    for endpoint, path, count_path, body in cases:
        view = apis.chat_view(endpoint, body)
        assert view is not None
        n_server = _upstream(core, count_path, body)["input_tokens"]
        prompt = _upstream(core, "/apply-template", view.body)["prompt"]
        tokens = _upstream(
            core, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
        )["tokens"]
        assert n_server == len(tokens), endpoint
        # Token identity, not just the count: the body runs in some slot (a stock server
        # ignores id_slot on /v1/messages), then the chat view as chat completions in that
        # slot reuses all of it but the last token.
        before = _slot_tokens(core)
        _upstream(core, path, {**body, "stream": False})
        after = _slot_tokens(core)
        (slot,) = [i for i in after if after[i] != before.get(i)]
        out = _upstream(
            core,
            "/v1/chat/completions",
            {**view.body, "max_tokens": 1, "id_slot": slot, "cache_prompt": True},
        )
        assert out["timings"]["cache_n"] == n_server - 1, (endpoint, out["timings"], n_server)


# ------------------------------------------------------------ a session through Warmslot
def _session(core: Core, log: EventLog, api: str, stream: bool) -> None:
    path = "/v1/messages" if api == "messages" else "/v1/responses"
    ua = {"User-Agent": CLAUDE_UA if api == "messages" else CODEX_UA}
    body = (lambda t: _messages(t, "s1")) if api == "messages" else _responses
    mgr = _manager(core)
    aux = mgr.state.slots.aux_slot
    assert aux is not None

    status, h1, data = _post(core, path, {**body(1), "stream": stream}, ua)
    assert status == 200, data[:300]
    text = _body_of(data, stream)
    assert ("message" in text) if api == "messages" else ("response" in text)
    assert h1.get("X-Warmslot-Kind") == "agent" and h1.get("X-Warmslot-Slot") != str(aux)
    agent_slot = h1["X-Warmslot-Slot"]
    prefix_tokens = int(h1["X-Warmslot-Prefix"].split(":")[1])
    assert prefix_tokens >= 400  # system + tools: the stable prefix

    status, hs, data = _post(core, path, {**_side_call(api), "stream": stream}, ua)
    assert status == 200, data[:300]
    assert hs.get("X-Warmslot-Kind") == "aux" and hs.get("X-Warmslot-Slot") == str(aux)

    status, h2, data = _post(core, path, {**body(2), "stream": stream}, ua)
    assert status == 200, data[:300]
    assert h2.get("X-Warmslot-Slot") == agent_slot

    done = _completed(log, 3)
    assert [r.endpoint for r in done] == [api] * 3
    assert [r.kind for r in done] == ["agent", "aux", "agent"]
    assert [str(r.slot) for r in done] == [agent_slot, str(aux), agent_slot]
    assert all(r.cache_n is not None and r.prompt_n is not None for r in done), done
    print(
        f"\n{api} stream={stream} stable prefix {prefix_tokens}: "
        + "; ".join(
            f"{r.kind} slot {r.slot} cache_n {r.cache_n} prompt_n {r.prompt_n}" for r in done
        )
    )
    turn2 = done[2]
    assert turn2.cache_n is not None and turn2.cache_n >= 0.95 * prefix_tokens, (
        turn2,
        prefix_tokens,
    )
    assert all(r.status == 200 and not r.error for r in done)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_session_keeps_its_prefix_and_side_calls_apart(
    api_core: tuple[Core, EventLog], stream: bool
) -> None:
    core, log = api_core
    _session(core, log, "responses", stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_session_keeps_its_prefix_with_patch_0004(
    make_core: MakeCore, stream: bool
) -> None:
    server = _binary_with(patched=True)
    if server is None:
        pytest.skip("no llama-server with patch 0004 (api-parity-v1) in the test build cache")
    core = make_core(policy_factory=policy_factory, server__binary=str(server))
    log = EventLog()
    core.subscribe(log.append, (RequestCompleted, CacheEvent))
    core.start(wait_ready=True, timeout=120)
    assert not _status(core)["unmanaged_apis"]
    _session(core, log, "messages", stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_on_a_stock_server_go_through_unmanaged_and_accounted(
    make_core: MakeCore, stream: bool
) -> None:
    server = _binary_with(patched=False)
    if server is None:
        pytest.skip("no llama-server without patch 0004 in the test build cache")
    core = make_core(policy_factory=policy_factory, server__binary=str(server))
    log = EventLog()
    core.subscribe(log.append, (RequestCompleted,))
    core.start(wait_ready=True, timeout=120)
    ua = {"User-Agent": CLAUDE_UA}
    for turn in (1, 2):
        status, headers, data = _post(
            core, "/v1/messages", {**_messages(turn, "s1"), "stream": stream}, ua
        )
        assert status == 200, data[:300]
        assert "X-Warmslot-Slot" not in headers  # not pinned: the server would ignore it
    done = _completed(log, 2)
    # Accounting from `usage` (no `timings` on a stock server's Anthropic answers).
    assert all(r.endpoint == "messages" and r.prompt_n is not None for r in done), done
    assert done[1].cache_n is not None and done[1].cache_n > 0  # the server's own reuse
    why = _status(core)["unmanaged_apis"]["/v1/messages"]
    assert "drops id_slot on /v1/messages" in why and "warmslot build" in why
    assert "forwarded unmanaged" in _status(core)["text"]
    from core.cache.inventory import doctor_lines

    doctor = doctor_lines(core.status().result(30))
    assert any("drops id_slot on /v1/messages" in line for line in doctor), doctor


def test_count_tokens_routes_are_forwarded_unmanaged(api_core: tuple[Core, EventLog]) -> None:
    core, log = api_core
    for path, body in (
        ("/v1/messages/count_tokens", _messages(1, "s1")),
        ("/v1/responses/input_tokens", _responses(1)),
    ):
        status, headers, data = _post(core, path, body, {"User-Agent": CLAUDE_UA})
        assert status == 200, data[:300]
        assert json.loads(data)["input_tokens"] == _upstream(core, path, body)["input_tokens"]
        assert "X-Warmslot-Slot" not in headers
    done = _completed(log, 2)
    assert [r.endpoint for r in done] == ["messages-count", "responses-count"]


def test_a_broken_conversion_forwards_the_request_untouched(
    api_core: tuple[Core, EventLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    core, log = api_core

    def broken(endpoint: str, body: dict[str, Any]) -> None:
        raise RuntimeError("converter bug")

    monkeypatch.setattr(apis, "chat_view", broken)
    assert core.proxy is not None
    before = core.proxy.counters.bypasses
    status, headers, data = _post(core, "/v1/responses", _responses(1), {"User-Agent": CODEX_UA})
    assert status == 200, data[:300]
    assert json.loads(data)["object"] == "response"  # the server's own answer
    assert "X-Warmslot-Slot" not in headers
    assert core.proxy.counters.bypasses == before + 1
    wait_until(
        lambda: any("converter bug" in e.reason for e in log.of(CacheEvent)), 30, message="bypass"
    )
    (done,) = _completed(log, 1)
    assert done.endpoint == "responses" and done.status == 200 and done.prompt_n is not None


def test_bad_messages_body_gets_an_anthropic_error(api_core: tuple[Core, EventLog]) -> None:
    core, _ = api_core
    status, _, data = _post(core, "/v1/messages", {"messages": [{"role": "x"}]}, {})
    assert status == 400
    err = json.loads(data)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "messages[0]" in err["error"]["message"]
    status, _, data = _post(core, "/v1/responses", {"input": 7}, {})
    assert status == 400 and json.loads(data)["error"]["param"] == "input"


def test_every_answer_names_the_model_by_its_short_name(api_core: tuple[Core, EventLog]) -> None:
    """Agents show the model an answer names: llama-server runs with `--alias`, so every
    API's answer and /v1/models carry the short name (the tiny test model: "tiny"),
    never the file's path; status keeps the path for people and adds the name."""
    core, _ = api_core
    assert core.proxy is not None
    base = f"http://127.0.0.1:{core.proxy.port}"
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/messages": {
            "model": "x",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        },
        "/v1/responses": {"model": "x", "input": "hi", "max_output_tokens": 1},
    }
    for path, body in bodies.items():
        req = urllib.request.Request(
            base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["model"] == "tiny", (path, answer.get("model"))
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as resp:
        listed = json.loads(resp.read())
    assert [m["id"] for m in listed["data"]] == ["tiny"]
    st = core.status().result(30)
    model = st["server"]["model"]
    assert model is not None and model["name"] == "tiny" and model["path"].endswith("tiny.gguf")
