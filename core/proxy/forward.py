"""Forward: the upstream leg of one request — POST it to llama-server, answer the client
(streamed through as it arrives, or whole), with the cache headers from the server's
own numbers; give up as soon as the client hangs up or the slot watchdog finds the
request's slot stalled; map what went wrong upstream to the client's error (a 502 with
its cause, a 400 for a history llama-server cannot read, a 503 while Warmslot stops)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from core import chat as apis
from core.config.sections import ProxySettings
from core.events import CacheEvent, CacheEventKind, Event
from core.proxy import context_limit
from core.proxy.accounting import Outcome, served
from core.proxy.checks import THREAD_BYTES
from core.proxy.errors import (
    context_error_response,
    error_response,
    history_error,
    invalid_response,
    not_ready_response,
    stalled_response,
    stopping_response,
    stream_error_event,
)
from core.proxy.headers import Reuse, cache_headers, reuse_from, safe_headers
from core.proxy.intake import off_loop
from core.proxy.split import split_body
from core.proxy.stream import SSEScanner, error_text, timings_from_json
from core.proxy.types import ProxyRequest
from core.server.client import send
from core.server.upstream import Upstream
from core.server.watchdog import BATCH_MARGIN, N_BATCH, SlotWatchdog, Stall, Watch
from core.telemetry.rates import PrefillRates

log = logging.getLogger("warmslot.proxy")

# Hop-by-hop and per-connection headers that must not be copied between legs.
_DROP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "content-encoding",
    "authorization",
    "x-api-key",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-connection",
    "accept-encoding",
}

# How often a request waiting on llama-server checks whether its client is still
# there: aiohttp has no callback for a peer that hangs up while nothing is written.
CLIENT_POLL_S = 0.25

# A whole answer's ``usage`` is read for its reuse numbers only below this size.
_USAGE_MAX_BYTES = 1 << 20


class _ClientGone(Exception):
    """The client disconnected before its response was complete."""


@dataclass
class _Exchange:
    """What outlives a cancelled exchange: its watch (core.server.watchdog) and, once the
    headers of its stream went out, that stream (a stall is told in it)."""

    watch: Watch | None
    stream: web.StreamResponse | None = None

    def moved(self) -> None:
        if self.watch is not None:
            self.watch.moved()


def _gone() -> Outcome:
    return Outcome(web.Response(status=499), 499, error="client disconnected")


async def client_gone(request: web.Request) -> None:
    """Return once the client of `request` has hung up."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(CLIENT_POLL_S)


def upstream_timeout(settings: ProxySettings) -> aiohttp.ClientTimeout:
    """One request's limits upstream (proxy.upstream_timeout_s, read each time)."""
    return aiohttp.ClientTimeout(total=settings.upstream_timeout_s, sock_connect=10)


def _encode(body: Any) -> bytes:
    return json.dumps(body).encode()


def _parse(data: bytes) -> object:
    """A whole answer as JSON; None when it is not JSON."""
    try:
        return json.loads(data)
    except ValueError:
        return None


