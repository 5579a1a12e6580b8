"""The proxy's own error responses, each in its client API's error shape (OpenAI's,
or Anthropic's for /v1/messages)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from core.proxy_checks import Invalid


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


def invalid_response(endpoint: str, e: Invalid) -> web.Response:
    """A refused body's 4xx in its API's own error shape: Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` for /v1/messages, else OpenAI's."""
    if endpoint in ("messages", "messages-count"):
        body = {"type": "error", "error": {"type": e.code, "message": str(e)}}
        return web.json_response(body, status=e.status)
    return error_response(e.status, str(e), param=e.param)


def unavailable_response(endpoint: str, message: str, retry_after_s: int) -> web.Response:
    """503 with ``Retry-After``: the request was not run and may be sent again shortly
    (Warmslot is stopping, or llama-server is not up). Anthropic's shape for /v1/messages
    (``overloaded_error``, which its clients retry), else OpenAI's ``unavailable_error``."""
    headers = {"Retry-After": str(retry_after_s)}
    if endpoint in ("messages", "messages-count"):
        body = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        return web.json_response(body, status=503, headers=headers)
    return error_response(503, message, type_="unavailable_error", headers=headers)
