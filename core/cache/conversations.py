"""Conversation states: a session's live slot saved to disk, restored when it comes back.

A stable prefix (core.cache.prefix) is only the head of a conversation; an agent session
that has grown to 30k tokens would be re-read from there after a restart. So the whole
slot of a conversation that holds more than its stable prefix is saved — the *live*
slot (`POST /slots/N?action=save`: no prefill; the server writes in milliseconds) — at
these moments:

- when a request of another session is about to overwrite it (displaced);

- after a response, once it has grown by ``cache.conversation_save_tokens`` since its
  last save (debounced; 0 turns this off);
- when its session is released for idleness (the retention's idle sweep);
- at a graceful shutdown, longest-unsaved and most recent first, within
  `SHUTDOWN_SAVE_S` and the disk cap.

Every save keeps the disk cap (``cache.disk_cap_mb``): before it is written the retention
rules make room for it (`Retention.make_room`, its size estimated from the server's saved
states), and once written its real size is checked again; one that does not fit is not
kept (docs/cache.md#disk-cap).

A save runs under the slot's lock only for the server's write of the live slot
(milliseconds; the request that displaces a conversation waits for that alone). The file
is then hashed and indexed with its known-answer reference *pending*: the probe must run
alone (core.cache.probe.ProbeGate), and no client waits for a quiet server, so the
reference is taken at the next quiet moment in a slot nobody needs, or by the state's
first restore (core.cache.references; before, a displacing request waited 2.7–64.7 s for
it and the save was dropped when the server stayed busy, docs/cache.md#conversations).

When a request's rendered prompt shares more with a saved conversation than its stable
prefix gives — found by session id, or by token prefix among conversations that started
with the same stable prefix (a client that resumes with a new session id) — the longest
match (`core.cache.conversation_pick.choose`) is restored and verified (`SlotOps.restore`)
before the request runs. A state whose restore is predicted, from this machine's measured
restore bandwidth, probe time and cold prefill rate (core.cache.costs), to cost more than
the prefill it saves is skipped. Any failure leaves the
request to the prefix path.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from core import fmt
from core.cache import prefix as pfx
from core.cache.conversation_pick import MIN_GAIN_TOKENS, choose, read_tokens
from core.cache.fingerprint import fingerprint
from core.cache.learner import chat_of, render_body, renderable
from core.cache.probe import ProbeRecord
from core.cache.references import PendingReferences
from core.cache.saving import save_problem
from core.cache.store import PENDING, StateRecord, file_sha256
from core.errors import UpstreamError, VerificationFailed
from core.events import CacheEventKind
from core.proxy.types import ProxyRequest

if TYPE_CHECKING:
    from core.cache.retention import Retention
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState

log = logging.getLogger("warmslot.cache")

KIND = "conversation"  # `StateRecord.kind` of a conversation state
SHUTDOWN_SAVE_S = 20.0  # share of the staged stop's time (60 s) the conversation saves get
ALREADY_SAVED = "conversation already saved"
CANDIDATES = 8  # most recent states looked at per request


# A conversation state may take at most this share of the disk cap: one that alone
# fills it would be kept as "the most recent" while pushing out every prefix (found
# in the one-hour soak: a 2.3 MB conversation under a 1 MiB cap).
MAX_CAP_SHARE = 0.5


def too_large(nbytes: float, cap: int) -> str:
    return (
        f"conversation not saved: {fmt.size(nbytes)} would take more than "
        f"{MAX_CAP_SHARE:.0%} of the {fmt.size(cap)} disk cap (cache.disk_cap_mb)"
    )


@dataclass(frozen=True)
class Resumed:
    """What `Conversations.restore_for` did for a request: whether its slot now holds the
    saved conversation it continues, and what its ``X-Warmslot-Conversation`` header says
    ("" for nothing: core.proxy.headers renders it from the request's plan)."""

    restored: bool = False
    header: str = ""


NOT_RESUMED = Resumed()


@dataclass(frozen=True)
class _Written:
    """A conversation the server wrote to disk, not yet indexed."""

    name: str
    path: Path
    why: str
    slot: int
    tokens: list[int]
    bytes: int
    session: str
    base: str
    owner: str
    save_ms: float
    server_save_ms: float | None


@dataclass
class _Saved:
    session: str
    n_tokens: int  # what the slot held at its last save (or restore)


class Conversations:
    """Saves and restores conversation states for one cache manager."""

    def __init__(
        self,
        state: CacheState,
        ops: SlotOps,
        retention: Retention,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
    ) -> None:
        self.state = state
        self.ops = ops
        self.retention = retention
        self._spawn = spawn  # runs a background job (the manager's, cancelled at close)
        self._saved: dict[int, _Saved] = {}  # slot → its conversation's last save
        self.references = PendingReferences(state, ops, spawn)  # taken when the server is quiet

    # ------------------------------------------------------------ bookkeeping
    def server_gone(self) -> None:
        """Slots were emptied (the server stopped or restarts)."""
        self._saved.clear()

    def _usable(self) -> str:
        """Why conversations cannot be saved or restored now ("" when they can)."""
        m = self.state
        if not m.settings.cache.enabled or not m.settings.cache.persist:
            return "persistence is off"
        if not m.disk.usable:
            return f"not saved: {m.disk.reason}"
        if m.identity is None or m.client is None or m.probe_suffix is None:
            return "the server is not ready"
        if not m.has_db:
            return "no index database"
        return ""

    def unsaved(self, slot: int) -> int:
        """Tokens the slot's conversation holds beyond its last save (0: nothing to save)."""
        st = self.state.slots.slots[slot]
        info = self.state.by_fp.get(st.prefix_fp) if st.prefix_fp else None
        if not st.session_of_last or info is None or st.last_kind == "aux":
            return 0
        if st.tokens_hint < info.n_tokens + MIN_GAIN_TOKENS:
            return 0  # only its stable prefix: the prefix machinery keeps that
        last = self._saved.get(slot)
        done = last.n_tokens if last is not None and last.session == st.session_of_last else 0
        return max(0, st.tokens_hint - max(done, info.n_tokens))

    # ------------------------------------------------------------ save
    def after_response(self, slot: int) -> bool:
        """Note a finished request in `slot`; True when a debounced save was started."""
        every = self.state.settings.cache.conversation_save_tokens
        if every <= 0 or self._usable() or self.unsaved(slot) < every:
            return False
        self._spawn(self.save(slot, "grew", wait=False))
        return True

    async def save(self, slot: int, why: str, *, wait: bool = True, later: bool = False) -> str:
        """Save the conversation `slot` holds; what happened, in words.

        Only the server's live-slot save runs under the slot's lock (milliseconds); the
        file is hashed and indexed after it, and its known-answer reference is taken at
        a quiet moment or by its first restore (core.cache.references): no request waits
        for a probe. With `wait` False (after a response) a save that would wait for the
        slot is left for the next response, the idle release or the shutdown. With
        `later` (a request is about to overwrite the slot) the hashing and indexing run
        in the background too, so that request waits for the file write alone.
        """
        m = self.state
        problem = self._usable()
        if problem:
            return problem
        if not m.pressure.allows_persist():
            return f"not saved: {m.pressure.paused().get('persist', '')}"
        lock = self.ops.lock(slot)
        if not wait and lock.locked():
            return "not saved now: the slot is busy"
        async with lock:
            st = m.slots.slots[slot]
            if st.inflight:
                return "not saved now: a request runs in the slot"
            if self.unsaved(slot) <= 0:
                return ALREADY_SAVED
            # Backs off per conversation after a failure, as prefix saves do (a full disk
            # costs one event per backoff step, not one per response).
            key = f"{st.prefix_fp}:{st.session_of_last}"
            if not self.retention.save_backoff.allows(key):
                return "conversation not saved: its last save failed, the next try waits"
            cap = self.retention.cap_bytes
            estimate = self.retention.estimate_bytes(st.tokens_hint)
            if cap and estimate > cap * MAX_CAP_SHARE:
                return too_large(estimate, cap)
            name = f"ws-{secrets.token_hex(16)}.bin"  # named before its tokens are known
            # Room under the disk cap before anything is written (core.cache.retention).
            full = self.retention.make_room(estimate, f"the {st.tokens_hint}-token conversation")
            if full is not None:
                self.retention.save_failed(key, full, filename=name, slot=slot)
                return full
            try:
                written = await self._write(slot, why, name)
            except (UpstreamError, OSError, ValueError) as e:
                log.warning("saving the conversation in slot %d failed: %s", slot, e)
                # After an answer the server writes no more: its partial file goes now;
                # after a time-out the retention sweep deletes it (journaled).
                answered = not isinstance(e, UpstreamError) or e.status != 0
                self.retention.save_failed(
                    key,
                    f"saving the conversation of session {st.session_of_last[:24]} failed: {e}",
                    filename=name,
                    slot=slot,
                    server_answered=answered,
                )
                return f"conversation not saved: {e}"
            self.retention.save_succeeded(key)
        if cap and written.bytes > cap * MAX_CAP_SHARE:  # before any size was known
            written.path.unlink(missing_ok=True)
            self.retention.journal.end(name)
            return too_large(written.bytes, cap)
        said = f"saved its {len(written.tokens)}-token conversation ({fmt.size(written.bytes)})"
        if later:
            self._spawn(self._index_written(written))
            return f"{said}; indexed in the background"
        rec = await self._index_written(written)
        return said if rec is not None else f"conversation not saved: {written.name} not indexed"

    async def _write(self, slot: int, why: str, name: str) -> _Written:
        """The server's live-slot save into `name`, checked (its token list, its real size
        under the disk cap); what a record of it needs. Raise ValueError or UpstreamError."""
        m = self.state
        client = m.client
        assert client is not None
        st = m.slots.slots[slot]
        path = m.store.dir_for(m.launch_id) / name
        self.retention.journal.begin(m.launch_id, name)  # a save that never ends is swept
        t0 = time.perf_counter()
        saved = await client.slot_action(slot, "save", name)
        save_ms = (time.perf_counter() - t0) * 1000
        n_saved = saved.get("n_saved")
        problem = save_problem(saved, n_saved if isinstance(n_saved, int) else -1, path)
        tokens: list[int] = []
        if problem is None:
            tokens = read_tokens(path)
            if len(tokens) != n_saved:
                problem = f"the file lists {len(tokens)} tokens, the server saved {n_saved}"
        if problem is None:  # its real size, with the other saves under way, under the cap
            what = f"the {n_saved}-token conversation"
            size = path.stat().st_size + self.retention.record_bytes(len(tokens))
            problem = self.retention.make_room(size, what, written=name)
        if problem is not None:
            raise ValueError(problem)
        session = st.session_of_last
        self._saved[slot] = _Saved(session, st.tokens_hint)
        return _Written(
            name=name,
            path=path,
            why=why,
            slot=slot,
            tokens=tokens,
            bytes=path.stat().st_size,
            session=session,
            base=st.prefix_fp,
            owner=m.slots.owners.get(session, ""),  # its user's, for the disk's fair share
            save_ms=save_ms,
            server_save_ms=(saved.get("timings") or {}).get("save_ms"),
        )

    def _index(self, w: _Written, sha: str, hash_ms: float) -> StateRecord:
        """Index the written conversation `w`, its reference pending, and announce it."""
        m = self.state
        ident, suffix = m.identity, m.probe_suffix
        assert ident is not None and suffix is not None
        probe = {
            "prefix": w.tokens,
            "suffix": suffix,
            "hash_ms": round(hash_ms, 2),
            "prefill_ms_per_token": m.prefill_rate(),
        }
        now = m.clock.time()
        info = m.by_fp.get(w.base)
        rec = StateRecord(
            filename=w.name,
            identity=m.launch_id,
            fingerprint=fingerprint(ident, w.tokens),
            client=info.client if info is not None else "",
            source=KIND,
            prefix_n=len(w.tokens),
            n_tokens=len(w.tokens),
            bytes=w.bytes,
            sha256=sha,
            ttl_class=m.settings.cache.conversation_class,
            pinned=False,
            created=now,
            last_used=now,
            verified_at=None,
            verify_result=PENDING,
            probe=cast(ProbeRecord, probe),
            kind=KIND,
            session=w.session,
            base=w.base,
            owner=w.owner,
        )
        m.store.add(rec)
        self.retention.journal.end(w.name)
        superseded = self.supersede(rec)
        m.emit(
            CacheEventKind.SAVE,
            f"saved the {rec.n_tokens}-token conversation of session {w.session[:24]} "
            f"({w.why}); its known-answer reference follows",
            fp=rec.fingerprint,
            slot=w.slot,
            tokens=rec.n_tokens,
            nbytes=rec.bytes,
            state=KIND,
            file=w.name,
            session=w.session,
            base=w.base[:16],
            why=w.why,
            superseded=superseded,
            reference=False,
            save_ms=round(w.save_ms, 1),
            server_save_ms=w.server_save_ms,
            hash_ms=round(hash_ms, 1),
        )
        return rec

    async def _index_written(self, w: _Written) -> StateRecord | None:
        """Hash the written file off the event loop (a long conversation's is hundreds of
        MB: 93 MB for 4.6k tokens of Gemma 3 270M) and index it, its reference pending
        (core.cache.references); None when that failed (said, and the file swept)."""
        try:
            t1 = time.perf_counter()
            sha = await asyncio.to_thread(file_sha256, w.path)
            hash_ms = (time.perf_counter() - t1) * 1000
            self.ops.costs.note_hash(w.bytes, hash_ms)
            rec = self._index(w, sha, hash_ms)
        except (OSError, ValueError) as e:
            log.warning("indexing the conversation written to %s failed: %s", w.name, e)
            self.retention.save_failed(
                f"{w.base}:{w.session}",
                f"saving the conversation of session {w.session[:24]} failed: {e}",
                filename=w.name,
                slot=w.slot,
            )
            return None
        self.references.add(rec)
        return rec

    def supersede(self, new: StateRecord) -> list[str]:
        """Drop older states of the same conversation (same session and stable prefix),
        then all but the newest ``cache.conversations_per_session`` of the session."""
        m = self.state
        keep = max(1, m.settings.cache.conversations_per_session)
        mine = [
            r
            for r in m.store.all(m.launch_id)
            if r.kind == KIND and r.session == new.session and r.filename != new.filename
        ]
        gone: list[str] = []
        kept = 1
        for r in mine:  # newest first
            if r.pinned:
                continue
            if r.base == new.base:
                rule, reason = "superseded", "a newer state of the same conversation was saved"
            elif kept < keep:
                kept += 1
                continue
            else:
                rule, reason = "per_session", f"more than {keep} conversation states of a session"
            self.retention.evict_now(r, rule, reason)
            gone.append(r.filename)
        return gone

    async def save_all(self, timeout: float = SHUTDOWN_SAVE_S) -> dict[str, object]:
        """At shutdown: save every slot's unsaved conversation, longest-unsaved and most
        recent first, until `timeout` passes or the next would not fit under the disk cap."""
        if self._usable():
            return {"saved": 0, "reason": self._usable()}
        m = self.state
        deadline = time.monotonic() + timeout
        order = sorted(
            (s for s in m.slots.slots if self.unsaved(s.id) > 0),
            key=lambda s: (-self.unsaved(s.id), -s.last_used),
        )
        done: list[str] = []
        failed: list[str] = []
        # Saved already, by the save after a last response (it may have run during this
        # very shutdown, while the requests under way finished): said, not counted as none.
        already = [
            f"slot {s.id}: its {self._saved[s.id].n_tokens}-token conversation"
            for s in m.slots.slots
            if self.unsaved(s.id) <= 0
            and s.id in self._saved
            and self._saved[s.id].session == s.session_of_last
        ]
        left = [s.id for s in order]
        for st in order:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    said = await self.save(st.id, "shutdown")
            except TimeoutError:
                log.warning("conversation saves stopped: the shutdown's time is up")
                break
            left.remove(st.id)
            if said == ALREADY_SAVED:  # a save under way when the shutdown began did it
                already.append(
                    f"slot {st.id}: its {self._saved[st.id].n_tokens}-token conversation"
                )
            elif said.startswith("saved "):
                done.append(f"slot {st.id}: {said}")
            else:  # why not, in words (a failure, the pressure, a busy slot …)
                failed.append(f"slot {st.id}: {said}")
        out: dict[str, object] = {"saved": done, "already_saved": already, "failed": failed}
        return {**out, "not_saved_slots": left}

    @staticmethod
    def describe(out: dict[str, object]) -> str:
        """`save_all`'s outcome in words (the shutdown's log line)."""
        if "reason" in out:
            return f"none saved: {out['reason']}"
        parts = []
        for key, words in (
            ("saved", "saved now"),
            ("already_saved", "already on disk"),
            ("failed", "not saved"),
        ):
            items = out.get(key)
            if isinstance(items, list) and items:
                parts.append(f"{words}: " + "; ".join(str(i) for i in items))
        left = out.get("not_saved_slots")
        if isinstance(left, list) and left:
            parts.append("not saved (time or disk cap): slots " + ", ".join(map(str, left)))
        return " — ".join(parts) or "no conversation beyond its stable prefix to save"

    # ------------------------------------------------------------ restore
    def covering(self, info: pfx.PrefixInfo) -> StateRecord | None:
        """The newest saved conversation that starts with all of `info`'s tokens: where
        no prefix state was saved (core.cache.prefix_save), restoring it brings the
        prefix back for any request that extends it."""
        m = self.state
        if not m.has_db or m.identity is None:
            return None
        rows = m.store.table.rows_where(
            "identity = ? AND kind = ? AND base = ?",
            [m.launch_id, KIND, info.fingerprint],
            order_by="last_used desc",
            limit=CANDIDATES,
        )
        n = info.n_tokens
        for row in rows:
            rec = StateRecord.from_row(row)
            tokens = rec.probe.get("prefix")
            if isinstance(tokens, list) and tokens[:n] == info.tokens:
                return rec
        return None

    async def restore_prefix(
        self, rec: StateRecord, info: pfx.PrefixInfo, slot: int, *, wait_s: float | None = None
    ) -> None:
        """Restore (verified) the conversation `rec`, which `covering` found, into `slot`
        for its prefix `info` (the caller holds the slot's lock); raise VerificationFailed.

        The slot then holds the prefix for any request and the conversation for its own
        session: a request of another conversation should reuse the prefix, no more."""
        m = self.state
        await self.ops.restore(rec, slot, wait_s=wait_s)
        st = m.slots.slots[slot]
        st.prefix_fp = info.fingerprint
        st.tokens_hint = rec.n_tokens
        st.session_of_last = rec.session
        st.promised = (info.n_tokens, "restored prefix (from a saved conversation)")
        self._saved[slot] = _Saved(rec.session, rec.n_tokens)

    def candidates(self, session: str, base: str) -> list[StateRecord]:
        """Saved conversations of this session, or that started with the same prefix."""
        m = self.state
        rows = m.store.table.rows_where(
            "identity = ? AND kind = ? AND (session = ? OR base = ?)",
            [m.launch_id, KIND, session, base],
            order_by="last_used desc",
            limit=CANDIDATES,
        )
        return [StateRecord.from_row(r) for r in rows]

    async def restore_for(
        self, req: ProxyRequest, info: pfx.PrefixInfo, slot: int, session: str
    ) -> Resumed:
        """Before a request runs: restore (verified) the saved conversation it continues
        into `slot`; not restored when none applies or anything failed (the prefix path
        follows)."""
        try:
            return await self._restore_for(req, info, slot, session)
        except VerificationFailed:
            return NOT_RESUMED  # recorded (restore_rejected) and deleted by `restore`
        except Exception as e:  # fail open: the request goes on as it would have
            log.exception("restoring a conversation for slot %d failed", slot)
            self.state.emit(
                CacheEventKind.BYPASS,
                f"conversation restore failed, served without it: {e!r}",
                fp=info.fingerprint,
                slot=slot,
                state=KIND,
            )
            return NOT_RESUMED

    async def _restore_for(
        self, req: ProxyRequest, info: pfx.PrefixInfo, slot: int, session: str
    ) -> Resumed:
        m = self.state
        st = m.slots.slots[slot]
        if self._usable() or st.inflight or not renderable(req):
            return NOT_RESUMED
        if st.tokens_hint and st.session_of_last == session:
            return NOT_RESUMED  # its own conversation is in the slot: the server reuses it
        cands = self.candidates(session, info.fingerprint)
        if not cands:
            return NOT_RESUMED
        client = m.client
        assert client is not None
        rendered = await client.apply_template(render_body(chat_of(req)))
        prompt = await client.tokenize(rendered, add_special=True)
        # What the request gets without a conversation state: the prefix, where the slot
        # holds it or it is saved; nothing where only conversations hold it
        # (core.cache.prefix_save), so any state that extends it then counts.
        has_prefix = st.prefix_fp == info.fingerprint or m.store.for_fingerprint(info.fingerprint)
        base_n = info.n_tokens if has_prefix else 0
        rate = self.state.prefill_rate()
        choice, skipped = choose(
            cands, prompt, session, base_n, partial(self.ops.costs.estimate, rate=rate)
        )
        if choice is None:
            if skipped is not None:
                m.emit(
                    CacheEventKind.PREWARM_SKIPPED,
                    skipped.reason,
                    fp=info.fingerprint,
                    slot=slot,
                    state=KIND,
                    **skipped.estimate.details(),
                )
                return Resumed(False, skipped.header)
            return NOT_RESUMED
        async with self.ops.lock(slot):
            if st.inflight:
                return NOT_RESUMED
            e = choice.estimate
            await self.ops.restore(choice.rec, slot, wait_s=e.slack_s, details=e.details())
        # The slot now holds the conversation, which starts with the stable prefix.
        st.prefix_fp = info.fingerprint
        st.tokens_hint = choice.rec.n_tokens
        st.session_of_last = session
        st.prompt_n_last = choice.match  # what the request should reuse
        st.promised = (choice.match, f"restored conversation of session {session[:24]}")
        st.last_body = None
        st.head_key = req.chat.head_key if req.chat is not None else ""
        self._saved[slot] = _Saved(session, choice.rec.n_tokens)
        e = choice.estimate
        log.info(
            "restored conversation %s into slot %d: %d of %d prompt tokens (by %s): %s",
            choice.rec.filename,
            slot,
            choice.match,
            len(prompt),
            choice.by,
            e.words(),
        )
        return Resumed(
            True,
            f"restored {choice.match} of {len(prompt)} tokens ({choice.by}; predicted "
            f"~{e.cost_ms:.0f} ms against a prefill of ~{e.prefill_ms:.0f} ms)",
        )