class Forwarder:
    """Sends requests to llama-server and their answers back (one per proxy)."""

    def __init__(
        self,
        *,
        settings: Callable[[], ProxySettings],
        prefill_rates: PrefillRates,
        server_state: Callable[[], str],
        accepting: Callable[[], bool],
        emit: Callable[[Event], None],
    ) -> None:
        self._settings = settings
        self._rates = prefill_rates
        self._server_state = server_state
        self._accepting = accepting  # False once Warmslot stops: a lost answer is a 503
        self._emit = emit
        # One slot watchdog per server (core.server.watchdog), made on first use.
        self._watchdogs: weakref.WeakKeyDictionary[Upstream, SlotWatchdog] = (
            weakref.WeakKeyDictionary()
        )

    async def forward(
        self, request: web.Request, req: ProxyRequest, upstream: Upstream, t0: float
    ) -> Outcome:
        """Forward `req` to `upstream` and answer the client of `request` (`t0`: when
        handling began, for the time to first byte)."""
        out = await self._forward(request, req, upstream, t0)
        return await self._after_heartbeat(req, out) if req.heartbeat is not None else out

    async def _forward(
        self, request: web.Request, req: ProxyRequest, upstream: Upstream, t0: float
    ) -> Outcome:
        base = upstream.base_url
        if base is None:  # the server stopped between routing and now
            state = self._server_state()
            return Outcome(
                not_ready_response(state),
                503,
                error=f"llama-server is not ready (state: {state})",
            )
        # In flight while it runs, for the quarantine to find if the server crashes.
        quarantine = upstream.quarantine()
        token = quarantine.begin(req.body_digest) if quarantine is not None else None
        broke = True
        ex = _Exchange(self._watch(req, upstream))
        try:
            out = await self._exchange_unless_gone(request, req, upstream, base, t0, ex)
            # No answer: the server may have died of it — unless it never got there (the
            # server was already dead: a request beside the one that crashed it).
            broke = out.status == 502 and out.reached
        finally:
            if quarantine is not None and token is not None:
                quarantine.end(token, failed=broke)
            if ex.watch is not None:
                self._watchdog(upstream).end(ex.watch)
        return out

    async def _exchange_unless_gone(
        self,
        request: web.Request,
        req: ProxyRequest,
        upstream: Upstream,
        base: str,
        t0: float,
        ex: _Exchange,
    ) -> Outcome:
        """Forward the request, and give up on it as soon as the client hangs up.

        llama-server sends nothing while it reads a long prompt (minutes on a CPU), and
        for a non-streamed request nothing at all until the end; only closing the
        connection makes it drop the task and free the slot. So the client's socket
        is watched the whole time, and cancelling the exchange closes the upstream
        request whatever stage it is in (before its headers too). The same closing
        cancels a request whose slot the watchdog found stalled.
        """
        exchange = asyncio.ensure_future(self._exchange(request, req, upstream, base, t0, ex))
        watchers: list[asyncio.Future[Any]] = [asyncio.ensure_future(client_gone(request))]
        if ex.watch is not None:
            watchers.append(asyncio.ensure_future(ex.watch.fired()))
        try:
            await asyncio.wait((exchange, *watchers), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            exchange.cancel()  # the proxy is shutting down: the upstream request goes too
            raise
        finally:
            for w in watchers:
                w.cancel()
        if exchange.done():
            return exchange.result()
        exchange.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await exchange
        if ex.watch is not None and ex.watch.stall is not None:
            return await self._stalled(req, ex, ex.watch.stall)
        return _gone()

    def _watchdog(self, upstream: Upstream) -> SlotWatchdog:
        """The slot watchdog of `upstream`'s server (made on first use)."""
        dog = self._watchdogs.get(upstream)
        if dog is None:

            def floor_s() -> float:  # two prompt batches at the model's measured rate
                # Keyed as `served` keys what the accounting feeds.
                rate = self._rates.ms_per_token(upstream.served_model() or upstream.name)
                return BATCH_MARGIN * N_BATCH * rate / 1000 if rate else 0.0

            dog = SlotWatchdog(
                upstream.client, lambda: self._settings().stall_timeout_s, floor_s=floor_s
            )
            self._watchdogs[upstream] = dog
        return dog

    def _watch(self, req: ProxyRequest, upstream: Upstream) -> Watch | None:
        """Put a generation request under its server's slot watchdog (None: not a
        generation). Watched also while the setting is 0: it is read at every tick, so a
        change applies to the requests under way."""
        if not apis.ROUTES.get(req.path, ("", False))[1]:
            return None
        slot = req.body.get("id_slot") if isinstance(req.body, dict) else None
        pinned = (
            slot if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0 else None
        )
        return self._watchdog(upstream).watch(pinned)

    async def _stalled(self, req: ProxyRequest, ex: _Exchange, stall: Stall) -> Outcome:
        """Answer a request the watchdog cancelled: an error event ending its stream when
        the stream's headers went out, else a 504; both name the slot. Recorded as a
        ``slot_stalled`` event."""
        error = stall.text()
        message = f"Warmslot: {error}"
        self._emit(
            CacheEvent(
                kind=CacheEventKind.SLOT_STALLED,
                reason=error,
                slot=stall.slot,
                details={
                    "request_id": req.request_id,
                    "endpoint": req.endpoint,
                    "stalled_s": round(stall.seconds, 1),
                    "limit_s": stall.limit_s,
                    "seen": stall.seen,
                    "streamed": ex.stream is not None,
                },
            )
        )
        stream = ex.stream
        if stream is None:
            return Outcome(stalled_response(req.endpoint, message), 504, error=error)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await stream.write(stream_error_event(req.endpoint, message, 504))
            await stream.write_eof()
        return Outcome(stream, 504, error=error)

    async def _exchange(
        self,
        request: web.Request,
        req: ProxyRequest,
        upstream: Upstream,
        base: str,
        t0: float,
        ex: _Exchange,
    ) -> Outcome:
        """POST the request to llama-server and answer the client (streamed or whole)."""
        out_headers = {"Content-Type": "application/json"}
        for k, v in req.headers.items():
            if k not in _DROP_HEADERS and k != "content-type" and not k.startswith("x-warmslot"):
                out_headers[k] = v
        payload = await off_loop(_encode, req.body, big=req.body_bytes > THREAD_BYTES)
        try:
            # Sent again only when it provably did not go out (`core.server.client.send`).
            # One that went out and lost its connection before an answer raises
            # `RequestLost`, a 502 with that cause: llama-server may have run it, and a
            # generation must not run twice.
            async with await send(
                upstream.session,
                "POST",
                f"{base}{req.path}",
                data=payload,
                headers=out_headers,
                timeout=upstream_timeout(self._settings()),
                auto_decompress=False,
            ) as up:
                try:
                    if up.content_type == "text/event-stream" and up.status == 200:
                        return await self._stream(request, req, upstream, up, t0, ex)
                    data = await up.read()
                except asyncio.CancelledError:
                    up.close()  # never hand a half-read connection back to the pool
                    raise
                return await self._whole(req, upstream, up, data, t0)
        except _ClientGone:
            return _gone()
        except (aiohttp.ClientError, TimeoutError) as e:
            if not self._accepting():  # llama-server was stopped under it: Warmslot quits
                error = f"Warmslot stopped before llama-server answered ({e!r})"
                return Outcome(stopping_response(req.endpoint), 503, error=error)
            error = f"llama-server did not answer: {e!r}"
            log.warning("%s %s → 502: %s", req.endpoint, req.request_id, error)
            response = error_response(502, f"Warmslot: {error}", type_="server_error")
            reached = not isinstance(e, aiohttp.ClientConnectorError)
            return Outcome(response, 502, error=error, reached=reached)

    async def _whole(
        self,
        req: ProxyRequest,
        upstream: Upstream,
        up: aiohttp.ClientResponse,
        data: bytes,
        t0: float,
    ) -> Outcome:
        """Answer with a whole (non-streamed) response, read once: its `timings` (else
        its ``usage``), slot, reuse numbers and a context hit come from one parse at most."""
        ttfb = (time.perf_counter() - t0) * 1000
        timings: dict[str, Any] | None = None
        error = ""
        if up.status == 200:
            timings, slot = timings_from_json(data)  # cut out: no whole parse
            reuse = reuse_from({"timings": timings}) if timings is not None else None
            usage = b'"usage"' in data and len(data) < _USAGE_MAX_BYTES
            chat = req.endpoint in apis.CHAT_ENDPOINTS
            doc: object = context_limit.UNPARSED
            if (
                (timings is None and chat)
                or (reuse is None and usage)
                or context_limit.may_be_cut(data)
            ):
                doc = await off_loop(_parse, data)
            if timings is None and chat:
                timings = apis.usage_timings(doc)
                reuse = reuse_from({"timings": timings}) if timings is not None else None
            if reuse is None and usage:
                reuse = reuse_from(doc)
            if slot is not None:
                req.slot = slot
            self._add_cache_headers(req, upstream, reuse)
            hit = context_limit.warning_for(up.status, data, req.body, doc=doc)
            if req.split is not None:  # its numbers as the headers' (core.proxy.split)
                data = await off_loop(functools.partial(split_body, split=req.split), data)
        else:
            error = error_text(data)
            self._add_cache_headers(req, upstream, None)  # no numbers: "unknown", the ids
            # A 500 the request's own history causes is the client's to fix: a 400
            # that says so (a 5xx is retried, the same way, by agents).
            refused = history_error(req.endpoint, up.status, error, req.body)
            if refused is not None:
                log.warning("%s %s → 400: %s", req.endpoint, req.request_id, refused)
                headers = safe_headers(req.response_headers)
                response = invalid_response(req.endpoint, refused, headers)
                return Outcome(response, 400, None, ttfb, str(refused))
            hit = context_limit.warning_for(up.status, data, req.body)
        # A prompt or answer that hit the slot's context is named (core.proxy.context_limit).
        if hit is not None:
            context_limit.note(req.response_headers, hit)
            if hit.refused and hit.n_ctx:  # in the API's own words, with the sizes
                headers = safe_headers(req.response_headers)
                response = context_error_response(req.endpoint, hit.tokens, hit.n_ctx, headers)
                return Outcome(response, 400, None, ttfb, error)
        response = web.Response(
            body=data,
            status=up.status,
            content_type=up.content_type or "application/json",
            headers=safe_headers(req.response_headers),
        )
        return Outcome(response, up.status, timings, ttfb, error)

    async def _stream(
        self,
        request: web.Request,
        req: ProxyRequest,
        upstream: Upstream,
        up: aiohttp.ClientResponse,
        t0: float,
        ex: _Exchange,
    ) -> Outcome:
        """Pass an SSE response through chunk by chunk as it arrives, noting `timings`.

        The client's headers wait for the stream's first reuse numbers (`_open_stream`):
        llama-server sends its first event only once the prompt is read."""
        hb = req.heartbeat
        response = (
            hb.response
            if hb is not None
            else web.StreamResponse(
                status=200,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
        )
        # llama-server closes the connection after a stream (docs/llama-server-facts.md
        # #keep-alive), but aiohttp hands it back to the pool at the stream's last byte,
        # before the close arrives: the next request went out on it and was lost (a 502,
        # 1 in ~50 requests after a stream). Marked now, it is closed, never pooled.
        if up.connection is not None and up.connection.protocol is not None:
            up.connection.protocol.force_close()
        scanner = SSEScanner(strip_timings=req.strip_timings, split=req.split)
        held: list[bytes] = []  # what came before the headers could go
        ttfb: float | None = None
        status = 200
        error = ""
        try:
            async for chunk in up.content.iter_any():
                ex.moved()
                if ttfb is None:
                    ttfb = (time.perf_counter() - t0) * 1000
                    if hb is not None:  # llama-server speaks now: no more keep-alives
                        await hb.stop()
                        ex.stream = response if hb.opened else None
                out = scanner.feed(chunk)
                try:
                    if not response.prepared:
                        held.append(out)
                        if not scanner.ready:
                            continue
                        out, held = b"".join(held), []
                        await self._open_stream(request, req, upstream, response, scanner.opening)
                        ex.stream = response
                    if out:
                        await response.write(out)
                except (ConnectionError, RuntimeError) as e:
                    up.close()  # the client went away, not llama-server
                    raise _ClientGone from e
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
            # Upstream died mid-stream: end the client's stream cleanly with an error event.
            status = 502
            error = f"llama-server stopped mid-stream: {e!r}"
            log.warning("%s (request %s)", error, req.request_id)
            held.append(
                scanner.flush() + stream_error_event(req.endpoint, f"Warmslot: {error}", 502)
            )
        held.append(scanner.flush())
        if not response.prepared:  # the stream ended (or broke) before its first numbers
            reuse = scanner.opening or reuse_from({"timings": scanner.timings})
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self._open_stream(request, req, upstream, response, reuse)
        with contextlib.suppress(ConnectionError, RuntimeError):
            for chunk in held:
                if chunk:
                    await response.write(chunk)
            await response.write_eof()
        if scanner.id_slot is not None:
            req.slot = scanner.id_slot
        if scanner.upstream_error and not error:
            error = scanner.upstream_error
        return Outcome(response, status, scanner.timings, ttfb, error)

    async def _open_stream(
        self,
        request: web.Request,
        req: ProxyRequest,
        upstream: Upstream,
        response: web.StreamResponse,
        reuse: Reuse | None,
    ) -> None:
        """Send a stream's headers: the request's own and its cache headers."""
        self._add_cache_headers(req, upstream, reuse)
        response.headers.update(safe_headers(req.response_headers))
        await response.prepare(request)

    def early_headers(self, req: ProxyRequest, upstream: Upstream) -> dict[str, str]:
        """A kept-alive stream's headers, sent before its reuse numbers are known."""
        self._add_cache_headers(req, upstream, None)
        return safe_headers(req.response_headers)

    async def _after_heartbeat(self, req: ProxyRequest, out: Outcome) -> Outcome:
        """Stop a stream's keep-alives; an outcome that is not that stream (an error,
        a stall's 504) is told in it when its status and headers went out already."""
        hb = req.heartbeat
        assert hb is not None
        await hb.stop()
        if not hb.opened or out.response is hb.response:
            return out
        if out.status != 499:  # a client that hung up reads nothing
            message = f"Warmslot: {out.error or f'status {out.status}'}"
            with contextlib.suppress(ConnectionError, RuntimeError):
                await hb.response.write(stream_error_event(req.endpoint, message, out.status))
                await hb.response.write_eof()
        return dataclasses.replace(out, response=hb.response)

    def _add_cache_headers(
        self, req: ProxyRequest, upstream: Upstream, reuse: Reuse | None
    ) -> None:
        """The X-Warmslot-* cache headers from the server's reuse numbers (core.proxy.headers);
        a bypassed request keeps its ``X-Warmslot-Cache: bypass``."""
        rate = self._rates.ms_per_token(served(req, upstream))
        if reuse is not None and req.split is not None:
            reuse = reuse.with_split(req.split.prompt_n, req.split.prompt_ms)
        headers = cache_headers(
            reuse, slot=req.slot, session=req.decision.session, plan=req.plan, ms_per_token=rate
        )
        if req.response_headers.get("X-Warmslot-Cache") == "bypass":
            del headers["X-Warmslot-Cache"]
        headers["X-Warmslot-Request-Id"] = req.request_id  # for `warmslot explain ID`
        req.response_headers.update(headers)
