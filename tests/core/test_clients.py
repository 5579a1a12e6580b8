"""Client setup snippets: the proxy's URL in each, valid JSON/TOML, honest status; one
declaration (core/clients.py) that the README, docs/clients.md and the snippets agree with."""

from __future__ import annotations

import json
import re
import tomllib
from typing import cast

import pytest

from core import clients
from core.clients import (
    base_url,
    client_model_name,
    client_setups,
    format_setups,
    options_section,
    proxy_address,
    readme_section,
)
from core.config import ModelProfile, Settings
from core.proxy.app import JSON_ROUTES
from core.routing.router import SESSION_HEADERS
from core.status import Status
from tests.helpers import REPO

URL = "http://127.0.0.1:18089"


def by_id(**kw: bool) -> dict[str, clients.ClientSetup]:
    return {s.id: s for s in client_setups(URL, "qwen3-coder", **kw)}


def test_every_snippet_points_at_the_proxy() -> None:
    s = by_id()
    assert set(s) == {"opencode", "aider", "claude-code", "codex"}
    assert base_url(URL) == base_url(URL + "/v1/") == URL + "/v1"
    oc = json.loads(s["opencode"].snippet)
    provider = oc["provider"]["warmslot"]
    assert provider["options"]["baseURL"] == URL + "/v1" and "apiKey" not in provider["options"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert oc["model"] == "warmslot/qwen3-coder" and "qwen3-coder" in provider["models"]
    assert f"OPENAI_API_BASE={URL}/v1" in s["aider"].snippet
    assert "--model openai/qwen3-coder" in s["aider"].snippet
    assert f"ANTHROPIC_BASE_URL={URL}\n" in s["claude-code"].snippet  # no /v1: it adds its own
    codex = tomllib.loads(s["codex"].snippet)
    assert codex["model_provider"] == "warmslot" and codex["model"] == "qwen3-coder"
    assert codex["model_providers"]["warmslot"]["base_url"] == URL + "/v1"
    assert codex["model_providers"]["warmslot"]["wire_api"] == "responses"


def test_what_works_today_follows_the_proxy_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "/v1/chat/completions" in JSON_ROUTES
    s = by_id()
    assert s["opencode"].works and s["aider"].works
    # The proxy forwards Anthropic's Messages and OpenAI's Responses API.
    assert "/v1/messages" in JSON_ROUTES and "/v1/responses" in JSON_ROUTES
    assert s["claude-code"].works and "patch 0004" in s["claude-code"].status
    assert s["codex"].works and "Responses API" in s["codex"].status
    assert [x.works for x in client_setups(URL, "m")] == [True, True, True, True]
    monkeypatch.delitem(JSON_ROUTES, "/v1/messages")
    assert not by_id()["claude-code"].works


def test_a_required_key_is_read_from_the_environment_not_written() -> None:
    s = by_id(api_key=True)
    assert json.loads(s["opencode"].snippet)["provider"]["warmslot"]["options"]["apiKey"] == (
        "{env:WARMSLOT_API_KEY}"
    )
    assert "OPENAI_API_KEY=$WARMSLOT_API_KEY" in s["aider"].snippet
    codex = tomllib.loads(s["codex"].snippet)
    assert codex["model_providers"]["warmslot"]["env_key"] == "WARMSLOT_API_KEY"
    assert (
        "apiKey" not in json.loads(by_id()["opencode"].snippet)["provider"]["warmslot"]["options"]
    )
    text = format_setups(client_setups(URL, "m", api_key=True), URL, api_key=True)
    assert "export WARMSLOT_API_KEY=<your key from `warmslot keys add NAME`" in text
    assert text.count(URL) >= 4 and "[does not work]" not in text


def test_model_name_for_clients() -> None:
    s = Settings()
    assert client_model_name(s) == "gemma-3-270m"
    s.server.model = "/m/Qwen3-Coder-30B-Q4_K_M-00001-of-00003.gguf"
    assert client_model_name(s) == "Qwen3-Coder-30B-Q4_K_M"
    s.models = [ModelProfile(name="side", role="side"), ModelProfile(name="coder")]
    assert client_model_name(s) == "coder"  # routed by name: the primary profile's


def test_proxy_address_running_or_configured() -> None:
    s = Settings()
    assert proxy_address("http://127.0.0.1:40123", s) == "http://127.0.0.1:40123"
    assert proxy_address("http://0.0.0.0:40123", s) == "http://127.0.0.1:40123"
    assert proxy_address("", s) == "http://127.0.0.1:8089"
    s.proxy.host = "::1"
    assert proxy_address("", s) == "http://[::1]:8089"


def _between(path: str, name: str) -> str:
    text = (REPO / path).read_text(encoding="utf-8")
    m = re.search(rf"<!-- {name}: [^>]*-->\n(.*?)\n<!-- end {name} -->", text, re.DOTALL)
    assert m, f"{path} has no {name} markers"
    return m.group(1)


def test_the_readme_and_docs_are_the_declaration() -> None:
    """README's client list and docs/clients.md's settings table are what core/clients.py
    makes of its declaration (`warmslot clients --markdown` prints both to paste)."""
    fix = "out of date: paste the output of `warmslot clients --markdown`"
    assert _between("README.md", "client-setup") == readme_section(), f"README.md {fix}"
    assert _between("docs/clients.md", "client-options") == options_section(), (
        f"docs/clients.md {fix}"
    )
    # Every setting of every snippet has its reason in the table.
    table = options_section()
    for s in client_setups(clients.DOC_URL, clients.DOC_MODEL, api_key=True):
        for o in s.options:
            assert f"| `{o.name}` |" in table, o.name
            assert o.why, o.name


def test_the_agents_wait_as_long_as_warmslot() -> None:
    """Each agent's own time limits are raised to proxy.upstream_timeout_s: a stream is
    silent for the whole prefill (docs/clients.md#timeouts)."""
    s = {x.id: x for x in client_setups(URL, "m", timeout_s=1800)}
    claude = s["claude-code"].snippet
    assert "export API_TIMEOUT_MS=1800000" in claude
    assert "export CLAUDE_STREAM_IDLE_TIMEOUT_MS=1800000" in claude
    codex = tomllib.loads(s["codex"].snippet)
    assert codex["model_providers"]["warmslot"]["stream_idle_timeout_ms"] == 1800000
    options = json.loads(s["opencode"].snippet)["provider"]["warmslot"]["options"]
    assert options["timeout"] == options["headerTimeout"] == 1800000
    assert "--timeout 1800" in s["aider"].snippet
    assert "--timeout 600" in by_id()["aider"].snippet  # the default: 600 s


def test_claude_code_and_codex_setups_say_what_is_read() -> None:
    s = by_id()
    claude = s["claude-code"]
    assert "export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1" in claude.snippet
    # The proxy takes the attribution line out itself (docs/clients.md#claude-code).
    assert "CLAUDE_CODE_ATTRIBUTION_HEADER" not in claude.snippet
    assert "export ANTHROPIC_DEFAULT_HAIKU_MODEL=qwen3-coder" in claude.snippet
    # The session the router reads first is the header; metadata.user_id only without it.
    assert "x-claude-code-session-id" in SESSION_HEADERS
    assert "x-claude-code-session-id" in claude.status and "metadata.user_id" not in claude.status
    codex = tomllib.loads(s["codex"].snippet)
    assert codex["features"] == {"plugins": False}  # no plugin hosts contacted at start
    assert "env_key" not in codex["model_providers"]["warmslot"]  # no key: no variable named
    assert "session-id" in s["codex"].status and "session-id" in SESSION_HEADERS
    text = format_setups(client_setups(URL, "m"), URL)
    assert "features.plugins: Codex contacts its plugin hosts" in text


def test_each_agent_compacts_before_its_slot_is_full() -> None:
    """With the slot's context known, opencode, Codex and Claude Code are told it (each
    assumes a cloud model's window otherwise) and keep a quarter of it free
    (docs/clients.md#context-size); without it nothing is guessed, and the text says so."""
    s = {x.id: x for x in client_setups(URL, "m", context=32768)}
    limit = json.loads(s["opencode"].snippet)["provider"]["warmslot"]["models"]["m"]["limit"]
    assert limit == {"context": 32768, "output": 8192}
    codex = tomllib.loads(s["codex"].snippet)
    assert codex["model_context_window"] == 32768
    assert codex["model_auto_compact_token_limit"] == 24576
    claude = s["claude-code"].snippet
    assert "export CLAUDE_CODE_AUTO_COMPACT_WINDOW=32768" in claude
    assert "export CLAUDE_AUTOCOMPACT_PCT_OVERRIDE=75" in claude
    assert "export CLAUDE_CODE_MAX_OUTPUT_TOKENS=8192" in claude
    assert "19,600 tokens" in s["claude-code"].status  # a 32k slot is tight for it
    big = {x.id: x for x in client_setups(URL, "m", context=262144)}
    assert "19,600" not in big["claude-code"].status
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS=32000" in big["claude-code"].snippet  # its own cap
    assert "not known yet" not in format_setups(list(s.values()), URL)
    unknown = by_id()
    assert (
        "limit"
        not in json.loads(unknown["opencode"].snippet)["provider"]["warmslot"]["models"][
            "qwen3-coder"
        ]
    )
    assert "model_context_window" not in tomllib.loads(unknown["codex"].snippet)
    assert "AUTO_COMPACT" not in unknown["claude-code"].snippet
    assert "not known yet" in format_setups(list(unknown.values()), URL)


def test_the_slot_context_is_the_running_servers_else_the_configured_one() -> None:
    s = Settings()
    assert clients.slot_context(None, s) is None  # the fit plan chooses it at launch
    s.server.ctx_per_slot = 16384
    assert clients.slot_context(None, s) == 16384
    s.models = [ModelProfile(name="coder", ctx_per_slot=65536), ModelProfile(name="s", role="side")]
    assert clients.slot_context(None, s) == 65536  # the primary model's own
    running = cast(Status, {"server": {"fit": {"plan": {"ctx_per_slot": 40960}, "text": ""}}})
    assert clients.slot_context(running, s) == 40960
