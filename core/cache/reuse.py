"""What finished requests reused against what they should have: `ReuseCheck`.

The first request after a restore should reuse what was restored — when it reused
less, that is a shortfall (an event, and in `status` with the likely cause); a
request that reused less than its session's conversation or its stable prefix is
explained once the server is quiet (core.cache.explain) and recorded as a divergence
with where its prompt left the slot's. Every finished request is noted for `explain`
(no server call then). Nothing here runs on a request's path before its response.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from core.cache.explain import Explainer
from core.cache.learner import chat_of, render_body, renderable
from core.cache.state import CacheState
from core.events import CacheEventKind
from core.proxy.types import ProxyRequest
from core.server.client import Timings
from core.status import Divergence, DivergenceWhere, ExplainedRequest, Explanation, Shortfall

log = logging.getLogger("warmslot.cache")

# Longest a request that reused less than expected waits for a quiet server to be
# explained (its explanation renders and tokenizes two prompts there); then it is not.
DIAGNOSE_WAIT_S = 300.0
# Tokens a request after a restore may reuse less than the restored state held before
# that is called a shortfall: the server re-evaluates the last token, and a client may
# rewrite its last message (a tool result) — a few tokens, not hundreds.
UNPAID_SLACK = 16


class ReuseCheck:
    """Shortfalls after restores, divergences explained, requests kept for `explain`."""

    def __init__(
        self,
        state: CacheState,
        explainer: Explainer,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
    ) -> None:
        self.state = state
        self.explainer = explainer
        self._spawn = spawn  # runs a background job (the manager's, cancelled at close)
        self.divergences: deque[Divergence] = deque(maxlen=20)
        self.restore_shortfalls: deque[Shortfall] = deque(maxlen=10)

    def diagnose_soon(self, req: ProxyRequest, timings: Timings, expected: int, what: str) -> None:
        """`req` should have reused `expected` tokens (`what`, in words): when it reused
        less, explain it in the background and record where it diverged."""
        if expected > 0 and timings.cache_n < expected and renderable(req):
            reason = f"reused {timings.cache_n} tokens; expected ≥ {expected} ({what})"
            self._spawn(self._diagnose(req, reason, timings))

    def check_promise(self, req: ProxyRequest, promised: tuple[int, str], timings: Timings) -> None:
        """The first request after a restore should reuse what was restored; when it
        reused less, say so (event and status) with the likely cause. The response's
        headers left before llama-server reported its reuse, so they cannot carry it."""
        tokens, what = promised
        if timings.cache_n >= tokens - UNPAID_SLACK:
            return
        if timings.cache_n == 0:
            cause = "llama-server reused nothing of the slot (another slot or its RAM cache)"
        elif self.state.disk.rewinds:
            cause = (
                "sliding-window model: llama-server went back to its nearest checkpoint "
                "before the point where the request differs"
            )
        else:
            cause = f"the request differs from the restored tokens from token {timings.cache_n}"
        text = f"{what}: {tokens} tokens, but the next request reused {timings.cache_n} — {cause}"
        self.restore_shortfalls.appendleft(
            {"ts": self.state.clock.time(), "request_id": req.request_id, "text": text}
        )
        assert req.plan is not None
        self.state.emit(
            CacheEventKind.RESTORE_UNPAID,
            text,
            fp=req.plan.prefix_fp,
            slot=req.plan.slot,
            tokens=timings.cache_n,
            request_id=req.request_id,
            promised=tokens,
        )

    def keep(self, req: ProxyRequest, timings: Timings) -> None:
        """Note the request for `explain` (core.cache.explain): no server call now."""
        if req.plan is None:
            return
        request: ExplainedRequest = {
            "request_id": req.request_id,
            "client": req.client,
            "session": req.plan.session,
            "slot": req.slot,
            "kind": req.kind,
            "endpoint": req.endpoint,
            "edits": list(req.edits),  # what the proxy changed in the body (e.g. billing-header)
        }
        render = render_body(chat_of(req)) if renderable(req) else None
        self.explainer.record(
            request,
            render,
            req.body_bytes,
            timings.cache_n,
            timings.prompt_n,
            self.state.prefill_rate(),
        )

    async def explain(self, request_id: str | None) -> Explanation | None:
        """Why a request reused what it did (the latest when None), computed now when it
        was not yet: two renderings and tokenizations on the server. None when the
        request is not kept (core.cache.explain)."""
        client = self.state.client
        if client is None:
            return self.explainer.find(request_id)
        return await self.explainer.explain(client, request_id)

    async def _diagnose(self, req: ProxyRequest, reason: str, t: Timings) -> None:
        """Explain a request that reused less than expected once the server is quiet
        (its explanation costs two renderings and tokenizations there), and record where
        it diverged."""
        if not await self.state.slots.wait_quiet(DIAGNOSE_WAIT_S):
            log.info("request %s not diagnosed: the server was never quiet", req.request_id)
            return
        rec = await self.explain(req.request_id)
        self._record_divergence(req, reason, rec.get("where") if rec else None, t)

    def _record_divergence(
        self, req: ProxyRequest, reason: str, where: DivergenceWhere | None, t: Timings
    ) -> None:
        entry: Divergence = {
            "ts": self.state.clock.time(),
            "request_id": req.request_id,
            "client": req.client,
            "session": req.plan.session if req.plan is not None else None,
            "slot": req.slot,
            "cache_n": t.cache_n,
            "prompt_n": t.prompt_n,
            "reason": reason,
            "where": where,
        }
        self.divergences.appendleft(entry)
        text = reason
        if where:
            text += (
                f"; diverged at token {where.get('token_index')} (char "
                f"{where['char_index']}): …{where['before'][-30:]!r} then "
                f"{where['old'][:30]!r} → {where['new'][:30]!r}"
            )
        self.state.emit(
            CacheEventKind.DIVERGENCE,
            text,
            fp=req.plan.prefix_fp if req.plan is not None else "",
            slot=req.slot,
            tokens=t.cache_n,
            client=req.client,
            request_id=req.request_id,
            where=where,
        )
