"""Why a request reused what it did: its prompt in sections, and where it left the slot's.

When asked — `warmslot explain`, a selected row in the dashboard's Requests tab, or the
cache manager for a request that reused less than it expected, once its server is quiet
— never on a request's path: the prompt as the server renders it (`/apply-template`),
tokenized with each token's bytes, is split into sections — the system text, each tool
definition, each message — with their token counts; compared with the previous prompt
the same slot processed, the first token that differs is named by section and index,
and the cached tokens that were thrown away from there on are priced at the measured
cold prefill rate (docs/cache.md#why-a-request-missed).

The last `KEEP` requests can be explained (`Explainer.kept`: their chat views, already in
memory); the last `KEEP` explanations stay in memory (`Explainer.recent`), and each one's
summary is published as a `RequestExplained` event, which telemetry stores.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from core import chat as apis
from core.cache import prefix as pfx
from core.events import Event, RequestExplained
from core.status import (
    ExplainedRequest,
    ExplainedSection,
    Explanation,
)
from core.telemetry.rows import ExplanationRow

log = logging.getLogger("warmslot.cache.explain")

KEEP = 200  # requests that can be explained, and explanations, kept in memory
# Most bytes of request bodies kept for explaining (their chat views, already in memory
# for the request): a long agent conversation's body is 1-2 MB.
KEEP_BYTES = 64 * 1024 * 1024
MAX_SECTIONS = 400  # sections stored per explanation (a long conversation's last ones)
CONTEXT_TOKENS = 8  # tokens of text shown on each side of a divergence
# A server that reused this many tokens less than the prompts share says its slot did
# not hold the previous prompt any more (another request, a restore, a checkpoint).
REUSE_GAP = 16


class Tokenizer(Protocol):
    """What the explainer asks of llama-server (`core.server.client.LlamaClient`)."""

    async def apply_template(self, body: Mapping[str, object]) -> str: ...

    async def tokenize_pieces(
        self, content: str, *, add_special: bool = False
    ) -> list[tuple[int, bytes]]: ...


@dataclass(frozen=True)
class Span:
    """One section of a rendered prompt, in characters: [start, end)."""

    name: str
    start: int
    end: int


@dataclass
class _Part:
    name: str
    anchor: int
    end: int | None  # where its own text ends, when all of it was found


def _tool_name(tool: object) -> str:
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    return str(fn.get("name", "?")) if isinstance(fn, dict) else "?"


def _tool_probes(tool: object) -> list[str]:
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    if not isinstance(fn, dict):
        return []
    probes = []
    desc = str(fn.get("description") or "").strip()
    if len(desc) >= 12:
        probes.append(desc[:48])
    if fn.get("name"):
        probes += [f'"{fn["name"]}"', str(fn["name"])]
    return probes


def _message_text(msg: object) -> str:
    if not isinstance(msg, dict):
        return ""
    text = apis.content_text(msg.get("content")).strip()
    if text:
        return text
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        if isinstance(fn, dict) and fn.get("name"):
            return str(fn["name"])
    return ""


def _find(rendered: str, text: str, start: int) -> tuple[int, int | None] | None:
    """Where `text` (or, failing that, its first line's head) is in `rendered` from
    `start`: (anchor, end of the whole text or None)."""
    if not text:
        return None
    pos = rendered.find(text, start)
    if pos >= 0:
        return pos, pos + len(text)
    head = text.splitlines()[0][:64] if text.splitlines() else ""
    if len(head) >= 4 and (pos := rendered.find(head, start)) >= 0:
        return pos, None
    return None


def spans(body: Mapping[str, object], rendered: str) -> list[Span]:
    """The sections of `rendered` (the server's rendering of the chat request `body`), in
    prompt order: ``system``, ``tool NAME`` for each tool the template rendered, and
    ``message N (role)`` for each message (N from 1). The template's own text between two
    parts goes with the part after it (a turn's header with its message); what follows
    the last part's text is ``end`` (the generation prompt). Parts the template left
    out are absent; a rendering where nothing is found is one section, ``prompt``."""
    parts: list[_Part] = []
    cursor = 0
    system_seen = 0
    # Anything but an array renders nothing we could find, as each non-object item does.
    messages, tools = body.get("messages"), body.get("tools")
    for i, msg in enumerate(messages if isinstance(messages, list) else [], start=1):
        role = str(msg.get("role", "?")) if isinstance(msg, dict) else "?"
        found = _find(rendered, _message_text(msg), cursor)
        if found is None:
            continue
        if role in ("system", "developer"):
            system_seen += 1
            name = "system" if system_seen == 1 else f"system {system_seen}"
        else:
            name = f"message {i} ({role})"
        parts.append(_Part(name, found[0], found[1]))
        cursor = found[1] if found[1] is not None else found[0] + 1
    taken = [(p.anchor, p.end if p.end is not None else p.anchor + 1) for p in parts]
    for tool in tools if isinstance(tools, list) else []:
        for probe in _tool_probes(tool):
            pos = rendered.find(probe)
            # A tool's text inside a message's own text is that message's, not the tool's.
            if pos >= 0 and not any(a <= pos < e for a, e in taken):
                parts.append(_Part(f"tool {_tool_name(tool)}", pos, None))
                break
    if not parts:
        return [Span("prompt", 0, len(rendered))]
    parts.sort(key=lambda p: p.anchor)
    out: list[Span] = []
    start = 0
    for k, p in enumerate(parts):
        nxt = parts[k + 1].anchor if k + 1 < len(parts) else len(rendered)
        end = min(p.end, nxt) if p.end is not None else nxt
        if end > start:
            out.append(Span(p.name, start, end))
            start = end
    if start < len(rendered):
        out.append(Span("end", start, len(rendered)))
    return out


class TokenMap:
    """Character positions of a rendered prompt → indices of its tokens."""

    def __init__(self, rendered: str, pieces: list[bytes]) -> None:
        self.ends: list[int] = []
        total = 0
        for piece in pieces:
            total += len(piece)
            self.ends.append(total)
        joined_len = total
        text_len = len(rendered.encode("utf-8"))
        # Tokens the server adds before the text (BOS) have pieces of their own.
        self.shift = max(0, joined_len - text_len)
        self._rendered = rendered

    def tokens_at(self, chars: Iterable[int]) -> list[int]:
        """The index of the token holding each character position (ascending input)."""
        out: list[int] = []
        prev_c, prev_b = 0, 0
        for c in chars:
            prev_b += len(self._rendered[prev_c:c].encode("utf-8"))
            prev_c = c
            out.append(min(bisect.bisect_right(self.ends, prev_b + self.shift), len(self.ends)))
        return out


@dataclass
class SlotPrompt:
    """A prompt as the server renders and tokenizes it, in sections."""

    ids: list[int]
    pieces: list[bytes]
    sections: list[ExplainedSection]
    rendered: str = ""


@dataclass
class Kept:
    """A completed request that can still be explained: its chat body for
    `/apply-template` and the request before it in the same slot, which it is compared
    with. Nothing is rendered until an explanation is asked for."""

    request: ExplainedRequest
    render: Mapping[str, object] | None  # None: too large to render (core.cache.learner)
    nbytes: int
    cache_n: int
    prompt_n: int
    ms_per_token: float | None
    previous: Kept | None
    at: float = 0.0  # when it completed (time.time())
    prompt: SlotPrompt | None = None  # once rendered and tokenized

    def drop(self) -> None:
        """Let go of the body and what it leads to (the request is no longer kept)."""
        self.render = None
        self.previous = None
        self.prompt = None


def section_at(sections: list[ExplainedSection], token: int) -> ExplainedSection | None:
    """The section holding token index `token`."""
    starts = [s["start"] for s in sections]
    k = bisect.bisect_right(starts, token) - 1
    return sections[k] if k >= 0 else None


def _text(pieces: list[bytes]) -> str:
    return b"".join(pieces).decode("utf-8", errors="replace")


def summary(rec: Explanation) -> str:
    """One line: where the request left the slot's previous prompt, and what it cost."""
    div = rec["divergence"]
    if div is None:
        head = rec.get("note") or "no divergence"
    else:
        head = (
            f"diverged at token {div['token']:,} in {div['section']} ({div['offset']:,} "
            f"tokens into it): …{div['before'][-30:]!r} then {div['old'][:30]!r} → "
            f"{div['new'][:30]!r}"
        )
    lost, cost, rate = rec["lost_tokens"], rec["cost_s"], rec.get("ms_per_token")
    tail = f"; {lost:,} cached tokens thrown away" if lost else ""
    if cost is not None and lost:
        tail += f", ~{cost:.1f} s of prefill" + (f" at {rate:.2f} ms/token" if rate else "")
    return head + tail


class Explainer:
    """Why the requests of one cache manager reused what they did, computed when asked.

    `record` notes each completed request (no server call, no copy of its body: the
    chat view it already has); `explain` renders and tokenizes a kept request and the
    one before it in its slot when an explanation is asked for (`warmslot explain`, a
    selected row in the Requests tab) or for a request that reused less than expected
    (the cache manager asks when its server is quiet). The last `KEEP` requests (at
    most `KEEP_BYTES` of bodies) can be explained; the last `KEEP` explanations stay."""

    def __init__(self, publish: Callable[[Event], None]) -> None:
        self._publish = publish
        self.recent: deque[Explanation] = deque(maxlen=KEEP)
        self.kept: OrderedDict[str, Kept] = OrderedDict()  # by request id, oldest first
        self.kept_bytes = 0
        self.last: dict[int, Kept] = {}  # by slot: the request it processed last
        self._lock = asyncio.Lock()

    def forget(self) -> None:
        """The server restarted: no slot holds what it held."""
        self.last.clear()

    def slot_changed(self, slot: int) -> None:
        """Something other than a request filled `slot` (a restore, a prewarm)."""
        self.last.pop(slot, None)

    def record(
        self,
        request: ExplainedRequest,
        render: Mapping[str, object] | None,
        nbytes: int,
        cache_n: int,
        prompt_n: int,
        ms_per_token: float | None,
    ) -> None:
        """Note a completed request (`render`: its chat body, None when it cannot be
        rendered). Costs no server call and copies nothing."""
        slot = request["slot"]
        previous = self.last.get(slot) if isinstance(slot, int) else None
        kept = Kept(
            request,
            render,
            nbytes if render is not None else 0,
            cache_n,
            prompt_n,
            ms_per_token,
            previous,
        )
        rid = request["request_id"]
        if rid in self.kept:
            self._evict(rid)
        self.kept[rid] = kept
        self.kept_bytes += kept.nbytes
        if isinstance(slot, int):
            self.last[slot] = kept
        while self.kept and (len(self.kept) > KEEP or self.kept_bytes > KEEP_BYTES):
            self._evict(next(iter(self.kept)))

    @property
    def latest_ts(self) -> float:
        """When the latest kept request completed, or the latest explanation was made."""
        kept = self.kept[next(reversed(self.kept))].at if self.kept else 0.0
        return max(kept, float(self.recent[0]["ts"]) if self.recent else 0.0)

    def _evict(self, rid: str) -> None:
        kept = self.kept.pop(rid)
        self.kept_bytes -= kept.nbytes
        kept.drop()

    async def explain(self, client: Tokenizer, request_id: str | None) -> Explanation | None:
        """The explanation of a kept request (the latest when None), computed now if it
        was not before; None when the request is not known (or no longer kept).
        Failures are logged and answer None."""
        if request_id is None:
            latest = next(reversed(self.kept), None)
            if latest is None:
                return self.find(None)
            request_id = latest
        async with self._lock:  # one at a time: each renders and tokenizes on the server
            done = self.find(request_id)
            kept = self.kept.get(request_id)
            if done is not None or kept is None or kept.render is None:
                return done
            try:
                return await self._explain(client, kept)
            except Exception as e:  # explaining never breaks anything
                log.warning("could not explain request %s: %r", request_id, e)
                return None

    async def _prompt(self, client: Tokenizer, kept: Kept) -> SlotPrompt | None:
        if kept.prompt is None and kept.render is not None:
            rendered = await client.apply_template(kept.render)
            toks = await client.tokenize_pieces(rendered, add_special=True)
            ids = [t for t, _ in toks]
            pieces = [p for _, p in toks]
            parts = spans(kept.render, rendered)
            starts = TokenMap(rendered, pieces).tokens_at(s.start for s in parts)
            sections: list[ExplainedSection] = []
            for k, (span, first) in enumerate(zip(parts, starts, strict=True)):
                last = starts[k + 1] if k + 1 < len(starts) else len(ids)
                if span.start == 0:
                    first = 0  # the tokens before the text (BOS) are the first section's
                sections.append(
                    {"name": span.name, "start": first, "n_tokens": max(0, last - first)}
                )
            kept.prompt = SlotPrompt(ids, pieces, sections, rendered)
        return kept.prompt

    async def _explain(self, client: Tokenizer, kept: Kept) -> Explanation:
        t0 = time.perf_counter()
        now = await self._prompt(client, kept)
        assert now is not None
        before = await self._prompt(client, kept.previous) if kept.previous else None
        ids, pieces, sections = now.ids, now.pieces, now.sections
        request = kept.request
        cache_n = kept.cache_n
        rec: Explanation = {
            "request_id": request["request_id"],
            "client": request["client"],
            "session": request["session"],
            "slot": request["slot"],
            "ts": time.time(),
            "n_tokens": len(ids),
            "cache_n": cache_n,
            "prompt_n": kept.prompt_n,
            "previous_tokens": len(before.ids) if before else None,
            "divergence": None,
            "lost_tokens": 0,
            "ms_per_token": kept.ms_per_token,
            "cost_s": None,
            "note": "",
            "summary": "",
            "compute_ms": 0.0,
        }
        for key in ("kind", "endpoint", "edits"):
            if key in request:
                rec[key] = request[key]
        if before is None:
            rec["note"] = "no earlier prompt of this slot to compare with"
        else:
            i = pfx.common_prefix_len(before.ids, ids)
            if i < len(before.ids) and i < len(ids):
                unknown: ExplainedSection = {"name": "?", "start": 0, "n_tokens": 0}
                new_sec = section_at(sections, i) or unknown
                old_sec = section_at(before.sections, i) or unknown
                rec["divergence"] = {
                    "token": i,
                    "section": new_sec["name"],
                    "offset": i - new_sec["start"],
                    "old_section": old_sec["name"],
                    "before": _text(pieces[max(0, i - CONTEXT_TOKENS) : i]),
                    "old": _text(before.pieces[i : i + CONTEXT_TOKENS]),
                    "new": _text(pieces[i : i + CONTEXT_TOKENS]),
                }
                rec["lost_tokens"] = len(before.ids) - i
                where = pfx.divergence(before.rendered, now.rendered)
                if where is not None:
                    where["token_index"] = i
                    rec["where"] = where
            elif i < len(before.ids):
                rec["note"] = "the prompt is a shorter part of the slot's previous prompt"
            else:
                rec["note"] = "the prompt extends the slot's previous prompt: no divergence"
            if cache_n + REUSE_GAP < i:
                rec["note"] = (
                    f"the prompts share {i:,} tokens but the server reused {cache_n:,}: the "
                    "slot no longer held the previous prompt (another request, a restore, "
                    "or a sliding-window checkpoint before that point)"
                )
        rate = kept.ms_per_token
        if rec["lost_tokens"] and rate is not None:
            rec["cost_s"] = round(rec["lost_tokens"] * rate / 1000, 3)
        if len(sections) > MAX_SECTIONS:
            sections = sections[:1] + sections[-(MAX_SECTIONS - 1) :]
        rec["sections"] = sections
        rec["compute_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        rec["summary"] = summary(rec)
        self.recent.appendleft(rec)
        self._publish(event_of(rec))
        return rec

    def find(self, request_id: str | None) -> Explanation | None:
        """A computed explanation by request id (the latest when None)."""
        if request_id is None:
            return self.recent[0] if self.recent else None
        return next((r for r in self.recent if r["request_id"] == request_id), None)

    def status(self, n: int = 5) -> list[Explanation]:
        """The last `n` explanations that found a divergence, without their sections."""
        out: list[Explanation] = []
        for r in self.recent:
            if r["divergence"] is not None:
                short = r.copy()
                short.pop("sections", None)
                out.append(short)
                if len(out) >= n:
                    break
        return out


def event_of(rec: Explanation) -> RequestExplained:
    """The telemetry event of an explanation."""
    div = rec["divergence"]
    return RequestExplained(
        request_id=rec["request_id"],
        client=rec["client"] or "",
        session=rec["session"] or "",
        slot=rec["slot"],
        n_tokens=rec["n_tokens"],
        cache_n=rec["cache_n"],
        prompt_n=rec["prompt_n"],
        previous_tokens=rec["previous_tokens"],
        div_token=div["token"] if div is not None else None,
        div_section=div["section"] if div is not None else "",
        lost_tokens=rec["lost_tokens"],
        cost_s=rec["cost_s"],
        summary=rec["summary"],
        sections=json.dumps(rec.get("sections") or []),
        divergence=json.dumps(div),
        compute_ms=rec["compute_ms"],
    )


def format_explanation(rec: Explanation) -> str:
    """`warmslot explain`'s text: the request, its sections with token counts, and the
    divergence."""
    lines = [
        f"request {rec['request_id']}  client {rec['client'] or '?'}  slot "
        f"{rec['slot']}  session {(rec['session'] or '—')[:32]}",
        f"prompt: {rec['n_tokens']:,} tokens; the server reused {rec['cache_n']:,} and read "
        f"{rec['prompt_n']:,}"
        + (
            f"; the slot's previous prompt had {rec['previous_tokens']:,}"
            if rec["previous_tokens"] is not None
            else ""
        ),
        f"why: {rec['summary'] or summary(rec)}",
    ]
    if rec.get("edits"):
        # The proxy's own edit of the body (core.proxy.billing.strip_billing_header): the prompt
        # above is the edited one, not the client's bytes.
        lines.append(f"edited by the proxy: {', '.join(rec['edits'])}")
    div = rec["divergence"]
    if div and rec.get("note"):
        lines.append(f"note: {rec['note']}")
    lines.append("sections:")
    for s in rec.get("sections") or []:
        mark = ""
        if div and s["start"] <= div["token"] < s["start"] + max(1, s["n_tokens"]):
            mark = f"   ← diverged here: token {div['token']:,}, {div['offset']:,} tokens in"
        lines.append(f"  {s['start']:>8,}  {s['n_tokens']:>7,} tokens  {s['name']}{mark}")
    return "\n".join(lines)


def from_row(row: ExplanationRow) -> Explanation:
    """An explanation as telemetry stored it, in the in-memory shape."""
    return {
        "id": row["id"],
        "request_id": row["request_id"],
        "client": row["client"],
        "session": row["session"],
        "slot": row["slot"],
        "ts": row["ts"],
        "n_tokens": row["n_tokens"],
        "cache_n": row["cache_n"],
        "prompt_n": row["prompt_n"],
        "previous_tokens": row["previous_tokens"],
        "div_token": row["div_token"],
        "div_section": row["div_section"],
        "lost_tokens": row["lost_tokens"],
        "cost_s": row["cost_s"],
        "summary": row["summary"],
        "compute_ms": row["compute_ms"],
        "sections": json.loads(row["sections"] or "[]"),
        "divergence": json.loads(row["divergence"] or "null"),
    }


def format_recent(explained: list[Explanation], n: int = 3) -> str:
    """`warmslot status`'s lines: the last few requests that left their slot's prompt."""
    if not explained:
        return ""
    lines = ["  last divergences (warmslot explain ID for the sections):"]
    for r in explained[:n]:
        lines.append(
            f"    {r['request_id']} {r['client'] or '?'} slot {r['slot']}: "
            f"{r['summary'] or summary(r)}"
        )
    return "\n".join(lines)


class _Explains(Protocol):
    """A cache manager, as `lookup` asks it (`core.cache.manager.CacheManager`)."""

    explainer: Explainer

    async def explain(self, request_id: str | None) -> Explanation | None: ...


class _Queries(Protocol):
    def explanation(self, request_id: str | None = None) -> ExplanationRow | None: ...


async def lookup(
    managers: Callable[[], Iterable[_Explains]],
    telemetry: Callable[[], _Queries | None],
    request_id: str | None,
) -> Explanation | None:
    """A request's explanation (the latest request's when `request_id` is None),
    computed now by the cache manager that served it when it still keeps the request;
    else from the telemetry database; None when there is none."""
    found = list(managers())
    if request_id is None:
        latest = max(
            (m for m in found if m.explainer.kept or m.explainer.recent),
            key=lambda m: m.explainer.latest_ts,
            default=None,
        )
        found = [latest] if latest is not None else []
    for m in found:
        if request_id is None or request_id in m.explainer.kept or m.explainer.find(request_id):
            rec = await m.explain(request_id)
            if rec is not None:
                return rec
    tel = telemetry()
    row = tel.explanation(request_id) if tel is not None else None
    return from_row(row) if row is not None else None
