"""Requests that hit their slot's context: never silent (docs/clients.md#context-size).

llama-server refuses a prompt longer than the slot's context with a 400 ("request
(N tokens) exceeds the available context size (M tokens)"), and stops an answer
when prompt + answer fill the slot (context shift is off by default: the answer
ends with ``finish_reason: "length"``, ``truncated`` on ``/completion``). A coding
agent then sees an error or a cut answer and rarely says why. Warmslot names it:

- `warning_for` reads a whole (non-streamed) response; the proxy puts what it finds
  into the response's ``X-Warmslot-Warning`` header, with ``X-Warmslot-Context``
  (``TOKENS/N_CTX``) for clients that want the numbers.
- `ContextLimits` (in the cache manager) turns each hit — those headers, or a
  stream whose tokens filled the slot — into a ``context_limit`` event and the
  status line `warmslot status` shows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from core.events import CacheEventKind
from core.status import ContextHitRow, ContextLimitsStatus

if TYPE_CHECKING:
    from core.server.client import LlamaClient, Timings

log = logging.getLogger("warmslot.cache")

__all__ = ["CONTEXT_HEADER", "ContextHit", "ContextLimits", "note", "warning_for"]

CONTEXT_HEADER = "X-Warmslot-Context"
WARNING_HEADER = "X-Warmslot-Warning"
_EXCEEDS = re.compile(
    r"(?:request|input) \((\d+) tokens\) (?:exceeds the available context size|is larger "
    r"than the max context size) \((\d+) tokens"
)
_TRUNCATED = re.compile(rb'"truncated"\s*:\s*true')
_ADVICE = "raise server.ctx_per_slot (0 lets the fit plan choose up to the trained context)"


@dataclass(frozen=True)
class ContextHit:
    """One request that hit its slot's context."""

    tokens: int  # prompt tokens (refused) or prompt + answer tokens (cut short)
    n_ctx: int  # the slot's context (0 when unknown)
    refused: bool  # the prompt did not fit (400), else the answer was cut

    @property
    def text(self) -> str:
        """One line for a header, an event and the status."""
        where = f"the slot's context ({self.n_ctx} tokens)" if self.n_ctx else "the slot's context"
        if self.refused:
            return f"prompt of {self.tokens} tokens exceeds {where}: llama-server refused it; " + (
                _ADVICE
            )
        return f"answer cut short: prompt + answer filled {where} at {self.tokens} tokens; " + (
            _ADVICE
        )


def _limit_of(body: Mapping[str, object]) -> int | None:
    # max_output_tokens: OpenAI Responses (core.chat); Anthropic Messages use max_tokens.
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


# `warning_for`'s `doc` when the caller has not parsed the answer.
UNPARSED = object()


def may_be_cut(data: bytes) -> bool:
    """Whether a whole 200 answer may have been stopped by the context (so that
    `warning_for` needs it parsed): it says ``"length"`` or ``"truncated": true``."""
    return b'"length"' in data or _TRUNCATED.search(data) is not None


def warning_for(
    status: int, data: bytes, request_body: Mapping[str, object], *, doc: object = UNPARSED
) -> ContextHit | None:
    """The context hit a whole response shows, or None.

    A 400 whose message is llama-server's context error; a 200 that was stopped by
    the context: ``truncated`` (``/completion``), or ``finish_reason == "length"``
    with fewer answer tokens than the request's own limit (so not that limit).
    `doc` is `data` parsed, when the caller parsed it already (None: not JSON): the
    proxy reads a whole answer once for everything it needs of it.
    """
    if status == 400:
        text = data[:2000].decode("utf-8", errors="replace")
        m = _EXCEEDS.search(text)
        return ContextHit(int(m.group(1)), int(m.group(2)), True) if m else None
    if status != 200 or not may_be_cut(data):
        return None
    if doc is UNPARSED:
        try:
            doc = json.loads(data)
        except ValueError:
            return None
    if not isinstance(doc, dict):
        return None
    raw_timings, raw_usage = doc.get("timings"), doc.get("usage")
    timings = raw_timings if isinstance(raw_timings, dict) else {}
    usage = raw_usage if isinstance(raw_usage, dict) else {}
    answer = _count(timings.get("predicted_n")) or _count(usage.get("completion_tokens"))
    prompt = _count(timings.get("prompt_n")) + _count(timings.get("cache_n")) or _count(
        usage.get("prompt_tokens")
    )
    if doc.get("truncated") is True:
        return ContextHit(prompt + answer, 0, False)
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    if choices[0].get("finish_reason") != "length":
        return None
    limit = _limit_of(request_body)
    if limit is not None and answer >= limit:
        return None  # the client's own max_tokens stopped it
    return ContextHit(prompt + answer, 0, False)


