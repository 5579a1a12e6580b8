"""Intake: one POST read into typed values before anything routes it — the body (capped,
decoded, parsed and validated: malformed input raises `Invalid`, a 4xx in the client's
API's own shape, and nothing is forwarded), the headers as text, the proxy's own edits
of the body (Claude Code's attribution line, tool calls cut short in the history), and
the request read as chat (`core.chat.ChatView`), each done once."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from core import chat as apis
from core.chat import ChatView
from core.config.sections import ProxySettings
from core.proxy import billing, tool_arguments
from core.proxy.checks import THREAD_BYTES, Invalid, parse_json, validate
from core.server.quarantine import body_digest
from core.telemetry import safe_text

log = logging.getLogger("warmslot.proxy")

_T = TypeVar("_T")


async def off_loop(fn: Callable[..., _T], arg: Any, *, big: bool | None = None) -> _T:
    """`fn(arg)`, on a worker thread when `arg` is a large body (`big`, or for bytes
    their length): parsing or encoding megabytes must not stall the event loop."""
    if big is None:
        big = isinstance(arg, bytes | bytearray) and len(arg) > THREAD_BYTES
    if big:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)


@dataclass
class Body:
    """A request's body as the client sent it (`raw`) and parsed (`value`, validated)."""

    raw: bytearray
    value: dict[str, Any]


@dataclass
class Incoming:
    """One request as read, before the router: what the router and the request's
    `ProxyRequest` are made of."""

    endpoint: str
    raw: bytearray
    body: dict[str, Any]  # the parsed body, with the proxy's `edits`
    headers: dict[str, str]  # lower-case names; every name and value text
    edits: tuple[str, ...]
    chat: ChatView | None
    digest: str  # the client's bytes' hash (core.server.quarantine.body_digest)


class Intake:
    """Reads requests (`body`, then `incoming`); the settings are read per request."""

    def __init__(
        self,
        settings: Callable[[], ProxySettings],
        n_slots: Callable[[], int],
        bypass: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self._settings = settings
        self._n_slots = n_slots
        self._bypass = bypass  # a request whose chat view failed (accounting.bypass)

    async def body(self, request: web.Request, endpoint: str) -> Body:
        """The body read, parsed and validated; raises Invalid (4xx)."""
        raw = await self._read(request)
        value = await off_loop(parse_json, raw)
        validate(endpoint, value, self._n_slots())
        return Body(raw, value)

    async def incoming(self, request: web.Request, endpoint: str, body: Body) -> Incoming:
        """The request as the router reads it: headers as text, the body edited, the
        chat view."""
        raw, value = body.raw, body.value
        settings = self._settings()
        # Header values that are not text (non-UTF-8 bytes, which aiohttp passes on as
        # lone surrogates) become U+FFFD here, before any of them reaches the router's
        # Decision, a session key, an event or the telemetry database.
        headers = {safe_text(k.lower()): safe_text(v) for k, v in request.headers.items()}
        edits: tuple[str, ...] = ()
        # Claude Code's attribution line: its stamp changes with each session, so a new
        # session's prompt would leave every slot at the system text's first token
        # (docs/clients.md#claude-code).
        strip = endpoint == "messages" and settings.strip_billing_header
        if strip and billing.strip_billing_header(value):
            edits = (billing.BILLING_HEADER_EDIT,)
        # A tool call cut short in the history makes llama-server fail every later request
        # of the conversation (docs/clients.md#errors-from-the-history).
        if endpoint in ("chat", "responses") and settings.repair_tool_arguments:
            repair = functools.partial(tool_arguments.repair, endpoint)
            if repaired := await off_loop(repair, value, big=len(raw) > THREAD_BYTES):
                log.info("%s: closed %s", endpoint, "; ".join(r.text for r in repaired))
                edits += (tool_arguments.REPAIR_EDIT,)
        chat = await self._chat_view(endpoint, value, len(raw))
        digest = await off_loop(body_digest, raw)
        return Incoming(endpoint, raw, value, headers, edits, chat, digest)

    async def _chat_view(self, endpoint: str, body: Any, nbytes: int) -> ChatView | None:
        """The request's chat view (`core.chat.chat_view`), off the loop for a large body.
        A conversion that fails leaves the request to the server as it is (fail-open):
        logged and recorded as a bypass; llama-server answers whatever it makes of it."""
        if endpoint not in apis.CHAT_ENDPOINTS:
            return None
        try:
            return await off_loop(
                functools.partial(apis.chat_view, endpoint), body, big=nbytes > THREAD_BYTES
            )
        except apis.ConversionError as e:
            # Not a cache failure: llama-server refuses the body too, in its own words.
            log.info("%s request not read as chat (%s); forwarded as it is", endpoint, e)
            return None
        except Exception as e:
            log.exception("could not read a %s request as chat; forwarding it untouched", endpoint)
            self._bypass(
                f"{endpoint} request not read as chat: {e!r}"[:300], {"endpoint": endpoint}
            )
            return None

    async def _read(self, request: web.Request) -> bytearray:
        """The (decoded) body, at most proxy.max_body_mb; raises Invalid (413, 400).

        Read into one growing buffer — `json.loads` takes it as it is — instead of
        aiohttp's `read()`, which joins chunks and then copies the result.
        """
        limit = self._settings().max_body_mb * 1024 * 1024
        too_big = (
            f"request body too large: the limit is {limit // (1024 * 1024)} MiB "
            "(setting proxy.max_body_mb)"
        )
        if request.content_length is not None and request.content_length > limit:
            raise Invalid(413, too_big)
        buf = bytearray()
        try:
            async for chunk in request.content.iter_any():
                buf += chunk
                if len(buf) > limit:  # counted after decompression: gzip bombs stop here
                    raise Invalid(413, too_big)
        except (web.RequestPayloadError, HttpProcessingError) as e:
            # A Content-Encoding body that does not decode, a broken chunked body …
            cause = safe_text(str(e)).replace("\n", " ").strip()
            raise Invalid(400, f"could not read the request body: {cause}") from None
        return buf
