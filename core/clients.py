"""Setup snippets for coding agents: where to point each client at Warmslot.

Pure functions of the proxy's URL and a model name, shared by ``warmslot clients``
and the tray's "Client setup…" dialog. Whether a client works follows from the
routes the proxy forwards (`core.proxy.JSON_ROUTES`): opencode and aider speak OpenAI
chat completions, Claude Code Anthropic's Messages API (``POST /v1/messages``) and
Codex CLI OpenAI's Responses API (``POST /v1/responses``); the proxy manages all three
alike (`core.apis`), /v1/messages with slot pinning only on a server with patch 0004.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from core.config import Settings
from core.models import profiles
from core.proxy import JSON_ROUTES

__all__ = [
    "ClientSetup",
    "base_url",
    "client_model_name",
    "client_setups",
    "format_setups",
    "proxy_address",
]

API_KEY_ENV = "WARMSLOT_API_KEY"
ANTHROPIC_ROUTE = "/v1/messages"
RESPONSES_ROUTE = "/v1/responses"


@dataclass(frozen=True)
class ClientSetup:
    """How to point one client at Warmslot."""

    id: str
    title: str
    works: bool  # False: the proxy does not forward this client's API yet
    status: str  # one or two sentences on what works today
    where: str  # the file to edit or where to run it
    language: str  # json | toml | shell
    snippet: str


def base_url(proxy_url: str) -> str:
    """The OpenAI base URL clients need: the proxy's address plus ``/v1``."""
    url = proxy_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def proxy_address(running_url: str, settings: Settings) -> str:
    """The proxy's address: the running one's (`running_url`), else the configured one.

    A proxy bound to every interface is reached on loopback from this machine.
    """
    if running_url:
        return running_url.replace("://0.0.0.0:", "://127.0.0.1:")
    host = settings.proxy.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{settings.proxy.port}"


def client_model_name(settings: Settings) -> str:
    """The model name to put in client configs.

    With model profiles (``[[models]]``) requests are routed by the ``model`` field,
    so it is the primary profile's name; a single model answers to any name, and
    its file name is the clearest.
    """
    if settings.models:
        return profiles.primary(settings).name
    if settings.server.model:
        stem = Path(settings.server.model).name
        stem = re.sub(r"-\d{5}-of-\d{5}(?=\.gguf$)", "", stem, flags=re.IGNORECASE)
        return re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE) or "local"
    return "gemma-3-270m"


def _opencode(url: str, model: str, key: bool) -> ClientSetup:
    options: dict[str, str] = {"baseURL": base_url(url)}
    if key:
        options["apiKey"] = "{env:" + API_KEY_ENV + "}"
    doc = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "warmslot": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Warmslot (local)",
                "options": options,
                "models": {model: {"name": model}},
            }
        },
        "model": f"warmslot/{model}",
    }
    return ClientSetup(
        id="opencode",
        title="opencode",
        works=True,
        status="Works today (OpenAI chat completions). opencode's x-session-id pins each "
        "session to a slot, and its title calls are kept off the agent's slot.",
        where="opencode.json in your project, or ~/.config/opencode/opencode.json",
        language="json",
        snippet=json.dumps(doc, indent=2),
    )


def _aider(url: str, model: str, key: bool) -> ClientSetup:
    key_value = f"${API_KEY_ENV}" if key else "warmslot  # any value: no key is required"
    lines = [
        f"export OPENAI_API_BASE={base_url(url)}",
        f"export OPENAI_API_KEY={key_value}",
        f"aider --model openai/{model}",
        "",
        "# or, without environment variables:",
        f"aider --model openai/{model} --openai-api-base {base_url(url)} "
        f"--openai-api-key {'$' + API_KEY_ENV if key else 'warmslot'}",
    ]
    return ClientSetup(
        id="aider",
        title="aider",
        works=True,
        status="Works today (OpenAI chat completions, through litellm's openai/ prefix). "
        "aider may warn that it does not know the model's context size; that is harmless.",
        where="a shell, in your project",
        language="shell",
        snippet="\n".join(lines),
    )


