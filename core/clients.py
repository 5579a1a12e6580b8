"""Client setup for coding agents: the one declaration of how to point each at Warmslot.

Each client's setup is a list of `Option` values — the setting as the client spells
it, its value and why Warmslot's setup has it — from which everything is made:
the snippet (``warmslot clients``, the tray's "Client setup…" dialog), the README's
client section (`readme_section`) and the settings table in docs/clients.md
(`options_section`). tests/core/test_clients.py checks both documents against this
module; ``warmslot clients --markdown`` prints the two sections to paste.

Pure functions of the proxy's URL, a model name, whether a key is required, how
long Warmslot waits for llama-server (``proxy.upstream_timeout_s``: each agent is set
to wait as long) and the context of the slot the agent gets (`slot_context`: each
agent is set to compact its conversation before the slot is full,
docs/clients.md#context-size). Whether a client works follows from the routes the
proxy forwards (`core.proxy.app.JSON_ROUTES`): opencode and aider speak OpenAI chat
completions, Claude Code Anthropic's Messages API (``POST /v1/messages``) and Codex CLI OpenAI's
Responses API (``POST /v1/responses``); the proxy manages all three alike
(`core.chat`), /v1/messages with slot pinning only on a server with patch 0004.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.config import Settings
from core.models import profiles
from core.proxy.app import JSON_ROUTES
from core.status import Status, cache_of

__all__ = [
    "API_KEY_ENV",
    "ClientSetup",
    "Option",
    "base_url",
    "client_model_name",
    "client_setups",
    "format_setups",
    "options_section",
    "proxy_address",
    "readme_section",
    "slot_context",
]

API_KEY_ENV = "WARMSLOT_API_KEY"
ANTHROPIC_ROUTE = "/v1/messages"
RESPONSES_ROUTE = "/v1/responses"
# What the documents show: the default address and model, no key, the default wait.
DOC_URL = "http://127.0.0.1:8089"
DOC_MODEL = "gemma-3-270m"
DOC_TIMEOUT_S = 600.0
DOC_CONTEXT = 32768  # the default model's slot (docs/clients.md#context-size)
# A cold prefill on a CPU, measured (docs/clients.md#timeouts): why the agents' own
# limits are raised to Warmslot's.
PREFILL_NOTE = "a cold 19.6k-token prefill took 434–503 s on 2 CPU cores"

Value = str | int | bool


@dataclass(frozen=True)
class Option:
    """One setting of a client's setup: where it goes, its value, why it is there."""

    key: tuple[str, ...]  # an environment variable or flag (one part), or a file path
    value: Value
    why: str

    @property
    def name(self) -> str:
        """The setting as the client's documentation spells it."""
        return ".".join(self.key)


@dataclass(frozen=True)
class ClientSetup:
    """How to point one client at Warmslot."""

    id: str
    title: str
    api: str  # the API it speaks
    works: bool  # False: the proxy does not forward this client's API
    status: str  # one or two sentences on what works
    where: str  # the file to edit or where to run it
    language: str  # json | toml | shell
    snippet: str
    options: tuple[Option, ...]  # what the snippet sets, each with its reason
    tried: str = ""  # the client version the setup was run with (docs/clients.md)


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
    return DOC_MODEL


def slot_context(status: Status | None, settings: Settings) -> int | None:
    """The context of the slot an agent gets, in tokens: the running server's (its
    launch plan's, else the context the proxy read from llama-server), else the
    configured one (the primary model's ``ctx_per_slot``, else ``server.ctx_per_slot``);
    None when the fit plan chooses it at launch and no server runs."""
    if status is not None:
        fit = status["server"].get("fit")
        planned = fit["plan"].get("ctx_per_slot") if fit else None
        if isinstance(planned, int) and planned > 0:
            return planned
        cache = cache_of(status)
        seen = cache["context_limits"]["n_ctx_slot"] if cache is not None else None
        if seen:
            return seen
    server = profiles.server_settings(settings, profiles.primary(settings))
    return server.ctx_per_slot or None


