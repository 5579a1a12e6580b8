"""The OpenAI-compatible proxy in front of llama-server.

Each request is validated (malformed input gets a 4xx in OpenAI's error format
and nothing is forwarded), classified once by the router (`core.routing.router`: its
model, session, kind and why, in a frozen `Decision`), handed to the cache
policy (which may return a `SlotPlan`: the slot and its prefix), forwarded with
``cache_prompt: true``, streamed back without buffering, and recorded with its
reuse numbers. A failing cache policy never blocks a request:
the request goes through untouched and the failure is logged and recorded
(fail-open).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from core import chat as apis
from core.chat import ChatView
from core.config.checks import is_loopback
from core.config.keys import DEFAULT_USER, LOCAL_USER, KeyRing, presented_key
from core.errors import PortInUse
from core.events import CacheEvent, CacheEventKind, Event, RequestCompleted
from core.proxy import context_limit, tool_arguments
from core.proxy.checks import (
    THREAD_BYTES,
    Invalid,
    check_token_ids,
    crashed_before,
    host_name,
    is_json_type,
    origin_allowed,
    parse_json,
    token_ids,
    validate,
)
from core.proxy.errors import (
    auth_response,
    context_error_response,
    error_response,
    history_error,
    invalid_response,
    stalled_response,
    stream_error_event,
    unavailable_response,
)
from core.proxy.headers import (
    Reuse,
    cache_headers,
    reuse_from,
    reuse_in_body,
    safe_headers,
    stream_body,
)
from core.proxy.metrics import CONTENT_TYPE as METRICS_TYPE
from core.proxy.split import split_body
from core.proxy.stream import (
    Heartbeat,
    SSEScanner,
    error_text,
    stream_usage,
    timings_from_json,
    usage_in_body,
)
from core.proxy.types import Admit, CachePolicy, CacheService, ProxyRequest, Route
from core.routing.router import Decision, Refused, Router, metadata_session, session_key
from core.server.client import Timings, send
from core.server.quarantine import body_digest
from core.server.upstream import Upstream
from core.server.watchdog import BATCH_MARGIN, N_BATCH, SlotWatchdog, Stall, Watch
from core.status import (
    Explanation,
    ModelList,
    Status,
)
from core.telemetry import safe_text
from core.telemetry.rates import PrefillRates

# What callers import from here; the request types, error responses and response
# reading live in core.proxy.types, core.proxy.errors and core.proxy.stream.
__all__ = [
    "CLIENT_POLL_S",
    "GET_ROUTES",
    "JSON_ROUTES",
    "Admit",
    "CachePolicy",
    "CacheService",
    "Proxy",
    "ProxyCounters",
    "ProxyRequest",
    "Route",
    "SSEScanner",
    "auth_response",
    "error_response",
    "invalid_response",
    "stream_usage",
    "timings_from_json",
    "usage_in_body",
]

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

# path → (endpoint kind, generation?): the wire APIs are `core.chat`'s to know.
JSON_ROUTES: dict[str, tuple[str, bool]] = apis.ROUTES
GET_ROUTES = ("/v1/models", "/models", "/health", "/v1/health", "/props", "/slots")


_T = TypeVar("_T")


async def _off_loop(fn: Callable[..., _T], arg: Any, *, big: bool | None = None) -> _T:
    """`fn(arg)`, on a worker thread when `arg` is a large body (`big`, or for bytes
    their length): parsing or encoding megabytes must not stall the event loop."""
    if big is None:
        big = isinstance(arg, bytes | bytearray) and len(arg) > THREAD_BYTES
    if big:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)


def _encode(body: Any) -> bytes:
    return json.dumps(body).encode()


# Endpoints whose completed requests the cache policy hears about.
_MANAGED = (*apis.CHAT_ENDPOINTS, "completions", "completion")


class _ClientGone(Exception):
    """The client disconnected before its response was complete."""


# What a request that comes while Warmslot is stopping is told: retry in this many
# seconds (a Warmslot relaunched at once is up by then, or on its way).
STOPPING_RETRY_S = 5
STOPPING_TEXT = "Warmslot is shutting down; the request was not run: retry shortly"

# How often a request waiting on llama-server checks whether its client is still
# there: aiohttp has no callback for a peer that hangs up while nothing is written.
CLIENT_POLL_S = 0.25


@dataclass
class _Outcome:
    """What came of forwarding one request: the client's response and what to record."""

    response: web.StreamResponse
    status: int
    timings: dict[str, Any] | None = None
    ttfb: float | None = None
    error: str = ""


@dataclass
class _Exchange:
    """What outlives a cancelled exchange: its watch (core.server.watchdog) and, once the
    headers of its stream went out, that stream (a stall is told in it)."""

    watch: Watch | None
    stream: web.StreamResponse | None = None

    def moved(self) -> None:
        if self.watch is not None:
            self.watch.moved()