def _claude_code(url: str, model: str, key: bool) -> ClientSetup:
    works = ANTHROPIC_ROUTE in JSON_ROUTES
    lines = [
        f"export ANTHROPIC_BASE_URL={url.rstrip('/')}",
        f"export ANTHROPIC_AUTH_TOKEN={'$' + API_KEY_ENV if key else 'warmslot'}",
        f"export ANTHROPIC_MODEL={model}",
        # Else its system prompt opens with a stamp that changes per session (docs/clients.md).
        "export CLAUDE_CODE_ATTRIBUTION_HEADER=0",
        "claude",
    ]
    status = (
        "Works (Anthropic Messages API, managed like chat completions: Claude Code's "
        "session from metadata.user_id pins a slot, its tool-less quick calls go to the "
        "side slot). Pinning needs a llama-server with patch 0004 (`warmslot build`); on "
        "a stock server requests are forwarded and accounted, unmanaged (`warmslot "
        "status` says so). Use a model with a tool-capable chat template."
        if works
        else "Does not work yet: Claude Code speaks Anthropic's Messages API "
        f"(POST {ANTHROPIC_ROUTE}), and Warmslot's proxy forwards only OpenAI-style "
        "routes (chat/completions, completions, embeddings) today, so Claude Code gets "
        "404 Not Found. The snippet is what it will take once that support lands."
    )
    return ClientSetup(
        id="claude-code",
        title="Claude Code",
        works=works,
        status=status,
        where="a shell, before running claude",
        language="shell",
        snippet="\n".join(lines),
    )


def _codex(url: str, model: str, key: bool) -> ClientSetup:
    works = RESPONSES_ROUTE in JSON_ROUTES
    lines = [
        f'model = "{model}"',
        'model_provider = "warmslot"',
        "",
        "[model_providers.warmslot]",
        'name = "Warmslot"',
        f'base_url = "{base_url(url)}"',
        'wire_api = "responses"',
    ]
    if key:
        lines.append(f'env_key = "{API_KEY_ENV}"')
    status = (
        "Works (OpenAI Responses API, managed like chat completions: the stable prefix "
        "of instructions and function tools stays in its slot, tool-less calls go to the "
        "side slot). Codex's built-in non-function tools are dropped by llama-server."
        if works
        else "Does not work yet: current Codex CLI releases speak only OpenAI's Responses "
        f'API (POST {RESPONSES_ROUTE}; wire_api = "chat" is no longer accepted), and '
        "Warmslot's proxy forwards only chat/completions, completions and embeddings "
        "today. The snippet is what it will take once that support lands."
    )
    return ClientSetup(
        id="codex",
        title="Codex CLI",
        works=works,
        status=status,
        where="~/.codex/config.toml (top-level keys before the table)",
        language="toml",
        snippet="\n".join(lines),
    )


def client_setups(proxy_url: str, model: str, *, api_key: bool = False) -> list[ClientSetup]:
    """Snippets for opencode, aider, Claude Code and Codex CLI, working ones first.

    `proxy_url` is the proxy's address (``http://127.0.0.1:8089``); `api_key` says
    that the proxy requires a key (``proxy.api_key``): the snippets then read it
    from the environment variable ``WARMSLOT_API_KEY`` instead of containing it.
    """
    setups = [
        _opencode(proxy_url, model, api_key),
        _aider(proxy_url, model, api_key),
        _claude_code(proxy_url, model, api_key),
        _codex(proxy_url, model, api_key),
    ]
    return sorted(setups, key=lambda s: not s.works)


def format_setups(setups: list[ClientSetup], proxy_url: str, *, api_key: bool = False) -> str:
    """All snippets as plain text for a terminal."""
    out = [f"Client base URL: {base_url(proxy_url)}"]
    if api_key:
        out.append(
            f"The proxy requires an API key: export {API_KEY_ENV}=<your key from "
            "`warmslot keys add NAME`, or proxy.api_key>"
        )
    for s in setups:
        mark = "" if s.works else "  [not yet]"
        out += ["", f"== {s.title}{mark} — {s.where}", s.status, "", s.snippet]
    return "\n".join(out)
