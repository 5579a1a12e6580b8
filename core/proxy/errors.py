"""The proxy's own error responses, each in its client API's error shape (OpenAI's,
or Anthropic's for /v1/messages), and llama-server's errors that the request itself
caused, said as such (`history_error`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping

from aiohttp import web

from core.proxy import tool_arguments
from core.proxy.checks import Invalid


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An error in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def auth_response(endpoint: str) -> web.Response:
    """401 for a request without a valid API key, in its API's own error shape
    (Anthropic's for /v1/messages, else OpenAI's)."""
    message = "Warmslot: invalid or missing API key"
    headers = {"WWW-Authenticate": 'Bearer realm="warmslot"'}
    if endpoint in ("messages", "messages-count"):
        body = {"type": "error", "error": {"type": "authentication_error", "message": message}}
        return web.json_response(body, status=401, headers=headers)
    return error_response(401, message, type_="authentication_error", headers=headers)


def invalid_response(
    endpoint: str, e: Invalid, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A refused body's 4xx in its API's own error shape: Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` for /v1/messages, else OpenAI's."""
    if endpoint in ("messages", "messages-count"):
        body = {"type": "error", "error": {"type": e.code, "message": str(e)}}
        return web.json_response(body, status=e.status, headers=headers)
    return error_response(e.status, str(e), param=e.param, headers=headers)


def unavailable_response(endpoint: str, message: str, retry_after_s: int) -> web.Response:
    """503 with ``Retry-After``: the request was not run and may be sent again shortly
    (Warmslot is stopping, or llama-server is not up). Anthropic's shape for /v1/messages
    (``overloaded_error``, which its clients retry), else OpenAI's ``unavailable_error``."""
    headers = {"Retry-After": str(retry_after_s)}
    if endpoint in ("messages", "messages-count"):
        body = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        return web.json_response(body, status=503, headers=headers)
    return error_response(503, message, type_="unavailable_error", headers=headers)


# What a request that comes while Warmslot is stopping is told: retry in this many
# seconds (a Warmslot relaunched at once is up by then, or on its way).
STOPPING_RETRY_S = 5
STOPPING_TEXT = "Warmslot is shutting down; the request was not run: retry shortly"


def stopping_response(endpoint: str) -> web.Response:
    """503 for a request that came, or lost its llama-server, while Warmslot stops."""
    return unavailable_response(endpoint, f"Warmslot: {STOPPING_TEXT}", STOPPING_RETRY_S)


def not_ready_response(state: str) -> web.Response:
    """503 while llama-server is not up (`state`: its state in words)."""
    return error_response(
        503,
        f"Warmslot: llama-server is not ready (state: {state}); retry shortly",
        type_="unavailable_error",
        headers={"Retry-After": "2"},
    )


# llama-server's 500s that the request's own history causes, not the server: the same
# body fails the same way every time, so a client that retries a 5xx (Codex: "high
# demand … Reconnecting 5/5") only repeats it. Said as a 400 that names the cause.
_BAD_ARGUMENTS = "Failed to parse tool call arguments as JSON"
_BAD_MESSAGES = "Failed to parse messages: "  # a message part or tool call it cannot read


def history_error(
    endpoint: str, status: int, upstream_message: str, body: MutableMapping[str, object]
) -> Invalid | None:
    """The 400 to answer instead of a llama-server 500 that the request's own history
    caused (None for any other answer): a history tool call whose arguments are not
    JSON, named by its field in the client's body (core.proxy.tool_arguments), or a message
    llama-server cannot read, in its words. (A chat template's own refusal, its
    raise_exception, is llama-server's 400 already.)"""
    if status != 500:
        return None
    if upstream_message.startswith(_BAD_MESSAGES):
        return Invalid(
            400,
            "Warmslot: llama-server cannot read a message of this conversation: "
            f"{upstream_message[len(_BAD_MESSAGES) :]} (its 500; the same messages fail every "
            "time, docs/clients.md#errors-from-the-history)",
            param="input" if endpoint == "responses" else "messages",
        )
    if _BAD_ARGUMENTS not in upstream_message:
        return None
    bad = tool_arguments.find(endpoint, body)
    named = "; ".join(b.text for b in bad[:3])
    if len(bad) > 3:
        named += f" (and {len(bad) - 3} more)"
    return Invalid(
        400,
        "Warmslot: this conversation's history holds a tool call whose arguments are not "
        f"JSON, which llama-server cannot render: {named or upstream_message}. An answer "
        "cut short at its output limit inside a tool call leaves one, and every later "
        "request of the conversation fails the same way until the call is closed or "
        "removed: the setting proxy.repair_tool_arguments closes it "
        "(docs/clients.md#errors-from-the-history).",
        param=bad[0].where if bad else None,
    )


def stalled_response(endpoint: str, message: str) -> web.Response:
    """504: the request was cancelled because its llama-server slot made no progress
    (core.server.watchdog), before any of its answer went out; in its API's shape."""
    if endpoint in ("messages", "messages-count"):
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return web.json_response(body, status=504)
    return error_response(504, message, type_="server_error")


def stream_error_event(endpoint: str, message: str, status: int) -> bytes:
    """The event that ends a stream with an error, as llama-server ends its own: for
    /v1/messages an ``event: error`` in Anthropic's shape, else ``data: {"error": …}``.
    It starts with a line end, so that it never joins an event left unfinished."""
    if endpoint == "messages":
        payload: dict[str, object] = {
            "type": "error",
            "error": {"type": "api_error", "message": message},
        }
        return f"\nevent: error\ndata: {json.dumps(payload)}\n\n".encode()
    payload = {"error": {"message": message, "type": "server_error", "code": status}}
    return f"\ndata: {json.dumps(payload)}\n\n".encode()


# A prompt longer than its slot. Each API's own words, which the agents recognise as
# "compact and retry" rather than a failure: Anthropic's "prompt is too long: N tokens
# > M maximum" (Claude Code reads both numbers out of it), OpenAI's error code
# context_length_exceeded and "maximum context length is M tokens" (Codex, opencode),
# and llama-server's own phrase (clients that know llama.cpp look for it).
CONTEXT_HINT = (
    "compact or shorten the conversation, or give each slot more context "
    "(server.ctx_per_slot); `warmslot clients` sets each agent to compact before its "
    "slot is full (docs/clients.md#context-size)"
)


def context_error_response(
    endpoint: str, tokens: int, n_ctx: int, headers: Mapping[str, str] | None = None
) -> web.Response:
    """400 for a prompt of `tokens` that llama-server refused because its slot holds
    `n_ctx`, in the API's own error shape, with both numbers and what to do — instead
    of llama-server's OpenAI-shaped error on every route."""
    if endpoint in ("messages", "messages-count"):
        message = (
            f"prompt is too long: {tokens} tokens > {n_ctx} maximum (Warmslot: the "
            f"llama-server slot holds {n_ctx} tokens; {CONTEXT_HINT})"
        )
        body: dict[str, object] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
        return web.json_response(body, status=400, headers=headers)
    message = (
        f"This model's maximum context length is {n_ctx} tokens (its llama-server slot), "
        f"but the request has {tokens} tokens: the request exceeds the available context "
        f"size. Warmslot: {CONTEXT_HINT}"
    )
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": "input" if endpoint == "responses" else "messages",
        "code": "context_length_exceeded",
        "n_prompt_tokens": tokens,
        "n_ctx": n_ctx,
    }
    return web.json_response({"error": error}, status=400, headers=headers)