def _gone() -> _Outcome:
    return _Outcome(web.Response(status=499), 499, error="client disconnected")


async def _client_gone(request: web.Request) -> None:
    """Return once the client of `request` has hung up."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(CLIENT_POLL_S)


@dataclass
class ProxyCounters:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    bypasses: int = 0


class Proxy:
    """The aiohttp application plus its runner. Runs on the core's loop."""

    def __init__(
        self,
        *,
        upstream: Upstream,
        server_state: Callable[[], str],
        n_slots: Callable[[], int],
        emit: Callable[[Event], None],
        api_key: Callable[[], str],
        max_body_mb: Callable[[], int],
        upstream_timeout_s: Callable[[], float],
        status: Callable[[], Awaitable[Status]],
        metrics: Callable[[], bytes] | None = None,
        policy: CachePolicy | None = None,
        allowed_origins: Callable[[], Sequence[str]] = lambda: (),
        keys: KeyRing | None = None,
        prefill_rates: PrefillRates | None = None,
    ) -> None:
        self._upstream = upstream
        # Who may call: named keys, proxy.api_key as "default" (core.keys).
        self._keys = keys if keys is not None else KeyRing(None, api_key)
        self._allowed_origins = allowed_origins
        # Read per request, so a changed setting applies to the next one.
        self._max_body_mb = max_body_mb
        self._upstream_timeout_s = upstream_timeout_s
        self._server_state = server_state
        self._n_slots = n_slots
        self._emit = emit
        self._status = status
        self._metrics = metrics  # the exposition /metrics serves (core.proxy.metrics)
        self.policy = policy
        # The one place that classifies. Single-model mode: a router of one. A model pool
        # sets its own router (by the `model` field) and answers GET /v1/models with the
        # configured profiles. `admit` is the core's server set (`core.models.servers`:
        # starts, loads or waits for the decided server); a proxy made alone sends every
        # request to `upstream` once it is ready.
        self.router: Router = Router.single(upstream)
        self.admit: Admit = self._admit_one
        self.models: Callable[[], ModelList] | None = None
        # A request's explanation by id (None: the latest), for `warmslot explain`.
        self.explain: Callable[[str | None], Awaitable[Explanation | None]] | None = None
        # Take Claude Code's attribution line out of /v1/messages bodies (setting
        # proxy.strip_billing_header; core.chat.strip_billing_header).
        self.strip_billing_header: Callable[[], bool] = lambda: True
        # Close history tool calls whose arguments are not JSON (setting
        # proxy.repair_tool_arguments; core.proxy.tool_arguments).
        self.repair_tool_arguments: Callable[[], bool] = lambda: True
        # Seconds a request's slot may make no progress before it is cancelled (setting
        # proxy.stall_timeout_s; 0: never); one watchdog per server (core.server.watchdog).
        self.stall_timeout_s: Callable[[], float] = lambda: 0.0
        self._watchdogs: weakref.WeakKeyDictionary[Upstream, SlotWatchdog] = (
            weakref.WeakKeyDictionary()
        )
        self.counters = ProxyCounters()
        # Per model profile ("" for the primary): the cold prefill rate seen so far, which
        # prices the cached tokens in X-Warmslot-Est-Saved-Ms (and, read by the cache,
        # explanations and restore decisions).
        self.prefill_rates = prefill_rates if prefill_rates is not None else PrefillRates()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._inflight: set[asyncio.Task[Any]] = set()
        # The requests being handled (a future each, done when its handler returns), so
        # that a shutdown lets them finish; after `stop_accepting` new ones get a 503.
        self._requests: set[asyncio.Future[None]] = set()
        self._accepting = True
        # For "is now a quiet moment?" (switching to a new server build): requests being
        # handled, and when the last one ended.
        self._active = 0
        self._last_done = time.monotonic()
        # The body limit is `_read_body`'s, read per request; aiohttp's own applies only
        # to `request.read()`, which the proxy never calls: set to the setting's ceiling.
        self.app = web.Application(client_max_size=1024 * 1024 * 1024, middlewares=[self._guard])
        for path in JSON_ROUTES:
            self.app.router.add_post(path, self._handle_json)
        for path in GET_ROUTES:
            self.app.router.add_get(path, self._handle_get)
        self.app.router.add_get("/warmslot/status", self._handle_status)
        self.app.router.add_get("/warmslot/explain", self._handle_explain)
        self.app.router.add_get("/metrics", self._handle_metrics)
        self.host = ""
        self.port = 0

    def _timeout(self) -> aiohttp.ClientTimeout:
        """One request's limits upstream (proxy.upstream_timeout_s, read each time)."""
        return aiohttp.ClientTimeout(total=self._upstream_timeout_s(), sock_connect=10)

    # -------------------------------------------------------------- lifecycle
    async def start(self, host: str, port: int) -> None:
        """Bind and start serving; raises PortInUse if the port is taken."""
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=5.0,
            # aiohttp's own errors (a request it cannot parse, answered 400 by it) go
            # to warmslot.log with everything else, not to stderr.
            logger=logging.getLogger("warmslot.proxy.http"),
        )
        await self._runner.setup()
        try:
            self._site = await self._listen(host, port)
        except PortInUse:
            await self._runner.cleanup()
            raise
        log.info("proxy listening on http://%s:%d", self.host, self.port)

    async def _listen(self, host: str, port: int) -> web.TCPSite:
        assert self._runner is not None
        # SO_REUSEADDR on POSIX: a restart right after clients were connected must not
        # fail on the old connections' TIME_WAIT; a second live listener is still refused
        # there (that needs SO_REUSEPORT). On Windows the flag would allow exactly that.
        site = web.TCPSite(self._runner, host, port, reuse_address=os.name == "posix")
        before = set(map(tuple, self._runner.addresses))
        try:
            await site.start()
        except OSError as e:
            raise PortInUse(
                f"proxy port {host}:{port} is already in use ({e.strerror})",
                hint="is another Warmslot running? `warmslot status` tells; or set proxy.port",
            ) from e
        # (host, port, …) of the socket(s) this site added: the port when `port` was 0
        new = [a for a in self._runner.addresses if tuple(a) not in before]
        self.host = host
        self.port = int(new[0][1]) if new else port
        return site

    async def rebind(self, host: str, port: int) -> None:
        """Listen on a new address: the new one first (PortInUse leaves the old one
        serving), then the old one stops accepting; requests under way finish."""
        old_host, old_port, old = self.host, self.port, self._site
        try:
            self._site = await self._listen(host, port)
        except PortInUse:
            self.host, self.port = old_host, old_port
            raise
        if old is not None:
            await old.stop()
        log.info("proxy moved to http://%s:%d", self.host, self.port)

    def stop_accepting(self) -> None:
        """Shutdown's first stage: every request from now on is answered 503 with
        Retry-After in its API's error shape while the socket stays open, so a client
        gets an answer it can act on instead of a refused or reset connection. Requests
        under way go on; `drain` waits for them."""
        self._accepting = False

    async def stop(self) -> None:
        """Close the listening socket and what connections are left (shutdown's last
        stage, after `drain` and once llama-server is stopped: a handler still running
        gets aiohttp's 5 s, then is cancelled).

        The upstream sessions are not the proxy's: whoever made them closes them.
        """
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --------------------------------------------------------------- helpers
    def _user(self, request: web.Request) -> str | None:
        """Who calls: the name of the key the request carries ("" when no key is
        configured and the proxy listens on loopback); None when it is refused."""
        if not self._keys.required():
            # Beyond loopback with no key left (all removed while running): nobody.
            return "" if not self.host or is_loopback(self.host) else None
        return self._keys.user_for(safe_text(presented_key(request.headers)))

    def _auth_error(self, request: web.Request, endpoint: str = "") -> web.Response | None:
        """401 in the API's own error shape when the request carries no valid key."""
        return auth_response(endpoint) if self._user(request) is None else None

    async def _admit_one(self, _decision: Decision) -> Route:
        """The admission of a proxy made alone: its one upstream, when it is ready."""
        if self._upstream.base_url is None:
            state = self._server_state()
            error = f"Warmslot: llama-server is not ready (state: {state}); retry shortly"
            return Route(status=503, error=error, retry_after=2)
        return Route(upstream=self._upstream, policy=self.policy)

    def _not_ready(self) -> web.Response | None:
        if self._upstream.base_url is not None:
            return None
        state = self._server_state()
        return error_response(
            503,
            f"Warmslot: llama-server is not ready (state: {state}); retry shortly",
            type_="unavailable_error",
            headers={"Retry-After": "2"},
        )

    def _refusal(self, request: web.Request) -> web.Response | None:
        """403 for a foreign Host or Origin, 415 for a POST body that is not JSON.

        A web page must not be able to use the proxy: DNS rebinding reaches it under
        the attacker's name (the Host header says so), and a cross-site form or fetch
        carries its page's Origin. Both are refused before anything else is read.
        """
        host = host_name(safe_text(request.headers.get("Host", "")))
        # The configured API key vouches for a client that reached a non-loopback bind
        # under some other name of this machine; a browser never has the key.
        foreign = bool(host) and not is_loopback(host) and host != self.host.lower()
        if foreign and not (self._keys.required() and self._user(request) is not None):
            return error_response(
                403,
                f"Warmslot: Host {host!r} is not this proxy's address (loopback or "
                f"{self.host}); requests under other names are refused (DNS rebinding)",
                type_="permission_error",
            )
        # Every Origin header: a second one must not slip past behind an allowed first.
        origin = next(
            (
                o
                for o in request.headers.getall("Origin", ())
                if not origin_allowed(safe_text(o), self._allowed_origins())
            ),
            None,
        )
        if origin is not None:
            return error_response(
                403,
                f"Warmslot: requests from web pages at {safe_text(origin)!r} are refused; "
                "allow an origin with `warmslot config set proxy.allowed_origins`",
                type_="permission_error",
            )
        if request.method == "POST" and request.path in JSON_ROUTES:
            ctype = request.headers.get("Content-Type")
            # No Content-Type is accepted: scripts posting a JSON string (Python
            # requests' data=, httpx's content=) send none, and a browser cannot post
            # without one unless it also sends an Origin, refused above.
            if ctype is not None and not is_json_type(safe_text(ctype)):
                return error_response(
                    415,
                    f"Warmslot: the body must be JSON (Content-Type: application/json), "
                    f"not {safe_text(ctype)[:100]!r}",
                )
        return None

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Who may call (`_refusal`), and a logged 500 for anything a handler did not expect."""
        if refused := self._refusal(request):
            return refused
        if not self._accepting:
            return self._stopping(JSON_ROUTES.get(request.path, ("", False))[0])
        done = asyncio.get_running_loop().create_future()
        self._requests.add(done)
        try:
            return await handler(request)
        except web.HTTPException:
            raise  # aiohttp's own answers: 404 for unknown paths, 405 for bad methods
        except Exception:
            log.exception("unexpected error handling %s %s", request.method, request.path)
            return error_response(
                500,
                "Warmslot: internal error handling this request (details in warmslot.log)",
                type_="server_error",
            )
        finally:
            self._requests.discard(done)
            done.set_result(None)

    def _stopping(self, endpoint: str) -> web.Response:
        return unavailable_response(endpoint, f"Warmslot: {STOPPING_TEXT}", STOPPING_RETRY_S)

    # --------------------------------------------------------------- handlers
    async def _handle_get(self, request: web.Request) -> web.StreamResponse:
        if request.path not in ("/health", "/v1/health") and (err := self._auth_error(request)):
            return err
        if self.models is not None and request.path in ("/v1/models", "/models"):
            return web.json_response(self.models())
        if err := self._not_ready():
            return err
        url = f"{self._upstream.base_url}{request.path_qs}"
        try:
            async with self._upstream.session.get(
                url, timeout=self._timeout(), auto_decompress=False
            ) as resp:
                body = await resp.read()
                return web.Response(body=body, status=resp.status, content_type=resp.content_type)
        except (aiohttp.ClientError, TimeoutError) as e:
            return error_response(
                502, f"Warmslot: llama-server did not answer: {e!r}", type_="server_error"
            )

    async def _handle_status(self, request: web.Request) -> web.StreamResponse:
        if err := self._auth_error(request):
            return err
        return web.json_response(await self._status(), dumps=lambda o: json.dumps(o, default=str))

    async def _handle_explain(self, request: web.Request) -> web.StreamResponse:
        """GET /warmslot/explain[?id=REQUEST_ID]: why a request reused what it did."""
        if err := self._auth_error(request):
            return err
        rid = safe_text(request.query.get("id", "")) or None
        found = await self.explain(rid) if self.explain is not None else None
        if found is None:
            what = f"request {rid!r}" if rid else "any request yet"
            return error_response(
                404, f"Warmslot: no explanation for {what}", type_="not_found_error"
            )
        return web.json_response(found, dumps=lambda o: json.dumps(o, default=str))

    async def _handle_metrics(self, request: web.Request) -> web.StreamResponse:
        if err := self._auth_error(request):
            return err
        if self._metrics is None:
            return error_response(404, "Warmslot: no metrics here", type_="not_found_error")
        return web.Response(body=self._metrics(), headers={"Content-Type": METRICS_TYPE})

    def idle_for(self) -> float | None:
        """Seconds since the last generation request ended; None while one runs."""
        if self._active:
            return None
        return time.monotonic() - self._last_done

    @property
    def settled(self) -> bool:
        """No request is being handled and the cache has heard of every one that ended
        (its `completed` ran): what "idle" means to a caller that waits for the
        bookkeeping after a response, e.g. a test or a benchmark between requests."""
        return not self._active and not self._inflight

    async def _handle_json(self, request: web.Request) -> web.StreamResponse:
        self._active += 1
        try:
            return await self._handle_json_counted(request)
        finally:
            self._active -= 1
            self._last_done = time.monotonic()

    async def _handle_json_counted(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        endpoint, generation = JSON_ROUTES[request.path]
        user = self._user(request)
        if user is None:
            return auth_response(endpoint)
        try:
            raw = await self._read_body(request)
            body = await _off_loop(parse_json, raw)
            validate(endpoint, body, self._n_slots())
        except Invalid as e:
            return invalid_response(endpoint, e)
        # Header values that are not text (non-UTF-8 bytes, which aiohttp passes on as
        # lone surrogates) become U+FFFD here, before any of them reaches the router's
        # Decision, a session key, an event or the telemetry database (issue 19).
        headers = {safe_text(k.lower()): safe_text(v) for k, v in request.headers.items()}
        edits: tuple[str, ...] = ()
        # Claude Code's attribution line: its stamp changes with each session, so a new
        # session's prompt would leave every slot at the system text's first token
        # (docs/clients.md#claude-code).
        strip = endpoint == "messages" and self.strip_billing_header()
        if strip and apis.strip_billing_header(body):
            edits = (apis.BILLING_HEADER_EDIT,)
        # A tool call cut short in the history makes llama-server fail every later request
        # of the conversation (docs/clients.md#errors-from-the-history).
        if endpoint in ("chat", "responses") and self.repair_tool_arguments():
            repair = functools.partial(tool_arguments.repair, endpoint)
            if repaired := await _off_loop(repair, body, big=len(raw) > THREAD_BYTES):
                log.info("%s: closed %s", endpoint, "; ".join(r.text for r in repaired))
                edits += (tool_arguments.REPAIR_EDIT,)
        chat = await self._chat_view(endpoint, body, len(raw))
        decision = self.router.decide(endpoint, headers, body, chat)
        if isinstance(decision, Refused):
            return error_response(
                decision.status, decision.error, type_="not_found_error", param="model"
            )
        # Each user's sessions are their own: the same session id (or the same derived
        # one) from two users must not share a slot or a row in the accounting.
        ns = f"{user}/" if user not in ("", DEFAULT_USER, LOCAL_USER) else ""
        if ns and decision.session:
            decision = dataclasses.replace(decision, session=ns + decision.session)
        named = session_key(headers) or metadata_session(chat.user_id if chat else "")
        req = ProxyRequest(
            request_id=uuid.uuid4().hex[:16],
            path=request.path,
            endpoint=endpoint,
            client=decision.client,
            user_agent=headers.get("user-agent", ""),
            # The session the client names: a header, or Claude Code's metadata.user_id.
            session=ns + named if named else "",
            headers=headers,
            body=body,
            stream=bool(body.get("stream", False)),
            has_tools=bool(chat.tools) if chat is not None else bool(body.get("tools")),
            decision=decision,
            upstream=decision.upstream or self._upstream,
            policy=self.policy,
            body_bytes=len(raw),
            body_digest=await _off_loop(body_digest, raw),
            raw_body=raw if generation else None,
            chat=chat,
            edits=edits,
            user=user,
        )
        if edits:
            req.response_headers["X-Warmslot-Edited"] = ",".join(edits)
        req.chat = chat  # None also for a chat body that failed to convert (fail-open)
        del raw  # req.raw_body holds it while it is needed
        route = await self.admit(decision)
        if route.error:
            retry = {"Retry-After": str(route.retry_after)} if route.retry_after else None
            return error_response(
                route.status,
                route.error,
                type_="not_found_error" if route.status == 404 else "unavailable_error",
                param="model" if route.status == 404 else None,
                headers=retry,
            )
        req.model, req.upstream, req.policy = route.model, route.upstream, route.policy
        if route.load_ms is not None:  # its server started (or loaded) for it first
            req.response_headers["X-Warmslot-Load-Ms"] = f"{route.load_ms:.0f}"
        if route.model:  # a pooled model's name
            req.response_headers["X-Warmslot-Model"] = route.model
        if decision.backend:  # several backends: which one served it
            req.response_headers["X-Warmslot-Backend"] = decision.backend
        try:
            return await self._prepare_and_forward(request, req, generation, t0)
        finally:
            if route.release is not None:
                route.release()

    async def _chat_view(self, endpoint: str, body: Any, nbytes: int) -> ChatView | None:
        """The request's chat view (`core.chat.chat_view`), off the loop for a large body.
        A conversion that fails leaves the request to the server as it is (fail-open):
        logged and recorded as a bypass; llama-server answers whatever it makes of it."""
        if endpoint not in apis.CHAT_ENDPOINTS:
            return None
        try:
            return await _off_loop(
                functools.partial(apis.chat_view, endpoint), body, big=nbytes > THREAD_BYTES
            )
        except apis.ConversionError as e:
            # Not a cache failure: llama-server refuses the body too, in its own words.
            log.info("%s request not read as chat (%s); forwarded as it is", endpoint, e)
            return None
        except Exception as e:
            log.exception("could not read a %s request as chat; forwarding it untouched", endpoint)
            self.counters.bypasses += 1
            self._emit(
                CacheEvent(
                    kind=CacheEventKind.BYPASS,
                    reason=f"{endpoint} request not read as chat: {e!r}"[:300],
                    details={"endpoint": endpoint},
                )
            )
            return None

    async def _read_body(self, request: web.Request) -> bytearray:
        """The (decoded) body, at most `max_body_mb`; raises Invalid (413, 400).

        Read into one growing buffer — `json.loads` takes it as it is — instead of
        aiohttp's `read()`, which joins chunks and then copies the result.
        """
        limit = self._max_body_mb() * 1024 * 1024
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

    async def _prepare_and_forward(
        self, request: web.Request, req: ProxyRequest, generation: bool, t0: float
    ) -> web.StreamResponse:
        body = req.body
        # A body that crashed this server is not sent again (core.server.quarantine).
        quarantine = (req.upstream or self._upstream).quarantine()
        if quarantine is not None and (hit := quarantine.refusal(req.body_digest)) is not None:
            return invalid_response(req.endpoint, crashed_before(hit, quarantine.clock()))
        if checked := await self._check_token_ids(req):
            return checked
        if generation and req.stream:  # silent until llama-server's first event: kept alive
            req.heartbeat = Heartbeat(request, req.endpoint, lambda: self._early_headers(req))
        if generation:
            body.setdefault("cache_prompt", True)
            if req.policy is not None:
                req.gone = lambda: _client_gone(request)
                try:
                    req.plan = await req.policy.prepare(req)
                except Exception as e:  # fail-open: the request goes through untouched
                    log.exception("cache policy failed; forwarding the request untouched")
                    self.counters.bypasses += 1
                    # The client's own bytes, parsed again: no copy kept for this case.
                    assert req.raw_body is not None
                    req.body = await _off_loop(parse_json, req.raw_body)
                    req.body.setdefault("cache_prompt", True)
                    req.edits = ()  # the client's own body, unedited too
                    req.response_headers.pop("X-Warmslot-Edited", None)
                    req.slot = None
                    req.plan = None
                    req.response_headers["X-Warmslot-Cache"] = "bypass"
                    self._emit(
                        CacheEvent(
                            kind=CacheEventKind.BYPASS,
                            reason=f"cache manager failed: {e!r}",
                            details={"request_id": req.request_id},
                        )
                    )
        req.raw_body = None
        if generation:
            # The first streamed event carries the reuse numbers; what the client did not
            # ask for is taken out again on the way back.
            req.strip_timings = stream_body(req.endpoint, req.body)
        return await self._forward(request, req, t0)

    async def _check_token_ids(self, req: ProxyRequest) -> web.Response | None:
        """A 400 for /tokenize or /detokenize ids outside the vocabulary of the server the
        request goes to (asked once per server run, only for bodies that hold ids)."""
        if not token_ids(req.endpoint, req.body):
            return None
        n_vocab = await (req.upstream or self._upstream).n_vocab()
        try:
            if n_vocab is not None:
                check_token_ids(req.endpoint, req.body, n_vocab)
        except Invalid as e:
            return invalid_response(req.endpoint, e)
        return None

    async def _forward(
        self, request: web.Request, req: ProxyRequest, t0: float
    ) -> web.StreamResponse:
        upstream = req.upstream or self._upstream
        base = upstream.base_url
        if base is None:  # the server stopped between routing and now
            state = self._server_state()
            error = f"llama-server is not ready (state: {state})"
            out = _Outcome(
                error_response(
                    503,
                    f"Warmslot: {error}; retry shortly",
                    type_="unavailable_error",
                    headers={"Retry-After": "2"},
                ),
                503,
                error=error,
            )
        else:
            # In flight while it runs, for the quarantine to find if the server crashes.
            quarantine = upstream.quarantine()
            token = quarantine.begin(req.body_digest) if quarantine is not None else None
            broke = True
            ex = _Exchange(self._watch(req, upstream))
            try:
                out = await self._exchange_unless_gone(request, req, upstream, base, t0, ex)
                broke = out.status == 502  # no answer: the server may have died of it
            finally:
                if quarantine is not None and token is not None:
                    quarantine.end(token, failed=broke)
                if ex.watch is not None:
                    self._watchdog(upstream).end(ex.watch)
        if req.heartbeat is not None:
            out = await self._after_heartbeat(req, out)
        total_ms = (time.perf_counter() - t0) * 1000
        parsed = Timings.parse(out.timings)
        if parsed is not None:
            parsed = parsed.with_split(req.split)
        self._account(req, out.status, parsed, out.ttfb, total_ms, out.error)
        if req.policy is not None and req.endpoint in _MANAGED:
            task = asyncio.ensure_future(self._completed(req, parsed, out.status))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        return out.response

    async def _exchange_unless_gone(
        self,
        request: web.Request,
        req: ProxyRequest,
        upstream: Upstream,
        base: str,
        t0: float,
        ex: _Exchange,
    ) -> _Outcome:
        """Forward the request, and give up on it as soon as the client hangs up.

        llama-server sends nothing while it reads a long prompt (minutes on a CPU), and
        for a non-streamed request nothing at all until the end; only closing the
        connection makes it drop the task and free the slot. So the client's socket
        is watched the whole time, and cancelling the exchange closes the upstream
        request whatever stage it is in (before its headers too: issue 19). The same
        closing cancels a request whose slot the watchdog found stalled.
        """
        exchange = asyncio.ensure_future(self._exchange(request, req, upstream, base, t0, ex))
        watchers: list[asyncio.Future[Any]] = [asyncio.ensure_future(_client_gone(request))]
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
                # Keyed as `_served` keys what `_account` feeds.
                rate = self.prefill_rates.ms_per_token(upstream.served_model() or upstream.name)
                return BATCH_MARGIN * N_BATCH * rate / 1000 if rate else 0.0

            dog = SlotWatchdog(upstream.client, self.stall_timeout_s, floor_s=floor_s)
            self._watchdogs[upstream] = dog
        return dog

    def _watch(self, req: ProxyRequest, upstream: Upstream) -> Watch | None:
        """Put a generation request under its server's slot watchdog (None: not a
        generation). Watched also while the setting is 0: it is read at every tick, so a
        change applies to the requests under way."""
        if not JSON_ROUTES.get(req.path, ("", False))[1]:
            return None
        slot = req.body.get("id_slot") if isinstance(req.body, dict) else None
        pinned = (
            slot if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0 else None
        )
        return self._watchdog(upstream).watch(pinned)

    async def _stalled(self, req: ProxyRequest, ex: _Exchange, stall: Stall) -> _Outcome:
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
            return _Outcome(stalled_response(req.endpoint, message), 504, error=error)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await stream.write(stream_error_event(req.endpoint, message, 504))
            await stream.write_eof()
        return _Outcome(stream, 504, error=error)

    async def _exchange(
        self,
        request: web.Request,
        req: ProxyRequest,
        upstream: Upstream,
        base: str,
        t0: float,
        ex: _Exchange,
    ) -> _Outcome:
        """POST the request to llama-server and answer the client (streamed or whole)."""
        out_headers = {"Content-Type": "application/json"}
        for k, v in req.headers.items():
            if k not in _DROP_HEADERS and k != "content-type" and not k.startswith("x-warmslot"):
                out_headers[k] = v
        payload = await _off_loop(_encode, req.body, big=req.body_bytes > THREAD_BYTES)
        try:
            async with await self._post_upstream(
                upstream, f"{base}{req.path}", payload, out_headers
            ) as up:
                try:
                    if up.content_type == "text/event-stream" and up.status == 200:
                        return await self._stream(request, req, up, t0, ex)
                    data = await up.read()
                except asyncio.CancelledError:
                    up.close()  # never hand a half-read connection back to the pool
                    raise
                ttfb = (time.perf_counter() - t0) * 1000
                timings: dict[str, Any] | None = None
                error = ""
                if up.status == 200:
                    timings, slot = timings_from_json(data)
                    if timings is None and req.endpoint in apis.CHAT_ENDPOINTS:
                        timings = await _off_loop(usage_in_body, data)
                    if slot is not None:
                        req.slot = slot
                    self._add_cache_headers(req, reuse_in_body(data, timings))
                else:
                    error = error_text(data)
                    self._add_cache_headers(req, None)  # no numbers: "unknown", the ids
                    # A 500 the request's own history causes is the client's to fix: a 400
                    # that says so (a 5xx is retried, the same way, by agents).
                    refused = history_error(req.endpoint, up.status, error, req.body)
                    if refused is not None:
                        log.warning("%s %s → 400: %s", req.endpoint, req.request_id, refused)
                        headers = safe_headers(req.response_headers)
                        response = invalid_response(req.endpoint, refused, headers)
                        return _Outcome(response, 400, None, ttfb, str(refused))
                # A prompt or answer that hit the slot's context is named (issue 16, 0e).
                if (hit := context_limit.warning_for(up.status, data, req.body)) is not None:
                    context_limit.note(req.response_headers, hit)
                    if hit.refused and hit.n_ctx:  # in the API's own words, with the sizes
                        headers = safe_headers(req.response_headers)
                        response = context_error_response(
                            req.endpoint, hit.tokens, hit.n_ctx, headers
                        )
                        return _Outcome(response, 400, None, ttfb, error)
                if up.status == 200 and req.split is not None:  # its numbers as the headers'
                    data = await _off_loop(functools.partial(split_body, split=req.split), data)
                response = web.Response(
                    body=data,
                    status=up.status,
                    content_type=up.content_type or "application/json",
                    headers=safe_headers(req.response_headers),
                )
                return _Outcome(response, up.status, timings, ttfb, error)
        except _ClientGone:
            return _gone()
        except (aiohttp.ClientError, TimeoutError) as e:
            if not self._accepting:  # llama-server was stopped under it: Warmslot is quitting
                error = f"Warmslot stopped before llama-server answered ({e!r})"
                return _Outcome(self._stopping(req.endpoint), 503, error=error)
            error = f"llama-server did not answer: {e!r}"
            log.warning("%s %s → 502: %s", req.endpoint, req.request_id, error)
            response = error_response(502, f"Warmslot: {error}", type_="server_error")
            return _Outcome(response, 502, error=error)

    async def _post_upstream(
        self, upstream: Upstream, url: str, payload: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST to llama-server; sent again only when it provably did not go out
        (`core.server.client.send`). One that went out and lost its connection before an
        answer raises `RequestLost`, which the client gets as a 502 with that cause:
        llama-server may have run it, and a generation must not run twice."""
        return await send(
            upstream.session,
            "POST",
            url,
            data=payload,
            headers=headers,
            timeout=self._timeout(),
            auto_decompress=False,
        )

    async def _stream(
        self,
        request: web.Request,
        req: ProxyRequest,
        up: aiohttp.ClientResponse,
        t0: float,
        ex: _Exchange,
    ) -> _Outcome:
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
                        await self._open_stream(request, req, response, scanner.opening)
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
                await self._open_stream(request, req, response, reuse)
        with contextlib.suppress(ConnectionError, RuntimeError):
            for chunk in held:
                if chunk:
                    await response.write(chunk)
            await response.write_eof()
        if scanner.id_slot is not None:
            req.slot = scanner.id_slot
        if scanner.upstream_error and not error:
            error = scanner.upstream_error
        return _Outcome(response, status, scanner.timings, ttfb, error)

    async def _open_stream(
        self,
        request: web.Request,
        req: ProxyRequest,
        response: web.StreamResponse,
        reuse: Reuse | None,
    ) -> None:
        """Send a stream's headers: the request's own and its cache headers."""
        self._add_cache_headers(req, reuse)
        response.headers.update(safe_headers(req.response_headers))
        await response.prepare(request)

    def _early_headers(self, req: ProxyRequest) -> dict[str, str]:
        """A kept-alive stream's headers, sent before its reuse numbers are known."""
        self._add_cache_headers(req, None)
        return safe_headers(req.response_headers)

    async def _after_heartbeat(self, req: ProxyRequest, out: _Outcome) -> _Outcome:
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

    def _add_cache_headers(self, req: ProxyRequest, reuse: Reuse | None) -> None:
        """The X-Warmslot-* cache headers from the server's reuse numbers (core.proxy.headers);
        a bypassed request keeps its ``X-Warmslot-Cache: bypass``."""
        rate = self.prefill_rates.ms_per_token(self._served(req))
        if reuse is not None and req.split is not None:
            reuse = reuse.with_split(req.split.prompt_n, req.split.prompt_ms)
        headers = cache_headers(
            reuse, slot=req.slot, session=req.decision.session, plan=req.plan, ms_per_token=rate
        )
        if req.response_headers.get("X-Warmslot-Cache") == "bypass":
            del headers["X-Warmslot-Cache"]
        headers["X-Warmslot-Request-Id"] = req.request_id  # for `warmslot explain ID`
        req.response_headers.update(headers)

    async def _completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        assert req.policy is not None
        try:
            await req.policy.completed(req, timings, status)
        except Exception:
            log.exception("cache policy failed after request %s", req.request_id)

    def _account(
        self,
        req: ProxyRequest,
        status: int,
        t: Timings | None,
        ttfb: float | None,
        total_ms: float,
        error: str,
    ) -> None:
        c = self.counters
        c.requests += 1
        if status >= 400 or error:
            c.errors += 1
        if t is not None:
            c.prompt_tokens += t.prompt_n
            c.cached_tokens += t.cache_n
            self.prefill_rates.feed(self._served(req), t.cache_n, t.prompt_n, t.prompt_ms)
        self._emit(
            RequestCompleted(
                request_id=req.request_id,
                client=req.client,
                session=req.session,
                endpoint=req.endpoint,
                stream=req.stream,
                has_tools=req.has_tools,
                status=status,
                slot=req.slot,
                prompt_n=t.prompt_n if t else None,
                cache_n=t.cache_n if t else None,
                prompt_ms=t.prompt_ms if t else None,
                predicted_n=t.predicted_n if t else None,
                ttfb_ms=ttfb,
                total_ms=total_ms,
                kind=req.kind,
                error=error,
                user=req.user,
                model=self._served(req),
            )
        )

    def _served(self, req: ProxyRequest) -> str:
        """The model that served `req`, by file name (its profile's name when Warmslot
        does not run that server): what its numbers are kept under, so two models'
        requests are never priced at each other's prefill rate."""
        return (req.upstream or self._upstream).served_model() or req.model

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for the requests being handled (at most `timeout` s), then for their
        post-request cache work (as long again): at shutdown, and in tests."""
        if self._requests:
            await asyncio.wait(set(self._requests), timeout=timeout)
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=timeout)
