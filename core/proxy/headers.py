"""The ``X-Warmslot-*`` cache headers of a managed response, from the server's own numbers.

llama-server decides how much of a prompt it reuses only when the request runs, so the
numbers exist only in its answer: a non-streamed answer's `timings` (or `usage`), and in a
stream the first event, which llama-server sends after the prompt is read (with
``timings_per_token`` for the OpenAI routes; the Anthropic stream's ``message_start``
carries ``usage`` anyway). The proxy holds the client's headers until that event is in —
the client would wait for it anyway — and writes them from it (docs/cache.md#response-headers).
Every value here is measured by the server; nothing is predicted.

`safe_headers` is the one place every value on its way into a response header passes
(the proxy applies it to the whole set as it writes the response): text that came from a
client — a session id from ``metadata.user_id``, a tool name inside a template warning —
may hold control characters, which aiohttp refuses to write, closing the connection
without any response (docs/security.md#response-headers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol

# Share of the prompt that must come from the cache for "hit" (else "partial"; none: "miss").
HIT_SHARE = 0.9
# Most bytes of a stream held back while waiting for its first numbers: a stream whose
# first events carry none is passed on after this much, headers without numbers.
HOLD_MAX_BYTES = 64 * 1024


# The longest header value written; longer ones are cut (clients' header limits are ~8 KiB).
MAX_HEADER_CHARS = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def header_safe(value: str) -> str:
    """`value` as a header can carry it: ASCII, with control characters (``\\x00``–
    ``\\x1f``, ``\\x7f``) and other characters written as backslash escapes, at most
    `MAX_HEADER_CHARS` long."""
    text = value.encode("ascii", "backslashreplace").decode("ascii")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    return text[:MAX_HEADER_CHARS]


def safe_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """`headers` with every name and value made `header_safe`."""
    return {header_safe(k): header_safe(v) for k, v in headers.items()}


@dataclass(frozen=True)
class Reuse:
    """How much of a prompt llama-server took from its cache (`cached`) and read (`prefilled`)."""

    cached: int
    prefilled: int
    prompt_ms: float | None = None

    @property
    def verdict(self) -> str:
        """``hit`` (≥ 90 % of the prompt cached), ``partial`` (some) or ``miss`` (none)."""
        total = self.cached + self.prefilled
        if self.cached <= 0 or total <= 0:
            return "miss"
        return "hit" if self.cached >= HIT_SHARE * total else "partial"

    def with_split(self, prompt_n: int, prompt_ms: float) -> Reuse:
        """These numbers counting `prompt_n` tokens the cache read for this request just
        before it, in its slot (core.cache.boundary), as prefilled, not cached."""
        moved = min(prompt_n, self.cached)
        ms = None if self.prompt_ms is None else self.prompt_ms + prompt_ms
        return Reuse(self.cached - moved, self.prefilled + moved, ms)


def reuse_from(obj: object) -> Reuse | None:
    """The reuse numbers in one answer or stream event of any of the three APIs: llama.cpp's
    `timings` (chat, completions, and with our patch Messages and Responses), Anthropic's
    ``usage.cache_read_input_tokens`` (also inside ``message_start``), OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` / ``input_tokens_details.cached_tokens``
    (Responses, also inside ``response``). None when the object has none."""
    if not isinstance(obj, dict):
        return None
    t = obj.get("timings")
    if isinstance(t, dict) and isinstance(t.get("prompt_n"), int):
        ms = t.get("prompt_ms")
        return Reuse(
            int(t.get("cache_n") or 0), int(t["prompt_n"]), float(ms) if ms is not None else None
        )
    for inner in ("message", "response"):  # Anthropic message_start, Responses events
        if isinstance(obj.get(inner), dict) and (found := reuse_from(obj[inner])) is not None:
            return found
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int) and "input_tokens" in usage:
        # Anthropic: input_tokens counts what was not read from the cache.
        return Reuse(int(usage["cache_read_input_tokens"]), int(usage["input_tokens"] or 0))
    for total_key, details_key in (
        ("prompt_tokens", "prompt_tokens_details"),
        ("input_tokens", "input_tokens_details"),
    ):
        details = usage.get(details_key)
        if isinstance(usage.get(total_key), int) and isinstance(details, dict):
            cached = int(details.get("cached_tokens") or 0)
            return Reuse(cached, max(0, int(usage[total_key]) - cached))
    return None


def stream_body(endpoint: str, body: MutableMapping[str, object]) -> bool:
    """Ask llama-server for `timings` in every streamed event — the first one is what the
    headers need — when the client did not say; True when it was asked here, so that the
    proxy takes them out again (`core.proxy.stream.SSEScanner`). The Anthropic stream
    needs none: its ``message_start`` carries ``usage``."""
    if not body.get("stream") or endpoint == "messages" or "timings_per_token" in body:
        return False
    body["timings_per_token"] = True
    return True


class _Labelled(Protocol):
    @property
    def label(self) -> str: ...


class Planned(Protocol):
    """What the headers read of the cache's plan for a request (`core.proxy.types.SlotPlan`;
    a protocol, since the types module reads this one's neighbours)."""

    @property
    def kind(self) -> _Labelled: ...
    @property
    def prefix_fp(self) -> str: ...
    @property
    def prefix_tokens(self) -> int: ...
    @property
    def restored(self) -> int: ...
    @property
    def warning(self) -> str: ...
    @property
    def conversation(self) -> str: ...


def cache_headers(
    reuse: Reuse | None,
    *,
    slot: int | None,
    session: str,
    plan: Planned | None,
    ms_per_token: float | None,
) -> dict[str, str]:
    """The ``X-Warmslot-*`` headers of a managed response. Without numbers (an error, a
    stream whose opening had none) the verdict is ``unknown`` and no counts are given.
    The cache's `plan` (None: it left the request alone) names the request's kind, its
    stable prefix, what was restored for it (a saved conversation too) and the cache's
    warning."""
    out: dict[str, str] = {}
    if plan is not None:
        out["X-Warmslot-Kind"] = plan.kind.label
        if plan.warning:
            text = plan.warning.replace("…", "...")
            out["X-Warmslot-Warning"] = text.encode("ascii", "replace").decode()[:200]
        if plan.prefix_fp:
            out["X-Warmslot-Prefix"] = f"{plan.prefix_fp[:16]}:{plan.prefix_tokens}"
        if plan.conversation:
            out["X-Warmslot-Conversation"] = plan.conversation
    if reuse is None:
        out["X-Warmslot-Cache"] = "unknown"
    else:
        out["X-Warmslot-Cache"] = reuse.verdict
        out["X-Warmslot-Cached-Tokens"] = str(reuse.cached)
        out["X-Warmslot-Prefilled-Tokens"] = str(reuse.prefilled)
        if ms_per_token is not None:
            out["X-Warmslot-Est-Saved-Ms"] = f"{reuse.cached * ms_per_token:.0f}"
    out["X-Warmslot-Restored"] = str(plan.restored if plan is not None else 0)
    if slot is not None:
        out["X-Warmslot-Slot"] = str(slot)
    if session:
        out["X-Warmslot-Session"] = session[:128]  # made header-safe with the rest
    return out
