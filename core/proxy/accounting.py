"""Account: what each forwarded request leaves behind — the proxy's counters, one
`RequestCompleted` record (telemetry and events), the model's prefill rate, and the
cache policy's `completed` call, run after the response (its bookkeeping never holds
a response back)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from core import chat as apis
from core.events import CacheEvent, CacheEventKind, Event, RequestCompleted
from core.proxy.types import ProxyRequest
from core.server.client import Timings
from core.server.upstream import Upstream
from core.telemetry.rates import PrefillRates

log = logging.getLogger("warmslot.proxy")

# Endpoints whose completed requests the cache policy hears about.
_MANAGED = (*apis.CHAT_ENDPOINTS, "completions", "completion")


@dataclass
class ProxyCounters:
    """The proxy's running totals (the /metrics exposition and tests read them)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    bypasses: int = 0


@dataclass
class Outcome:
    """What came of forwarding one request: the client's response and what to record."""

    response: web.StreamResponse
    status: int
    timings: dict[str, Any] | None = None
    ttfb: float | None = None
    error: str = ""
    # False: it never reached llama-server (no connection to it), so it cannot be what
    # crashed it (core.server.quarantine).
    reached: bool = True


def served(req: ProxyRequest, upstream: Upstream) -> str:
    """The model that served `req` (sent to `upstream`), by file name (its profile's name
    when Warmslot does not run that server): what its numbers are kept under, so two
    models' requests are never priced at each other's prefill rate."""
    return upstream.served_model() or req.model


class Accounting:
    """The last step of a request: counters, its record, the prefill rate it measured,
    and the cache policy's `completed` (on a task of its own)."""

    def __init__(self, emit: Callable[[Event], None], prefill_rates: PrefillRates) -> None:
        self._emit = emit
        self.prefill_rates = prefill_rates
        self.counters = ProxyCounters()
        # The policy's `completed` calls still running (`settled`, `drain`).
        self.inflight: set[asyncio.Task[Any]] = set()

    def bypass(self, reason: str, details: dict[str, Any]) -> None:
        """Count and announce a request the cache left alone because it failed (fail-open)."""
        self.counters.bypasses += 1
        self._emit(CacheEvent(kind=CacheEventKind.BYPASS, reason=reason, details=details))

    def finish(self, req: ProxyRequest, upstream: Upstream, out: Outcome, t0: float) -> None:
        """Record a forwarded request (`t0`: when its handling began) and hand it to its
        cache policy once the caller has returned the response."""
        total_ms = (time.perf_counter() - t0) * 1000
        parsed = Timings.parse(out.timings)
        if parsed is not None:
            parsed = parsed.with_split(req.split)
        self._account(req, served(req, upstream), out, parsed, total_ms)
        if req.policy is not None and req.endpoint in _MANAGED:
            task = asyncio.ensure_future(self._completed(req, parsed, out.status))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)

    async def _completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        assert req.policy is not None
        try:
            await req.policy.completed(req, timings, status)
        except Exception:
            log.exception("cache policy failed after request %s", req.request_id)

    def _account(
        self, req: ProxyRequest, model: str, out: Outcome, t: Timings | None, total_ms: float
    ) -> None:
        c = self.counters
        c.requests += 1
        if out.status >= 400 or out.error:
            c.errors += 1
        if t is not None:
            c.prompt_tokens += t.prompt_n
            c.cached_tokens += t.cache_n
            self.prefill_rates.feed(model, t.cache_n, t.prompt_n, t.prompt_ms)
        self._emit(
            RequestCompleted(
                request_id=req.request_id,
                client=req.client,
                session=req.session,
                endpoint=req.endpoint,
                stream=req.stream,
                has_tools=req.has_tools,
                status=out.status,
                slot=req.slot,
                prompt_n=t.prompt_n if t else None,
                cache_n=t.cache_n if t else None,
                prompt_ms=t.prompt_ms if t else None,
                predicted_n=t.predicted_n if t else None,
                ttfb_ms=out.ttfb,
                total_ms=total_ms,
                kind=req.kind,
                error=out.error,
                user=req.user,
                model=model,
            )
        )