# What each agent keeps free of its conversation: room for its answer and the next
# turn's tool results (a quarter of the slot, at most Claude Code's and opencode's
# own 32,000-token output cap). It compacts when the rest is full.
def _reserve(ctx: int) -> int:
    return min(ctx // 4, 32000)


_CTX_WHY = "the slot's context in tokens ({ctx}, `warmslot status`; docs/clients.md#context-size)"


# Claude Code's own prompt (24 tools and the system text) before any conversation,
# measured with Gemma 3's tokenizer (docs/clients.md#context-size).
CLAUDE_BASE_TOKENS = 19600


def _claude_room(ctx: int | None) -> str:
    if ctx is None or ctx >= 4 * CLAUDE_BASE_TOKENS:
        return ""
    return (
        f" Its own prompt is about {CLAUDE_BASE_TOKENS:,} tokens before any conversation: "
        f"a {ctx:,}-token slot leaves room for a few turns between compactions "
        "(server.ctx_per_slot = 81920 or more gives it room)."
    )


def _key_value(key: bool, placeholder: str) -> str:
    return f"${API_KEY_ENV}" if key else placeholder


# Whether a key matters: only when Warmslot requires one (named keys, `warmslot keys add
# NAME`, or proxy.api_key); the snippets then read it from WARMSLOT_API_KEY.
_KEY_ONLY = (
    f"only when Warmslot requires a key (named keys or proxy.api_key): read from {API_KEY_ENV}"
)


def _key_why(key: bool, without: str) -> str:
    if key:
        return f"the key Warmslot requires, read from {API_KEY_ENV}"
    return f"any value: Warmslot requires no key ({without})"


# ------------------------------------------------------------ the declaration
def _opencode(url: str, model: str, key: bool, timeout_ms: int, ctx: int | None) -> ClientSetup:
    provider = ("provider", "warmslot")
    limit = (*provider, "models", model, "limit")
    options = [
        Option(("$schema",), "https://opencode.ai/config.json", "opencode's config schema"),
        Option((*provider, "npm"), "@ai-sdk/openai-compatible", "opencode's provider for "
               "any OpenAI-compatible server"),
        Option((*provider, "name"), "Warmslot (local)", "the provider's name in opencode"),
        Option((*provider, "options", "baseURL"), base_url(url), "Warmslot's proxy"),
        *([Option((*provider, "options", "apiKey"), "{env:" + API_KEY_ENV + "}", _KEY_ONLY)]
          if key else []),
        Option((*provider, "options", "timeout"), timeout_ms, "opencode gives up on a "
               "request after 300,000 ms; Warmslot waits for llama-server as long as this "
               f"(proxy.upstream_timeout_s), and {PREFILL_NOTE}"),
        Option((*provider, "options", "headerTimeout"), timeout_ms, "opencode waits "
               "300,000 ms for the response headers; Warmslot sends a stream's with its first "
               "keep-alive (after 20 s of prefill), a whole answer's only at its end"),
        Option((*provider, "models", model, "name"), model, "the model, by the name "
               "Warmslot answers to"),
        *([Option((*limit, "context"), ctx, "opencode compacts the session when it no "
                  "longer fits in this less the output limit; without a limit a custom "
                  "model has none and never compacts: " + _CTX_WHY.format(ctx=ctx)),
           Option((*limit, "output"), _reserve(ctx), "the longest answer (opencode's "
                  "max_tokens, 32,000 otherwise, which a small slot cannot hold) and what "
                  "opencode keeps free: a quarter of the slot")] if ctx else []),
        Option(("model",), f"warmslot/{model}", "use it"),
    ]  # fmt: skip
    return ClientSetup(
        id="opencode",
        title="opencode",
        api="OpenAI chat completions",
        works=True,
        status="Works (OpenAI chat completions). opencode's x-session-id pins each "
        "session to a slot, and its title calls are kept off the agent's slot.",
        where="opencode.json in your project, or ~/.config/opencode/opencode.json",
        language="json",
        snippet=_json_snippet(options),
        options=tuple(options),
        tried="1.18.33",
    )


def _aider(url: str, model: str, key: bool, timeout_ms: int, ctx: int | None) -> ClientSetup:
    options = [
        Option(("OPENAI_API_BASE",), base_url(url), "Warmslot's proxy (`--openai-api-base`)"),
        Option(("OPENAI_API_KEY",), _key_value(key, "warmslot"),
               _key_why(key, "litellm requires one; `--openai-api-key`")),
        Option(("--model",), f"openai/{model}", "litellm's openai/ prefix: any "
               "OpenAI-compatible server"),
        Option(("--timeout",), timeout_ms // 1000, "aider (litellm) gives up on a request "
               f"after 600 s; as long as Warmslot waits ({PREFILL_NOTE})"),
    ]  # fmt: skip
    lines = [f"export {o.name}={o.value}" for o in options if o.name.isupper()]
    flags = " ".join(f"{o.name} {o.value}" for o in options if o.name.startswith("--"))
    lines.append(f"aider {flags}")
    return ClientSetup(
        id="aider",
        title="aider",
        api="OpenAI chat completions",
        works=True,
        status="Works (OpenAI chat completions, through litellm's openai/ prefix). "
        "aider may warn that it does not know the model's context size; that is harmless.",
        where="a shell, in your project",
        language="shell",
        snippet="\n".join(lines),
        options=tuple(options),
        tried="0.86.2",
    )


def _claude_code(url: str, model: str, key: bool, timeout_ms: int, ctx: int | None) -> ClientSetup:
    works = ANTHROPIC_ROUTE in JSON_ROUTES
    options = [
        Option(("ANTHROPIC_BASE_URL",), url.rstrip("/"), "Warmslot's proxy, without /v1 "
               "(Claude Code adds /v1/messages)"),
        Option(("ANTHROPIC_AUTH_TOKEN",), _key_value(key, "warmslot"),
               _key_why(key, "without one Claude Code asks you to log in")),
        Option(("ANTHROPIC_MODEL",), model, "the model, by the name Warmslot answers to"),
        Option(("ANTHROPIC_DEFAULT_HAIKU_MODEL",), model, "Claude Code's quick calls "
               "(titles, topics) name its small model, a Claude Haiku by default: the local "
               "one (a model pool with pool.strict_models refuses a name it does not serve)"),
        Option(("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",), 1, "no telemetry, error "
               "reports or update checks: nothing leaves the machine but the model calls"),
        Option(("API_TIMEOUT_MS",), timeout_ms, "how long one request may take: as long "
               "as Warmslot waits for llama-server (proxy.upstream_timeout_s)"),
        Option(("CLAUDE_STREAM_IDLE_TIMEOUT_MS",), timeout_ms, "Claude Code drops a stream "
               "without an event for max(this, 300,000 ms) and sends the request again; "
               "Warmslot's keep-alive pings do not count (its SDK drops them), so a stream "
               f"has no event for the whole prefill, and {PREFILL_NOTE}"),
        *([Option(("CLAUDE_CODE_AUTO_COMPACT_WINDOW",), ctx, "Claude Code compacts from "
                  "the window it assumes, its cloud models' 200,000 tokens otherwise: "
                  + _CTX_WHY.format(ctx=ctx)),
           Option(("CLAUDE_AUTOCOMPACT_PCT_OVERRIDE",), 75, "compact at 75 % of that "
                  "window (about 95 % otherwise), leaving a quarter for the answer and "
                  "the next tool results"),
           Option(("CLAUDE_CODE_MAX_OUTPUT_TOKENS",), _reserve(ctx), "the longest answer "
                  "(32,000 otherwise, which a small slot cannot hold): a quarter of the "
                  "slot")] if ctx else []),
    ]  # fmt: skip
    lines = [f"export {o.name}={o.value}" for o in options] + ["claude"]
    status = (
        "Works (Anthropic Messages API, managed like chat completions: Claude Code's "
        "session, from its x-claude-code-session-id header, pins a slot; its tool-less "
        "quick calls go to the side slot). Pinning needs a llama-server with patch 0004 "
        "(`warmslot build`); on a stock server requests are forwarded and accounted, "
        "unmanaged (`warmslot status` says so). The proxy takes Claude Code's per-session "
        "attribution line out of the system text, so CLAUDE_CODE_ATTRIBUTION_HEADER=0 is "
        "not needed. Use a model with a tool-capable chat template." + _claude_room(ctx)
        if works
        else f"Does not work: Claude Code speaks Anthropic's Messages API (POST "
        f"{ANTHROPIC_ROUTE}), which this proxy does not forward."
    )
    return ClientSetup(
        id="claude-code",
        title="Claude Code",
        api="Anthropic Messages",
        works=works,
        status=status,
        where="a shell, before running claude (or the env block of ~/.claude/settings.json)",
        language="shell",
        snippet="\n".join(lines),
        options=tuple(options),
        tried="2.1.197",
    )


def _codex(url: str, model: str, key: bool, timeout_ms: int, ctx: int | None) -> ClientSetup:
    works = RESPONSES_ROUTE in JSON_ROUTES
    provider = ("model_providers", "warmslot")
    options = [
        Option(("model",), model, "the model, by the name Warmslot answers to"),
        Option(("model_provider",), "warmslot", "use the provider below"),
        *([Option(("model_context_window",), ctx, "Codex assumes a cloud model's window "
                  "for a model it does not know: " + _CTX_WHY.format(ctx=ctx)),
           Option(("model_auto_compact_token_limit",), ctx - _reserve(ctx), "Codex "
                  "compacts the conversation once it holds this many tokens: three "
                  "quarters of the slot, leaving room for the answer and the next tool "
                  "results")] if ctx else []),
        Option((*provider, "name"), "Warmslot", "the provider's name in Codex"),
        Option((*provider, "base_url"), base_url(url), "Warmslot's proxy"),
        Option((*provider, "wire_api"), "responses", "the Responses API, the only one "
               "current Codex releases speak"),
        *([Option((*provider, "env_key"), API_KEY_ENV, f"{_KEY_ONLY} (Codex refuses "
                  "to start when the variable named here is unset)")] if key else []),
        Option((*provider, "stream_idle_timeout_ms"), timeout_ms, "Codex drops a stream "
               "without an event for 300,000 ms and retries it (\"Reconnecting 5/5\"); "
               "Warmslot's keep-alive comments are no events, so a stream has none for the "
               f"whole prefill, and {PREFILL_NOTE}"),
        Option(("features", "plugins"), False, "Codex contacts its plugin hosts at every "
               "start, even with a local provider"),
    ]  # fmt: skip
    status = (
        "Works (OpenAI Responses API, managed like chat completions: the stable prefix "
        "of instructions and function tools stays in its slot, tool-less calls go to the "
        "side slot; its session comes from the session-id header). Codex's built-in "
        "non-function tools are dropped by llama-server."
        if works
        else f"Does not work: current Codex CLI releases speak only OpenAI's Responses "
        f"API (POST {RESPONSES_ROUTE}), which this proxy does not forward."
    )
    return ClientSetup(
        id="codex",
        title="Codex CLI",
        api="OpenAI Responses",
        works=works,
        status=status,
        where="~/.codex/config.toml (top-level keys before the tables; merge [features] "
        "into yours if you have one)",
        language="toml",
        snippet=_toml_snippet(options),
        options=tuple(options),
        tried="0.171.0",
    )


def client_setups(
    proxy_url: str,
    model: str,
    *,
    api_key: bool = False,
    timeout_s: float = DOC_TIMEOUT_S,
    context: int | None = None,
) -> list[ClientSetup]:
    """The setups of opencode, aider, Claude Code and Codex CLI, working ones first.

    `proxy_url` is the proxy's address (``http://127.0.0.1:8089``); `api_key` says
    that the proxy requires a key (named keys or ``proxy.api_key``): the snippets then
    read it from the environment variable ``WARMSLOT_API_KEY`` instead of containing
    it. `timeout_s` is how long Warmslot waits for llama-server
    (``proxy.upstream_timeout_s``): each agent is told to wait as long. `context` is
    the slot's context in tokens (`slot_context`): opencode, Codex and Claude Code are
    told to compact before it is full; None leaves their own assumption (a cloud
    model's window) and says so.
    """
    timeout_ms = int(timeout_s * 1000)
    setups = [
        make(proxy_url, model, api_key, timeout_ms, context)
        for make in (_opencode, _aider, _claude_code, _codex)
    ]
    return sorted(setups, key=lambda s: not s.works)


# ------------------------------------------------------------ what is made of it
def _json_snippet(options: Sequence[Option]) -> str:
    doc: dict[str, object] = {}
    for o in options:
        at = doc
        for part in o.key[:-1]:
            nxt = at.setdefault(part, {})
            assert isinstance(nxt, dict)
            at = nxt
        at[o.key[-1]] = o.value
    return json.dumps(doc, indent=2)


def _toml_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else json.dumps(value)


def _toml_snippet(options: Sequence[Option]) -> str:
    tables: dict[str, list[str]] = {}  # table ("" for the top level) → its lines
    for o in options:
        tables.setdefault(".".join(o.key[:-1]), []).append(f"{o.key[-1]} = {_toml_value(o.value)}")
    lines = tables.pop("", [])
    for table, body in tables.items():
        lines += ["", f"[{table}]", *body]
    return "\n".join(lines)


def format_setups(setups: list[ClientSetup], proxy_url: str, *, api_key: bool = False) -> str:
    """All snippets as plain text for a terminal."""
    out = [f"Client base URL: {base_url(proxy_url)}"]
    if api_key:
        out.append(
            f"The proxy requires an API key: export {API_KEY_ENV}=<your key from "
            "`warmslot keys add NAME`, or proxy.api_key>"
        )
    if not any(o.name == "model_context_window" for s in setups for o in s.options):
        out.append(
            "The slot's context is not known yet (the fit plan chooses it when Warmslot "
            "starts): run this again while Warmslot runs for the settings that make each "
            "agent compact before its slot is full (docs/clients.md#context-size)."
        )
    for s in setups:
        mark = "" if s.works else "  [does not work]"
        out += ["", f"== {s.title}{mark} — {s.where}", s.status, "", s.snippet]
        out += ["", "Why each setting (docs/clients.md#setup):"]
        out += [f"  {o.name}: {o.why}" for o in s.options]
    return "\n".join(out)


def _doc_setups(*, api_key: bool) -> list[ClientSetup]:
    return client_setups(
        DOC_URL, DOC_MODEL, api_key=api_key, timeout_s=DOC_TIMEOUT_S, context=DOC_CONTEXT
    )


def readme_section() -> str:
    """The README's client list: each client's snippet with the default address and
    model (the block between the ``client-setup`` markers in README.md)."""
    out: list[str] = []
    for s in _doc_setups(api_key=False):
        out += [f"- **{s.title}** ({s.api}; tried with {s.tried}), {s.where}:", ""]
        out += [f"  ```{'bash' if s.language == 'shell' else s.language}"]
        out += [f"  {line}" if line else "" for line in s.snippet.splitlines()]
        out += ["  ```", ""]
    return "\n".join(out).rstrip("\n")


def options_section() -> str:
    """docs/clients.md's table of every setting and why, the key's too (the block
    between the ``client-options`` markers)."""
    out: list[str] = []
    for s in _doc_setups(api_key=True):
        out += [f"**{s.title}** — {s.where}:", "", "| setting | value | why |", "|---|---|---|"]
        for o in s.options:
            value = _toml_value(o.value) if s.language == "toml" else str(o.value)
            out.append(f"| `{o.name}` | `{value}` | {o.why} |")
        out.append("")
    return "\n".join(out).rstrip("\n")
