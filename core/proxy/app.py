"""The OpenAI-compatible proxy in front of llama-server: the aiohttp application, its
routes and its lifecycle.

Who may call is checked first (`_guard`: Host, Origin, Content-Type, the API key); a
JSON request then runs the pipeline (`core.proxy.pipeline`): intake → route → prepare →
forward → account, each step a module of this package. The GET routes are passed to
llama-server as they are, except Warmslot's own (/warmslot/status, /warmslot/explain,
/metrics) and a model pool's /v1/models. Everything the proxy needs comes in its
`ProxyDeps`, at construction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from core import chat as apis
from core.config.checks import is_loopback
from core.config.keys import KeyRing, presented_key
from core.config.sections import ProxySettings
from core.errors import PortInUse
from core.events import Event
from core.proxy.accounting import Accounting, ProxyCounters
from core.proxy.checks import host_name, is_json_type, origin_allowed
from core.proxy.errors import (
    auth_response,
    error_response,
    invalid_response,
    not_ready_response,
    stopping_response,
)
from core.proxy.forward import Forwarder, upstream_timeout
from core.proxy.intake import Intake
from core.proxy.metrics import CONTENT_TYPE as METRICS_TYPE
from core.proxy.pipeline import Pipeline, Routing
from core.proxy.stream import SSEScanner, stream_usage, timings_from_json
from core.proxy.types import Admit, CachePolicy, CacheService, ProxyRequest, Route
from core.routing.router import Router
from core.server.upstream import Upstream
from core.status import Explanation, ModelList, Status
from core.telemetry import safe_text
from core.telemetry.rates import PrefillRates

# What callers import from here; the request types, error responses and response
# reading live in core.proxy.types, core.proxy.errors and core.proxy.stream.
__all__ = [
    "GET_ROUTES",
    "JSON_ROUTES",
    "Admit",
    "CachePolicy",
    "CacheService",
    "Proxy",
    "ProxyCounters",
    "ProxyDeps",
    "ProxyRequest",
    "Route",
    "SSEScanner",
    "auth_response",
    "error_response",
    "invalid_response",
    "stream_usage",
    "timings_from_json",
]

log = logging.getLogger("warmslot.proxy")

# path → (endpoint kind, generation?): the wire APIs are `core.chat`'s to know.
JSON_ROUTES: dict[str, tuple[str, bool]] = apis.ROUTES
GET_ROUTES = ("/v1/models", "/models", "/health", "/v1/health", "/props", "/slots")


@dataclass(frozen=True)
class ProxyDeps:
    """What a proxy is made of (the core's parts, or a test's). Nothing is set on a
    proxy afterwards; what changes while it runs is read through these callables."""

    upstream: Upstream  # the primary llama-server (single-model mode: the only one)
    # The proxy's settings, read per request: a changed setting applies to the next one.
    settings: Callable[[], ProxySettings]
    server_state: Callable[[], str]  # the primary server's state in words
    n_slots: Callable[[], int]  # the slots llama-server was launched with
    emit: Callable[[Event], None]
    status: Callable[[], Awaitable[Status]]
    metrics: Callable[[], bytes] | None = None  # the exposition /metrics serves
    policy: CachePolicy | None = None  # the prefix cache (None: requests pass untouched)
    # Who may call: named keys, proxy.api_key as "default" (core.config.keys); None: the
    # setting's key alone.
    keys: KeyRing | None = None
    # Per model: the cold prefill rate seen so far, which prices the cached tokens in
    # X-Warmslot-Est-Saved-Ms (and, read by the cache, explanations and restores).
    prefill_rates: PrefillRates | None = None
    # The one place that classifies (None: single-model mode, a router of one; a model
    # pool or backend set brings its own), and the admission: the core's server set
    # (`core.models.servers`; None: the one upstream, once it is ready).
    router: Router | None = None
    admit: Admit | None = None
    # GET /v1/models answered by Warmslot (a model pool's profiles); None: llama-server's.
    models: Callable[[], ModelList] | None = None
    # A request's explanation by id (None: the latest), for `warmslot explain`.
    explain: Callable[[str | None], Awaitable[Explanation | None]] | None = None


class Proxy:
    """The aiohttp application plus its runner. Runs on the core's loop."""

    def __init__(self, deps: ProxyDeps) -> None:
        self._deps = deps
        self._upstream = deps.upstream
        self._settings = deps.settings
        self._keys = (
            deps.keys if deps.keys is not None else KeyRing(None, lambda: deps.settings().api_key)
        )
        rates = deps.prefill_rates if deps.prefill_rates is not None else PrefillRates()
        self._accounting = Accounting(deps.emit, rates)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        # The requests being handled (a future each, done when its handler returns), so
        # that a shutdown lets them finish; after `stop_accepting` new ones get a 503.
        self._requests: set[asyncio.Future[None]] = set()
        self._accepting = True
        self._pipeline = Pipeline(
            routing=Routing(
                upstream=deps.upstream,
                router=deps.router if deps.router is not None else Router.single(deps.upstream),
                admit=deps.admit,
            ),
            policy=deps.policy,
            intake=Intake(deps.settings, deps.n_slots, self._accounting.bypass),
            forwarder=Forwarder(
                settings=deps.settings,
                prefill_rates=rates,
                server_state=deps.server_state,
                accepting=lambda: self._accepting,
                emit=deps.emit,
            ),
            accounting=self._accounting,
            user=self._user,
            server_state=deps.server_state,
        )
        # The body limit is the intake's, read per request; aiohttp's own applies only
        # to `request.read()`, which the proxy never calls: set to the setting's ceiling.
        self.app = web.Application(client_max_size=1024 * 1024 * 1024, middlewares=[self._guard])
        for path in JSON_ROUTES:
            self.app.router.add_post(path, self._pipeline.handle)
        for path in GET_ROUTES:
            self.app.router.add_get(path, self._handle_get)
        self.app.router.add_get("/warmslot/status", self._handle_status)
        self.app.router.add_get("/warmslot/explain", self._handle_explain)
        self.app.router.add_get("/metrics", self._handle_metrics)
        self.host = ""
        self.port = 0

    @property
    def counters(self) -> ProxyCounters:
        """Requests, errors, tokens and bypasses so far."""
        return self._accounting.counters

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

    # ----------------------------------------------------------------- access
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
                if not origin_allowed(safe_text(o), self._settings().allowed_origins)
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
            return stopping_response(JSON_ROUTES.get(request.path, ("", False))[0])
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

    # --------------------------------------------------------------- handlers
    async def _handle_get(self, request: web.Request) -> web.StreamResponse:
        if request.path not in ("/health", "/v1/health") and (err := self._auth_error(request)):
            return err
        models = self._deps.models
        if models is not None and request.path in ("/v1/models", "/models"):
            return web.json_response(models())
        if self._upstream.base_url is None:
            return not_ready_response(self._deps.server_state())
        url = f"{self._upstream.base_url}{request.path_qs}"
        try:
            async with self._upstream.session.get(
                url, timeout=upstream_timeout(self._settings()), auto_decompress=False
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
        return web.json_response(
            await self._deps.status(), dumps=lambda o: json.dumps(o, default=str)
        )

    async def _handle_explain(self, request: web.Request) -> web.StreamResponse:
        """GET /warmslot/explain[?id=REQUEST_ID]: why a request reused what it did."""
        if err := self._auth_error(request):
            return err
        rid = safe_text(request.query.get("id", "")) or None
        explain = self._deps.explain
        found = await explain(rid) if explain is not None else None
        if found is None:
            what = f"request {rid!r}" if rid else "any request yet"
            return error_response(
                404, f"Warmslot: no explanation for {what}", type_="not_found_error"
            )
        return web.json_response(found, dumps=lambda o: json.dumps(o, default=str))

    async def _handle_metrics(self, request: web.Request) -> web.StreamResponse:
        if err := self._auth_error(request):
            return err
        metrics = self._deps.metrics
        if metrics is None:
            return error_response(404, "Warmslot: no metrics here", type_="not_found_error")
        return web.Response(body=metrics(), headers={"Content-Type": METRICS_TYPE})

    def idle_for(self) -> float | None:
        """Seconds since the last generation request ended; None while one runs."""
        if self._pipeline.active:
            return None
        return time.monotonic() - self._pipeline.last_done

    @property
    def settled(self) -> bool:
        """No request is being handled and the cache has heard of every one that ended
        (its `completed` ran): what "idle" means to a caller that waits for the
        bookkeeping after a response, e.g. a test or a benchmark between requests."""
        return not self._pipeline.active and not self._accounting.inflight

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for the requests being handled (at most `timeout` s), then for their
        post-request cache work (as long again): at shutdown, and in tests."""
        if self._requests:
            await asyncio.wait(set(self._requests), timeout=timeout)
        if self._accounting.inflight:
            await asyncio.wait(set(self._accounting.inflight), timeout=timeout)
