"""A conversation grown past its slot gets an error in its API's own shape that names
both sizes — never a cut answer, never llama-server's OpenAI-shaped error on the
Anthropic route.

On the pinned llama-server with a 16,384-token slot, the recorded last turn of each
agent (Claude Code's Messages, Codex's Responses, opencode's chat completions) grown
by a long tool result: llama-server refuses the prompt with a 400 in OpenAI's shape on
every route (so Claude Code, reading Anthropic's, saw no "prompt is too long");
through Warmslot the client gets Anthropic's ``prompt is too long: N tokens > M
maximum`` (the words Claude Code reads the sizes from) or OpenAI's
``context_length_exceeded``, streamed or not, and the hint.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from core.cache.manager import policy_factory
from core.clients import slot_context
from core.config import Settings
from core.engine import Core
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.helpers import REPO, post_chat

pytestmark = pytest.mark.integration

CLIENTS = REPO / "tests" / "fixtures" / "clients"
SLOT = 16384
# A file the agent read: the tiny model's tokenizer is about a token per character, so
# this alone is more than the slot.
LONG = "def f():\n    return 1\n" * 1000


def _recorded(client: str, step: str) -> tuple[dict[str, Any], dict[str, str]]:
    entries = json.loads((CLIENTS / client / "requests.json").read_text())
    entry = copy.deepcopy([e for e in entries if e.get("step") == step and e.get("body")][-1])
    return entry["body"], {"user-agent": entry["headers"]["user-agent"]}


def _grown(client: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, body, headers): the client's recorded third turn plus a long tool result."""
    if client == "claude-code":
        body, headers = _recorded("claude-code", "s1-turn3")
        body["messages"].append({"role": "user", "content": [{"type": "text", "text": LONG}]})
        return "/v1/messages", body, headers
    if client == "codex":
        body, headers = _recorded("codex", "s1-turn3")
        body["input"].append(
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG}]}
        )
        return "/v1/responses", body, headers
    body, headers = _recorded("opencode", "s1-turn3")
    body["messages"].append({"role": "user", "content": LONG})
    return "/v1/chat/completions", body, headers


def _core(make_core: MakeCore) -> Core:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    core = make_core(
        policy_factory=policy_factory, server__model=str(model), server__ctx_per_slot=SLOT
    )
    core.start(wait_ready=True, timeout=180)
    return core


def test_a_conversation_past_its_slot_gets_the_sized_error_in_its_apis_shape(
    make_core: MakeCore,
) -> None:
    core = _core(make_core)
    assert core.upstream.base_url is not None
    # `warmslot clients` sizes each agent's compaction for this slot: it reads it here.
    assert slot_context(core.status().result(30), Settings()) == SLOT
    # llama-server itself: OpenAI's shape even on the Anthropic route.
    path, body, _ = _grown("claude-code")
    r = post_chat(
        core.upstream.base_url, body, path=path, headers=core.supervisor.auth_headers(), expect=400
    )
    assert "type" not in r.json() and "exceeds the available context size" in r.text
    for client in ("claude-code", "codex", "opencode"):
        path, body, headers = _grown(client)
        for stream in (True, False):
            r = post_chat(core, {**body, "stream": stream}, path=path, headers=headers, expect=400)
            tokens, _, n_ctx = r.headers["X-Warmslot-Context"].partition("/")
            assert int(tokens) > SLOT and int(n_ctx) == SLOT, (client, r.headers)
            doc = r.json()
            if client == "claude-code":
                assert doc["type"] == "error", doc
                error = doc["error"]
                assert error["type"] == "invalid_request_error"
                # Claude Code's own reading of Anthropic's message: both numbers.
                m = re.search(
                    r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", error["message"]
                )
                assert m is not None, error
                assert (int(m[1]), int(m[2])) == (int(tokens), SLOT)
            else:
                error = doc["error"]
                assert error["code"] == "context_length_exceeded", error
                assert f"maximum context length is {SLOT} tokens" in error["message"]
                assert (error["n_prompt_tokens"], error["n_ctx"]) == (int(tokens), SLOT)
                assert error["param"] == ("input" if client == "codex" else "messages")
            assert "server.ctx_per_slot" in error["message"]
