"""Reading llama-server's answers as they pass through the proxy, without buffering or
parsing them whole: the `timings` and slot of a stream (`SSEScanner`) or of a complete
body, the reuse numbers of an Anthropic or Responses `usage`, an upstream error's text;
and the keep-alives of a stream that waits for its first event (`Heartbeat`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from core import chat as apis
from core.proxy.headers import HOLD_MAX_BYTES, Reuse, reuse_from
from core.proxy.split import split_line
from core.server.client import Timings

# The events of a stream's last result, which carry `timings` even without
# ``timings_per_token``: a chat chunk with a finish reason, or the usage chunk after it
# (``"choices": []``, with ``stream_options.include_usage``), a raw completion's
# ``"stop": true``, the Responses API's ``response.completed`` (measured on the pinned
# llama-server, docs/llama-server-facts.md#timings).
_FINAL = re.compile(
    rb'"finish_reason":\s*"|"choices":\s*\[\]|"stop":\s*true|"type":\s*"response\.completed"'
)
_TIMINGS = re.compile(rb',?\s*"timings":\s*\{[^{}]*\}')


def _without_timings(line: bytes) -> bytes:
    """An event line without its `timings` object (flat: numbers only), and without the
    comma that led to it."""
    out = _TIMINGS.sub(b"", line, count=1)
    return out.replace(b"{,", b"{", 1) if out.startswith(b"data: {,") else out


class SSEScanner:
    """The one reader of a streamed answer: passes its bytes on event line by event line
    and notes, without parsing every event, what the proxy needs of it.

    `feed` returns the bytes to send the client now: every complete line (a partial one
    waits for its end; llama-server writes whole events, so nothing is held in practice).
    With `strip_timings` — the proxy asked for ``timings_per_token`` only to learn the
    reuse numbers early — each event's `timings` is taken out again except in the
    stream's last result, where llama-server sends it anyway: the client receives what
    llama-server would have sent it (docs/cache.md#response-headers).

    Noted: the first reuse numbers (`opening`, for the headers; `ready` once a chunk
    completed an event or `HOLD_MAX_BYTES` are held), the last line with `timings`
    (parsed when asked: `timings`, `id_slot`), the last `usage` lines and an error event
    — all as llama-server sent them. With `split` (the part of the prompt the cache read
    just before the request, `ProxyRequest.split`) the numbers passed on count it as
    prefill (`core.proxy.split`), as the headers do.
    """

    def __init__(self, *, strip_timings: bool = False, split: Timings | None = None) -> None:
        self._strip = strip_timings
        self._split = split
        self._tail = b""
        self._last = b""  # the last event line with `timings`, unparsed
        self._parsed: tuple[bytes, dict[str, Any]] | None = None
        self.upstream_error: str | None = None
        # For a stream without `timings` (stock llama-server's Anthropic stream): the last
        # event lines with input and with output token `usage`, unparsed.
        self._usage_in = b""
        self._usage_out = b""
        self.opening: Reuse | None = None  # the first reuse numbers seen
        self.ready = False  # the headers can go (see the class doc)
        self.held = 0  # bytes fed before `ready`

    def feed(self, chunk: bytes) -> bytes:
        """Read the next chunk; the bytes to pass on now."""
        data = self._tail + chunk
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        if not self.ready:
            self.held += len(chunk)
        if not cut:
            self.ready = self.ready or self.held >= HOLD_MAX_BYTES
            return b""
        lines = data[:cut].split(b"\n")
        lines.pop()  # after the last newline: empty
        complete = False
        for k, line in enumerate(lines):
            if not line.startswith(b"data: "):
                continue
            complete = True
            if not line.startswith(b"data: {"):
                continue
            if b'"error"' in line:
                try:
                    obj = json.loads(line[6:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                    self.upstream_error = str(obj["error"].get("message", ""))
            has_timings = b'"timings"' in line
            if has_timings:
                self._last = line
            if b'"usage"' in line:
                if b'"input_tokens"' in line:
                    self._usage_in = line
                if b'"output_tokens"' in line:
                    self._usage_out = line
            if self.opening is None and (has_timings or b'"usage"' in line):
                with contextlib.suppress(ValueError):
                    self.opening = reuse_from(json.loads(line[6:]))
            if has_timings and self._strip and not _FINAL.search(line):
                lines[k] = _without_timings(line)
            if self._split is not None:
                lines[k] = split_line(lines[k], self._split)
        self.ready = self.ready or complete or self.held >= HOLD_MAX_BYTES
        return b"\n".join(lines) + b"\n"

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unfinished last line, as it came)."""
        tail, self._tail = self._tail, b""
        return tail

    def _last_event(self) -> dict[str, Any]:
        if self._parsed is None or self._parsed[0] is not self._last:
            try:
                obj = json.loads(self._last[6:]) if self._last else {}
            except ValueError:
                obj = {}
            self._parsed = (self._last, obj if isinstance(obj, dict) else {})
        return self._parsed[1]

    @property
    def timings(self) -> dict[str, Any] | None:
        """The `timings` of the last event that had them; without any, the reuse numbers
        of the stream's `usage` (`core.chat.usage_timings`)."""
        t = self._last_event().get("timings")
        if isinstance(t, dict):
            return t
        return stream_usage(self._usage_in, self._usage_out) if self._usage_in else None

    @property
    def id_slot(self) -> int | None:
        """The slot llama-server named in that event (raw completions name it)."""
        slot = self._last_event().get("id_slot")
        return slot if isinstance(slot, int) and slot >= 0 else None


_ID_SLOT_RE = re.compile(rb'"id_slot":\s*(\d+)')


def timings_from_json(data: bytes) -> tuple[dict[str, Any] | None, int | None]:
    """`timings` and `id_slot` of a completed response, without parsing all of it.

    Responses can be large (``/completion`` echoes the prompt); ``timings`` is a flat
    object of numbers, so it is cut out and parsed alone.
    """
    timings: dict[str, Any] | None = None
    start = data.rfind(b'"timings":')
    if start >= 0:
        begin = data.find(b"{", start)
        end = data.find(b"}", begin)
        if begin >= 0 and end > begin:
            try:
                parsed = json.loads(data[begin : end + 1])
            except ValueError:
                parsed = None
            timings = parsed if isinstance(parsed, dict) else None
    m = _ID_SLOT_RE.search(data)
    return timings, int(m.group(1)) if m else None


def stream_usage(input_line: bytes, output_line: bytes) -> dict[str, Any] | None:
    """Reuse numbers from a stream's `usage` event lines (``data: {…}``): Anthropic sends
    the input counts in ``message_start`` and the output count in ``message_delta``."""
    try:
        usage = apis.usage_timings(json.loads(input_line[6:]))
        out = json.loads(output_line[6:]) if output_line else {}
    except ValueError:
        return None
    if usage is None:
        return None
    inner = out.get("usage") if isinstance(out, dict) else None
    n = inner.get("output_tokens") if isinstance(inner, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and n > usage["predicted_n"]:
        usage["predicted_n"] = n
    return usage


def error_text(data: bytes) -> str:
    """The message of an upstream error body (its first 500 characters otherwise)."""
    try:
        obj = json.loads(data)
        return str(obj["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return data[:500].decode("utf-8", errors="replace")


# Seconds of silence before a waiting stream gets its first keep-alive, and between
# keep-alives: well under every agent's idle watchdog (Claude Code and Codex drop a
# stream silent for 300 s, opencode waits 300 s for the headers: docs/clients.md
# #timeouts), long enough that a stream whose prefill takes less still gets its
# headers with its reuse numbers.
KEEPALIVE_S = 20.0


def keepalive_event(endpoint: str) -> bytes:
    """What a stream waiting for llama-server's first event sends to show it is alive:
    Anthropic's own ``ping`` event on the Messages API (which its SDKs read and skip), an
    SSE comment line elsewhere (which every SSE parser skips: the OpenAI SDKs, Codex's)."""
    if endpoint == "messages":
        return b'event: ping\ndata: {"type": "ping"}\n\n'
    return b": keep-alive\n\n"


class Heartbeat:
    """Keeps a streamed request's client from giving up while the request waits before
    llama-server's first event — a restore and its verification, the stable prefix
    read alone, a long prefill.

    After `interval` seconds without a byte the response is opened (status 200 and the
    headers known then: `headers()`) and a `keepalive_event` is written, and again every
    `interval` s, until `stop` (the first upstream event, or an outcome). A stream opened
    this way has no reuse numbers in its headers (they come with the first event): the
    answer's own `timings`/`usage`, telemetry and `warmslot explain` still have them."""

    def __init__(
        self,
        request: web.Request,
        endpoint: str,
        headers: Callable[[], Mapping[str, str]],
        interval: float | None = None,
    ) -> None:
        self.response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.pings = 0
        self._request = request
        self._event = keepalive_event(endpoint)
        self._headers = headers
        self._interval = KEEPALIVE_S if interval is None else interval
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # the client is gone
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), self._interval)
                    return
                if not self.response.prepared:
                    self.response.headers.update(self._headers())
                    await self.response.prepare(self._request)
                await self.response.write(self._event)
                self.pings += 1

    async def stop(self) -> None:
        """No more keep-alives (the response stays open when it was opened)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopped.set()  # a keep-alive being written is finished first, never cut
        done, _ = await asyncio.wait({task}, timeout=self._interval)
        if not done:  # its write is stuck (a client that reads nothing)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def opened(self) -> bool:
        """Whether the client has the response's status and headers already."""
        return self.response.prepared
