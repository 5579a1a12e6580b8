"""One JSON request's path, top to bottom: intake → route → prepare → forward → account
(docs/architecture.md#one-request). Each step hands the next a typed value
(`Body`/`Incoming`, the router's `Decision` and the `ProxyRequest`, the policy's
`SlotPlan`, the forwarder's `Outcome`); a step that refuses the request answers it
there, and a failing cache policy never blocks it (fail-open)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from core import chat as apis
from core.config.keys import DEFAULT_USER, LOCAL_USER
from core.proxy.accounting import Accounting
from core.proxy.checks import Invalid, check_token_ids, crashed_before, parse_json, token_ids
from core.proxy.errors import auth_response, error_response, invalid_response
from core.proxy.forward import Forwarder, client_gone
from core.proxy.headers import stream_body
from core.proxy.intake import Incoming, Intake, off_loop
from core.proxy.stream import Heartbeat
from core.proxy.types import Admit, CachePolicy, ProxyRequest, Route
from core.routing.router import Decision, Refused, Router, metadata_session, session_key
from core.server.upstream import Upstream

log = logging.getLogger("warmslot.proxy")


@dataclass(frozen=True)
class Routing:
    """Where requests go: the router (the one place that classifies), and the admission
    (the core's server set, `core.models.servers`: it starts, loads or waits for the
    decided server; None: a proxy made alone, whose one upstream serves once ready)."""

    upstream: Upstream  # the primary server
    router: Router
    admit: Admit | None = None


class Pipeline:
    """Handles the JSON (POST) routes."""

    def __init__(
        self,
        *,
        routing: Routing,
        policy: CachePolicy | None,
        intake: Intake,
        forwarder: Forwarder,
        accounting: Accounting,
        user: Callable[[web.Request], str | None],
        server_state: Callable[[], str],
    ) -> None:
        self._routing = routing
        self._upstream = routing.upstream
        self._policy = policy
        self._intake = intake
        self._forwarder = forwarder
        self._accounting = accounting
        self._user = user
        self._server_state = server_state
        # For "is now a quiet moment?" (switching to a new server build): requests being
        # handled, and when the last one ended.
        self.active = 0
        self.last_done = time.monotonic()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Answer one request on a JSON route."""
        self.active += 1
        try:
            return await self._handle(request)
        finally:
            self.active -= 1
            self.last_done = time.monotonic()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        endpoint, generation = apis.ROUTES[request.path]
        user = self._user(request)
        if user is None:
            return auth_response(endpoint)
        try:
            body = await self._intake.body(request, endpoint)
        except Invalid as e:
            return invalid_response(endpoint, e)
        admit = self._routing.admit or self._admit_one
        incoming = await self._intake.incoming(request, endpoint, body)
        del body
        req = self._request(request, incoming, user, generation)
        if isinstance(req, web.Response):
            return req
        del incoming  # req.raw_body holds the client's bytes while they are needed
        route = await admit(req.decision)
        if route.error:
            return _refused(route)
        req.model, req.upstream, req.policy = route.model, route.upstream, route.policy
        if route.load_ms is not None:  # its server started (or loaded) for it first
            req.response_headers["X-Warmslot-Load-Ms"] = f"{route.load_ms:.0f}"
        if route.model:  # a pooled model's name
            req.response_headers["X-Warmslot-Model"] = route.model
        if req.decision.backend:  # several backends: which one served it
            req.response_headers["X-Warmslot-Backend"] = req.decision.backend
        try:
            return await self._prepare_and_forward(request, req, generation, t0)
        finally:
            if route.release is not None:
                route.release()

    # ------------------------------------------------------------------ route
    async def _admit_one(self, _decision: Decision) -> Route:
        """The admission of a proxy made alone (no server set): its one upstream, when
        it is ready."""
        if self._upstream.base_url is None:
            state = self._server_state()
            error = f"Warmslot: llama-server is not ready (state: {state}); retry shortly"
            return Route(status=503, error=error, retry_after=2)
        return Route(upstream=self._upstream, policy=self._policy)

    def _request(
        self, request: web.Request, inc: Incoming, user: str, generation: bool
    ) -> ProxyRequest | web.Response:
        """The router's decision on `inc`, as the request the later steps read; a 404 for
        a model the router does not know."""
        decision = self._routing.router.decide(inc.endpoint, inc.headers, inc.body, inc.chat)
        if isinstance(decision, Refused):
            return error_response(
                decision.status, decision.error, type_="not_found_error", param="model"
            )
        # Each user's sessions are their own: the same session id (or the same derived
        # one) from two users must not share a slot or a row in the accounting.
        ns = f"{user}/" if user not in ("", DEFAULT_USER, LOCAL_USER) else ""
        if ns and decision.session:
            decision = dataclasses.replace(decision, session=ns + decision.session)
        chat = inc.chat
        named = session_key(inc.headers) or metadata_session(chat.user_id if chat else "")
        req = ProxyRequest(
            request_id=uuid.uuid4().hex[:16],
            path=request.path,
            endpoint=inc.endpoint,
            client=decision.client,
            user_agent=inc.headers.get("user-agent", ""),
            # The session the client names: a header, or Claude Code's metadata.user_id.
            session=ns + named if named else "",
            headers=inc.headers,
            body=inc.body,
            stream=bool(inc.body.get("stream", False)),
            has_tools=bool(chat.tools) if chat is not None else bool(inc.body.get("tools")),
            decision=decision,
            upstream=decision.upstream or self._upstream,
            policy=self._policy,
            body_bytes=len(inc.raw),
            body_digest=inc.digest,
            raw_body=inc.raw if generation else None,
            chat=chat,
            edits=inc.edits,
            user=user,
        )
        if inc.edits:
            req.response_headers["X-Warmslot-Edited"] = ",".join(inc.edits)
        req.chat = chat  # None also for a chat body that failed to convert (fail-open)
        return req

    # ---------------------------------------------------------------- prepare
    async def _prepare_and_forward(
        self, request: web.Request, req: ProxyRequest, generation: bool, t0: float
    ) -> web.StreamResponse:
        if refused := await self._refusal(req, req.upstream or self._upstream):
            return refused
        if generation and req.stream:  # silent until llama-server's first event: kept alive
            server = req.upstream or self._upstream

            def early() -> dict[str, str]:
                return self._forwarder.early_headers(req, server)

            req.heartbeat = Heartbeat(request, req.endpoint, early)
        if generation:
            req.body.setdefault("cache_prompt", True)
            if req.policy is not None:
                await self._prepare(request, req)
        req.raw_body = None
        if generation:
            # The first streamed event carries the reuse numbers; what the client did not
            # ask for is taken out again on the way back.
            req.strip_timings = stream_body(req.endpoint, req.body)
        upstream = req.upstream or self._upstream
        out = await self._forwarder.forward(request, req, upstream, t0)
        self._accounting.finish(req, upstream, out, t0)
        return out.response

    async def _refusal(self, req: ProxyRequest, upstream: Upstream) -> web.Response | None:
        """A 4xx for a body that must not reach the server: one that crashed it before
        (core.server.quarantine), or /tokenize and /detokenize ids outside its vocabulary
        (asked once per server run, only for bodies that hold ids)."""
        quarantine = upstream.quarantine()
        if quarantine is not None and (hit := quarantine.refusal(req.body_digest)) is not None:
            return invalid_response(req.endpoint, crashed_before(hit, quarantine.clock()))
        if not token_ids(req.endpoint, req.body):
            return None
        n_vocab = await upstream.n_vocab()
        try:
            if n_vocab is not None:
                check_token_ids(req.endpoint, req.body, n_vocab)
        except Invalid as e:
            return invalid_response(req.endpoint, e)
        return None

    async def _prepare(self, request: web.Request, req: ProxyRequest) -> None:
        """The cache policy's plan for `req` (it may edit the body). When the policy
        fails the request goes through as the client sent it (fail-open)."""
        assert req.policy is not None
        req.gone = lambda: client_gone(request)
        t0 = time.perf_counter()
        try:
            req.plan = await req.policy.prepare(req)
            # What the request waited for the cache's own work before it was forwarded
            # (docs/headers.md): a restore it needs, never a save it does not.
            ms = (time.perf_counter() - t0) * 1000
            req.response_headers["X-Warmslot-Prepare-Ms"] = f"{ms:.0f}"
        except Exception as e:
            log.exception("cache policy failed; forwarding the request untouched")
            # The client's own bytes, parsed again: no copy kept for this case.
            assert req.raw_body is not None
            req.body = await off_loop(parse_json, req.raw_body)
            req.body.setdefault("cache_prompt", True)
            req.edits = ()  # the client's own body, unedited too
            req.response_headers.pop("X-Warmslot-Edited", None)
            req.slot = None
            req.plan = None
            req.response_headers["X-Warmslot-Cache"] = "bypass"
            self._accounting.bypass(f"cache manager failed: {e!r}", {"request_id": req.request_id})


def _refused(route: Route) -> web.Response:
    """A model pool's or backend set's refusal (404: no such model; else 503)."""
    retry = {"Retry-After": str(route.retry_after)} if route.retry_after else None
    return error_response(
        route.status,
        route.error,
        type_="not_found_error" if route.status == 404 else "unavailable_error",
        param="model" if route.status == 404 else None,
        headers=retry,
    )