def _count(value: object) -> int:
    # A token count as the server sent it: a JSON number; null or absent counts 0.
    return int(value) if isinstance(value, int | float) else 0


def note(headers: MutableMapping[str, str], hit: ContextHit) -> None:
    """Put `hit` into the response headers (ASCII, at most 200 characters)."""
    text = hit.text.encode("ascii", "replace").decode()
    headers[WARNING_HEADER] = text[:200]
    headers[CONTEXT_HEADER] = f"{hit.tokens}/{hit.n_ctx}"


class Finished(Protocol):
    """What `ContextLimits.observe` reads of a finished request (a core.proxy.ProxyRequest)."""

    request_id: str
    client: str
    session: str
    slot: int | None
    response_headers: dict[str, str]

    @property
    def body(self) -> Mapping[str, object]:
        """The request's body as the client sent it (read for its max_tokens)."""


@dataclass
class ContextLimits:
    """Context hits seen lately (newest first), for events and the status."""

    n_ctx_slot: int | None = None  # the running server's context per slot
    recent: deque[ContextHitRow] = field(default_factory=lambda: deque(maxlen=10))
    total: int = 0
    server_of: object = None  # the server identity `n_ctx_slot` was read for

    async def observe(
        self,
        req: Finished,
        timings: Timings | None,
        client: LlamaClient | None,
        identity: object,
        emit: Callable[..., None],
    ) -> None:
        """Check a finished generation request; a hit becomes an event and a status line.
        The slot's context is read from the server (once per server identity)."""
        if identity is not self.server_of and client is not None:
            self.server_of = identity
            with contextlib.suppress(Exception):  # without it only whole responses are checked
                settings = (await client.props()).get("default_generation_settings")
                n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
                self.n_ctx_slot = n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None
        in_slot = answer = None
        if timings is not None:
            in_slot = timings.cache_n + timings.prompt_n + timings.predicted_n
            answer = timings.predicted_n
        hit = self.check(req.response_headers, in_slot, answer, req.body)
        if hit is None:
            return
        self.record(hit, client=req.client, session=req.session, request_id=req.request_id)
        log.warning("request %s (%s) hit the context: %s", req.request_id, req.client, hit.text)
        emit(
            CacheEventKind.CONTEXT_LIMIT,
            hit.text,
            slot=req.slot,
            client=req.client,
            tokens=hit.tokens,
            request_id=req.request_id,
            n_ctx=hit.n_ctx,
            refused=hit.refused,
        )

    def check(
        self,
        headers: Mapping[str, str],
        tokens_in_slot: int | None,
        answer_tokens: int | None,
        request_body: Mapping[str, object],
    ) -> ContextHit | None:
        """The hit of a finished request: what the proxy found in the whole response
        (its headers), or a response whose tokens filled the slot (streams).
        `tokens_in_slot` is cache_n + prompt_n + predicted_n of its timings."""
        marked = headers.get(CONTEXT_HEADER)
        if marked:
            tokens, _, ctx_text = marked.partition("/")
            refused = "refused" in headers.get(WARNING_HEADER, "")
            n = int(ctx_text) if ctx_text.isdigit() and int(ctx_text) else self.n_ctx_slot or 0
            return ContextHit(int(tokens) if tokens.isdigit() else 0, n, refused)
        n_ctx = self.n_ctx_slot
        if not n_ctx or tokens_in_slot is None:
            return None
        # llama-server stops generating when the slot would overflow (n_tokens + 1 ≥ n_ctx).
        if tokens_in_slot + 1 < n_ctx:
            return None
        limit = _limit_of(request_body)
        if limit is not None and answer_tokens is not None and answer_tokens >= limit:
            return None
        return ContextHit(tokens_in_slot, n_ctx, False)

    def record(self, hit: ContextHit, *, client: str, session: str, request_id: str) -> None:
        """Remember `hit` for the status."""
        self.total += 1
        self.recent.appendleft(
            {
                "ts": time.time(),
                "client": client,
                "session": session,
                "request_id": request_id,
                "tokens": hit.tokens,
                "n_ctx": hit.n_ctx,
                "refused": hit.refused,
                "text": hit.text,
            }
        )

    def status(self) -> ContextLimitsStatus:
        """For `warmslot status` and the dashboard."""
        return {"n_ctx_slot": self.n_ctx_slot, "total": self.total, "recent": list(self.recent)[:5]}
