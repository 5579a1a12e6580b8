"""The prefix-cache manager: the proxy's cache policy.

For each chat request it finds the stable prefix (from the server's own
rendering and tokenizer), fingerprints it, pins the session to a slot, keeps
side calls off the primary slots, and makes sure the slot holds the prefix —
already warm, restored from disk and verified, or warmed by the request itself
and then persisted in the background. Every learned prefix's definition (its
tokens) is kept in the index (`core.cache.definitions`), so after every server
(re)start — and after Warmslot itself restarts — the most recently used
prefixes are restored (verified) or prewarmed, without holding up client
requests (`core.cache.boot`).

Nothing here may break a request: the proxy catches any exception from
`prepare` and forwards the request untouched (fail-open). A restored state is
used only after a known-answer probe proves it: same greedy tokens, log-probs
within tolerance, and the expected reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from core import chat as apis
from core.cache import background as bg
from core.cache import boundary, warmup
from core.cache import prefix as pfx
from core.cache.boot import BootRewarm
from core.cache.conversations import Conversations
from core.cache.definitions import DefinitionStore
from core.cache.deps import CacheDeps, EngineParts, ServerHandle, deps_from
from core.cache.deps import DiskTier as DiskTier
from core.cache.explain import Explainer, format_recent
from core.cache.fingerprint import ServerIdentity
from core.cache.inventory import format_inventory, warmth
from core.cache.keepalive import KeepAlive, prewarm_body
from core.cache.learner import PrefixLearner, chat_of, render_body, renderable
from core.cache.prefix_save import PrefixSaver
from core.cache.probe import (
    REUSE_SLACK,
    ProbeGate,
    check_answer,
    non_finite,
    probe_request_for,
    scrub_request,
    second_look,
)
from core.cache.retention import Retention
from core.cache.slots import SlotMap, SlotState
from core.cache.store import StateRecord, StateStore
from core.cache.warmup import disk_tier_for as disk_tier_for
from core.clock import Clock
from core.config import Settings
from core.errors import UpstreamError, VerificationFailed
from core.events import CacheEvent, CacheEventKind, Event, Notice, ServerStateChanged
from core.machine.pressure import PressureMonitor
from core.machine.sweeps import Sweeps
from core.proxy.context_limit import ContextLimits
from core.proxy.types import ProxyRequest, SlotPlan
from core.routing.router import Kind
from core.server.client import LlamaClient, Timings
from core.server.upstream import Upstream
from core.status import (
    CacheStatus,
    Divergence,
    DivergenceWhere,
    EvictResult,
    ExplainedRequest,
    Explanation,
    PinResult,
    RewarmResult,
    Shortfall,
)

log = logging.getLogger("warmslot.cache")


class UnloadSaves(TypedDict):
    """What `CacheManager.save_for_unload` saved before the model's server goes."""

    saved: int  # prefixes saved now
    on_disk: int  # states of this server's identity on disk afterwards
    reason: str  # the disk tier's state, in words
    conversations: NotRequired[dict[str, object]]  # core.cache.conversations.save_all


# A new session takes another session's idle slot holding its prefix (that session's
# conversation is saved and moves) only for a prefix at least this long: moving costs a
# save now and a restore + verification later (tens of ms on the tiny model, ~3 s for a
# 32k Gemma 3 state), re-reading this many tokens more (the tiny model reads a 1,251-token
# prefix faster than a restore pays: the moved session then re-read its turn).
DISPLACE_MIN_TOKENS = 4096
IDENTITY_WAIT_S = 10.0  # longest a request waits for the server identity after a start
# Longest a request that reused less than expected waits for a quiet server to be
# explained (its explanation renders and tokenizes two prompts there); then it is not.
DIAGNOSE_WAIT_S = 300.0

RESTORE_AT_START = 3  # most recently used prefixes restored after a (re)start


# Tokens a request after a restore may reuse less than the restored state held before
# that is called a shortfall: the server re-evaluates the last token, and a client may
# rewrite its last message (a tool result) — a few tokens, not hundreds.
UNPAID_SLACK = 16


class CacheManager:
    """Implements `core.proxy.app.CachePolicy` for one llama-server, built from `CacheDeps`.

    Its public slot operations (`lock`, `prewarm`, `restore`, `persist_soon`, `emit`)
    are what warm-up, keep-alive, retention and the commands call (`CacheHost`).
    """

    def __init__(self, deps: CacheDeps) -> None:
        self.deps = deps
        # The llama-server this manager works on (the primary's, or a pooled model's)
        # and the HTTP session to it, which its maker (the engine or the pool) closes.
        self.upstream: Upstream | None = deps.upstream
        self.model = deps.model  # the model profile's name; "" for the primary server
        s = deps.settings()
        self.clock: Clock = deps.clock
        self.slots = SlotMap(
            s.server.launch_slots, reserve_aux=self._aux_slot, clock=self.clock.monotonic
        )
        self.by_fp: dict[str, pfx.PrefixInfo] = {}
        # fingerprint → the user whose request first used the prefix (with API keys per
        # user): the owner its saved state is accounted to (core.cache.retention_plan).
        self.prefix_owners: dict[str, str] = {}
        self.identity: ServerIdentity | None = None
        self.disk = DiskTier(False, "server not started yet")
        self.divergences: deque[Divergence] = deque(maxlen=20)
        self.restore_shortfalls: deque[Shortfall] = deque(maxlen=10)
        self.explainer = Explainer(self.publish)  # why each request reused what it did
        # APIs whose requests the running server does not let the cache manage, once
        # told about (core.chat.unmanaged_reason).
        self._told_unmanaged: set[str] = set()
        self.context_limits = ContextLimits()  # requests that hit their slot's context
        # Finds each request's stable prefix (rendering, boundaries, template check).
        self.learner = PrefixLearner(
            self.emit,
            self.publish,
            self.remember,
            lambda: self.identity,
            lambda: self.by_fp,
            clock=self.clock.time,
        )
        self._store: StateStore | None = None
        self._definitions: DefinitionStore | None = None
        # Held while Warmslot itself uses a slot (restore + verify, build + save + probe):
        # a request for that slot waits, so nothing slips in between our steps.
        self._locks: dict[int, asyncio.Lock] = {}
        self.probe_gate = ProbeGate()  # one probe at a time, each knowing if it ran alone
        self._persisting: set[str] = set()
        # Definitions of prefixes learned, not written yet (`remember`, `_write_definitions`).
        self._unwritten: dict[str, pfx.PrefixInfo] = {}
        self._jobs: set[asyncio.Task[Any]] = set()
        self._run_id = ""
        self._ready_task: asyncio.Task[None] | None = None
        # Set once the identity of the (re)started server is learned (or failed): a
        # request arriving right after "ready" waits for it rather than go unmanaged.
        self._identity_known = asyncio.Event()
        self.probe_suffix: list[int] | None = None
        self.boot = BootRewarm(self.emit, self.clock.time)  # progress of the boot re-warm
        # Background work: the engine's scheduler runs this manager's retention and
        # keep-alive (core.cache.background); the pressure monitor is the machine's one,
        # the engine's, and gates what this manager may do.
        self.pressure: PressureMonitor = deps.pressure
        self.sweeps: Sweeps | None = deps.sweeps  # the engine's scheduler (for status)
        self.retention = Retention(self, slot_dir=deps.slot_dir, peers=deps.peers)
        self.keepalive = KeepAlive(self)
        # Whole conversations saved and restored (core.cache.conversations).
        self.conversations = Conversations(self, self.retention, self._spawn)
        # Prefix states written from the live slot that holds them (core.cache.prefix_save).
        self.prefix_saver = PrefixSaver(self, self.retention, self.conversations)
        deps.subscribe(self._on_event, (ServerStateChanged,))

    # ------------------------------------------------------------ plumbing
    def emit(
        self,
        kind: CacheEventKind,
        reason: str = "",
        *,
        fp: str = "",
        slot: int | None = None,
        tokens: int | None = None,
        nbytes: int | None = None,
        **details: Any,
    ) -> None:
        self.publish(
            CacheEvent(
                kind=kind,
                reason=reason,
                fingerprint=fp[:16],
                slot=slot,
                tokens=tokens,
                bytes=nbytes,
                details=details,
            )
        )

    def publish(self, event: Event) -> None:
        """Emit any event as it is."""
        self.deps.emit(event)

    def prefill_rate(self) -> float | None:
        """This model's measured cold prefill rate (ms per token); None until measured."""
        return self.deps.prefill_rate()

    def lock(self, slot: int) -> asyncio.Lock:
        """Held while Warmslot itself uses `slot` (restore + verify, build + save + probe):
        a request for that slot waits, so nothing slips in between our steps."""
        return self._locks.setdefault(slot, asyncio.Lock())

    @property
    def persisting(self) -> frozenset[str]:
        """Fingerprints of the prefixes being saved in the background now."""
        return frozenset(self._persisting)

    def persist_soon(self, info: pfx.PrefixInfo, slot: int | None = None) -> bool:
        """Save the prefix in the background unless a save of it is under way; from
        `slot`, which just served it, where that can be done without a prefill
        (core.cache.prefix_save)."""
        if info.fingerprint in self._persisting:
            return False
        if not self.retention.save_backoff.allows(info.fingerprint):
            return False  # its last save failed: wait out the backoff (core.cache.retention)
        self._persisting.add(info.fingerprint)
        self._spawn(self._persist(info, slot))
        return True

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._jobs.add(task)
        task.add_done_callback(self._job_done)
        return task

    def _job_done(self, task: asyncio.Task[Any]) -> None:
        self._jobs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cache job failed: %r", task.exception(), exc_info=task.exception())

    @property
    def prefixes(self) -> dict[str, pfx.PrefixInfo]:
        """Known prefixes by request shape (the learner's)."""
        return self.learner.prefixes

    @property
    def template_warning(self) -> str | None:
        """Set when the server's chat template drops tools or system text."""
        return self.learner.template_warning

    @property
    def settings(self) -> Settings:
        return self.deps.settings()

    def _aux_slot(self) -> bool:
        """cache.aux_slot as it is now (the slot map asks per request)."""
        return self.settings.cache.aux_slot

    @property
    def server(self) -> ServerHandle | None:
        return self.deps.server()

    @property
    def has_db(self) -> bool:
        """Whether the engine's cache index is open (the states and definitions live there)."""
        return self.deps.db() is not None

    @property
    def client(self) -> LlamaClient | None:
        """The client of this manager's llama-server; None while it is not running."""
        return self.upstream.client() if self.upstream is not None else None

    @property
    def store(self) -> StateStore:
        if self._store is None:
            db = self.deps.db()
            assert db is not None
            self._store = StateStore(db, self.deps.slot_dir, clock=self.clock.time)
        return self._store

    @property
    def definitions(self) -> DefinitionStore | None:
        """The learned prefix definitions (None while the core has no database)."""
        db = self.deps.db()
        if self._definitions is None and db is not None:
            self._definitions = DefinitionStore(db, monotonic=self.clock.monotonic)
        return self._definitions

    def remember(self, info: pfx.PrefixInfo) -> None:
        """Keep a newly known prefix's definition across restarts (never fails a request).
        Written after the request that taught it has its response (`completed`), or at
        shutdown: never a synchronous write on a request's path."""
        self._unwritten[info.fingerprint] = info

    def _write_definitions(self) -> None:
        """Write the definitions `remember` noted, and the uses noted (in batches)."""
        book, ident = self.definitions, self.identity
        todo, self._unwritten = self._unwritten, {}
        if book is None or ident is None:
            return
        for info in todo.values():
            try:
                d = warmup.definition_of(info, ident)
                book.save(d, info.fingerprint)
            except (ValueError, sqlite3.Error):
                log.exception("could not store the definition of prefix %s", info.fingerprint[:16])
                continue
            info.meta["definition"] = d.id

    def _touch(self, info: pfx.PrefixInfo) -> None:
        """Note a use of a prefix (written in batches, see core.cache.definitions)."""
        def_id = info.meta.get("definition")
        book = self.definitions
        if def_id and book is not None:
            try:
                book.touch(str(def_id), info.last_used)
            except sqlite3.Error:
                log.exception("could not note the use of prefix %s", info.fingerprint[:16])

    def _on_event(self, event: Event) -> None:
        if not isinstance(event, ServerStateChanged) or event.model != self.model:
            return
        sup = self.server
        if event.state == "ready" and sup is not None and sup.run_id != self._run_id:
            self._run_id = sup.run_id
            self.slots.reset()
            self._identity_known.clear()
            if self._ready_task is not None and not self._ready_task.done():
                self._ready_task.cancel()  # the warm-up of a server that is gone
            self._ready_task = asyncio.ensure_future(self._after_ready())
        elif event.state in ("starting", "stopped", "failed"):
            self.slots.reset()
            self.identity = None
            self.learner.server_gone()
            self._told_unmanaged.clear()  # the next server may carry the patch
            self.conversations.server_gone()
            self.prefix_saver.server_gone()
            self.boot.forget()  # the last start's re-warm says nothing about the next
            self.explainer.forget()

    # ------------------------------------------------------------ server start
    async def _after_ready(self) -> None:
        """Learn the server identity; restore (verified) or prewarm recent prefixes."""
        try:
            await warmup.learn_identity(self)
        except Exception as e:
            log.exception("could not read the server identity; cache management paused")
            self.emit(CacheEventKind.IDENTITY_FAILED, f"could not read server identity: {e!r}")
            return
        finally:
            self._identity_known.set()
        if not self.settings.cache.enabled:
            return
        await warmup.warm_known(self)

    @property
    def launch_id(self) -> str:
        """The server's slot directory name: one per binary, model and KV-relevant flags."""
        return self._server_slot_dir().name

    async def _restore_or_prewarm(self, rec: StateRecord, slot: int) -> None:
        await warmup.restore_or_prewarm(self, rec, slot)

    # ------------------------------------------------------------ request path
    async def prepare(self, req: ProxyRequest) -> SlotPlan | None:
        """The slot for a chat request, made to hold its stable prefix where that is
        cheap; None when the cache leaves the request alone. Reads the router's
        decision (kind, session), classifies nothing."""
        settings = self.settings.cache
        if settings.enabled and self._ready_task is not None and not self._identity_known.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._identity_known.wait(), IDENTITY_WAIT_S)
        client = self.client
        if not settings.enabled or client is None or self.identity is None:
            return None
        if req.chat is None:
            # Raw completions (the server's own LCP reuse applies), or a body not read
            # as chat (core.chat): left to the server as it is.
            return None
        if not self._api_managed(req):
            return None
        body = req.body
        decision = req.decision
        side = decision.side
        session = decision.session
        info = None if side else await self.learner.prefix_for(req, client, session)
        # A new session goes where its prefix is when no saved state can bring it into
        # an empty slot (issue 16, 3; core.cache.slots).
        fp = info.fingerprint if info is not None else ""
        displace = bool(fp) and info is not None and info.n_tokens >= DISPLACE_MIN_TOKENS
        if displace and self.disk.usable and self.store.for_fingerprint(fp) is not None:
            displace = False
        # Compared in chat form: a slot keeps its last request's chat view (a Messages or
        # Responses body never equals it, and its new session went to an empty slot).
        chat = chat_of(req)
        head = req.chat.head_key
        holding = [st.id for st in self.slots.slots if fp and self._holds(st, fp, head)]
        slot, why_slot = self.slots.pick(session, req.kind, holding, displace, owner=req.user)
        if info is not None and req.user:
            self.prefix_owners.setdefault(info.fingerprint, req.user)
        req.slot = slot
        if side and slot == self.slots.aux_slot:
            self.emit(CacheEventKind.AUX_ISOLATED, decision.why, slot=slot, client=req.client)
        # Never wait for the boot re-warm of another prefix: skip or stop it.
        self.boot.claim(slot, info.fingerprint if info is not None else "")
        async with self.lock(slot):  # wait for Warmslot's own work on this slot
            pass
        if info is not None:
            info.last_used = self.clock.time()  # noted in the index in `completed`
            await self._save_displaced(slot, session)
            # A saved conversation this request continues beats its stable prefix.
            if not await self.conversations.restore_for(req, info, slot, session):
                await self._ensure_slot(info, slot, session)
                st = self.slots.slots[slot]
                if self.disk.rewinds and boundary.needs_mark(
                    st, info.fingerprint, info.n_tokens, chat, session
                ):
                    req.split = await self._mark_boundary(info, slot, req.gone)
        body["id_slot"] = slot
        body["cache_prompt"] = True
        self.slots.begin(slot)
        plan = SlotPlan(slot, why_slot, session, decision.kind, info.fingerprint if info else "")
        req.response_headers["X-Warmslot-Slot"] = str(slot)
        req.response_headers["X-Warmslot-Kind"] = req.kind
        restored, what = self.slots.slots[slot].promised
        if restored:  # Warmslot filled the slot: it no longer holds the last request's prompt
            self.explainer.slot_changed(slot)
            if what.startswith("restored"):  # from disk and verified (`restore`)
                req.response_headers["X-Warmslot-Restored"] = str(restored)
        warning = self.learner.template_warning
        if warning and (req.has_tools or not side):
            header = warning.replace("…", "...")
            req.response_headers["X-Warmslot-Warning"] = header.encode("ascii", "replace").decode()[
                :200
            ]
        if info is not None:
            req.response_headers["X-Warmslot-Prefix"] = f"{info.fingerprint[:16]}:{info.n_tokens}"
        return plan

    async def _mark_boundary(
        self,
        info: pfx.PrefixInfo,
        slot: int,
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> Timings | None:
        """Read the stable prefix alone into `slot` just before its request, so that the
        server takes a checkpoint at its end (core.cache.boundary); the timings of that
        read, None when it failed (the request then goes on as it came) or when the
        client hung up first (`gone` returned): closing the read stops the server's
        prefill, as the request's own would have (the proxy then answers 499)."""
        client = self.client
        if client is None:
            return None
        async with self.lock(slot):
            read = asyncio.ensure_future(client.completion(prewarm_body(info.tokens, slot)))
            watch = asyncio.ensure_future(gone()) if gone is not None else None
            waits: set[asyncio.Future[Any]] = {read} if watch is None else {read, watch}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if watch is not None:
                    watch.cancel()
                if not read.done():
                    read.cancel()
            try:
                resp = await read
            except asyncio.CancelledError:
                if read.cancelled():  # the client left: no need to read anything for it
                    log.info("slot %d: the client left while its prefix was read", slot)
                    return None
                raise
            except (UpstreamError, OSError) as e:  # fail open: the request reads it itself
                log.warning("could not read the prefix alone into slot %d: %s", slot, e)
                return None
        log.debug("slot %d: read the %d-token prefix alone first", slot, info.n_tokens)
        return Timings.parse(resp.get("timings"))

    def _api_managed(self, req: ProxyRequest) -> bool:
        """Whether the running server lets the cache pin `req`'s API to a slot; when it
        does not (stock llama-server drops id_slot on /v1/messages), say so once per
        server start — in `status` and as a notice — and leave the request alone."""
        assert self.identity is not None
        why = apis.unmanaged_reason(req.endpoint, self.identity.patches)
        if not why:
            return True
        if req.endpoint not in self._told_unmanaged:
            self._told_unmanaged.add(req.endpoint)
            log.warning("%s requests are forwarded unmanaged: %s", req.endpoint, why)
            self.publish(Notice(level="warning", text=f"{req.path}: {why}"))
        return False

    async def _ensure_slot(self, info: pfx.PrefixInfo, slot: int, session: str = "") -> None:
        """Make the slot hold the prefix before the request runs, if that can be done cheaply."""
        st = self.slots.slots[slot]
        if st.prefix_fp == info.fingerprint:
            return  # warm
        if st.inflight:
            return  # its content is in use: never restore over it
        if st.tokens_hint and (
            not session or st.session_of_last == session or self._extends(st.prefix_fp, info)
        ):
            # This session's own conversation (or a longer prefix it starts with) is there:
            # the request reuses it. Content another session left behind (a released slot
            # now given to this one) would be overwritten by the request anyway, so the
            # prefix is restored over it.
            return
        rec = self.store.for_fingerprint(info.fingerprint) if self.disk.usable else None
        if rec is None:
            return  # the request warms it; `completed` persists it
        async with self.lock(slot):
            with contextlib.suppress(VerificationFailed):
                await self.restore(rec, slot)

    def _check_promise(
        self, req: ProxyRequest, promised: tuple[int, str], timings: Timings
    ) -> None:
        """The first request after a restore should reuse what was restored; when it
        reused less, say so (event and status) with the likely cause. The response's
        headers left before llama-server reported its reuse, so they cannot carry it."""
        tokens, what = promised
        if timings.cache_n >= tokens - UNPAID_SLACK:
            return
        if timings.cache_n == 0:
            cause = "llama-server reused nothing of the slot (another slot or its RAM cache)"
        elif self.disk.rewinds:
            cause = (
                "sliding-window model: llama-server went back to its nearest checkpoint "
                "before the point where the request differs"
            )
        else:
            cause = f"the request differs from the restored tokens from token {timings.cache_n}"
        text = f"{what}: {tokens} tokens, but the next request reused {timings.cache_n} — {cause}"
        self.restore_shortfalls.appendleft(
            {"ts": self.clock.time(), "request_id": req.request_id, "text": text}
        )
        assert req.plan is not None
        self.emit(
            CacheEventKind.RESTORE_UNPAID,
            text,
            fp=req.plan.prefix_fp,
            slot=req.plan.slot,
            tokens=timings.cache_n,
            request_id=req.request_id,
            promised=tokens,
        )

    @staticmethod
    def _holds(st: SlotState, fp: str, head_key: str) -> bool:
        """Whether slot state `st` starts with the prefix `fp` of a request whose system
        text and tools hash to `head_key` (`ChatView.head_key`): its prefix is that one,
        or its last request had the same system text and tools (a prefix learned from a
        second session is new, but the first one's slot holds it: stable prefixes end
        within the system text and tools)."""
        if st.prefix_fp == fp:
            return True
        return bool(st.tokens_hint and head_key and st.head_key == head_key)

    async def _save_displaced(self, slot: int, session: str) -> None:
        """Save the conversation of another session that this request is about to
        overwrite in `slot` (agents outnumber agent slots: issue 16, 3). llama-server's
        RAM cache keeps a displaced state only when the new prompt keeps less than half
        of it, so conversations under a shared prefix longer than their tails were lost;
        a live slot save costs milliseconds and no prefill (docs/cache.md#crowding)."""
        st = self.slots.slots[slot]
        if st.inflight or not st.session_of_last or st.session_of_last == session:
            return
        if self.conversations.unsaved(slot) <= 0:
            return
        t0 = time.perf_counter()
        try:
            outcome = await self.conversations.save(slot, "displaced")
        except Exception:  # fail open: the request goes on; the conversation is re-read later
            log.exception("saving the conversation displaced from slot %d failed", slot)
            return
        log.info(
            "slot %d: %s (displaced by session %s, %.0f ms)",
            slot,
            outcome,
            session[:24],
            (time.perf_counter() - t0) * 1000,
        )

    def _extends(self, held_fp: str, info: pfx.PrefixInfo) -> bool:
        """Whether the prefix `held_fp` starts with all of `info`'s tokens."""
        held = self.by_fp.get(held_fp) if held_fp else None
        n = info.n_tokens
        return held is not None and held.n_tokens >= n and held.tokens[:n] == info.tokens

    async def completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        # A request that hit its slot's context is never silent (issue 16, 0e).
        plan = req.plan
        if plan is not None:  # before anything that waits: the slot is free now
            self.slots.end(plan.slot)
        await self.context_limits.observe(req, timings, self.client, self.identity, self.emit)
        if plan is None:
            return
        # The index learns of the request after its response: a new definition, a use.
        self._write_definitions()
        fp = plan.prefix_fp
        if (touched := self.by_fp.get(fp) if fp else None) is not None:
            self._touch(touched)
        slot = plan.slot
        st = self.slots.slots[slot]
        promised, st.promised = st.promised, (0, "")
        if status != 200 or timings is None:
            return
        self._keep_for_explaining(req, timings)
        if promised[0]:
            self._check_promise(req, promised, timings)
        previous_body, previous_fp = st.last_body, st.prefix_fp
        previous_session, previous_prompt = st.session_of_last, st.prompt_n_last
        st.tokens_hint = timings.cache_n + timings.prompt_n + timings.predicted_n
        st.last_body, st.last_kind, st.prefix_fp = chat_of(req), req.kind, fp
        st.head_key = req.chat.head_key if req.chat is not None else ""
        st.session_of_last = plan.session
        st.prompt_n_last = timings.cache_n + timings.prompt_n
        if plan.kind is Kind.SIDE:
            if previous_fp and slot != self.slots.aux_slot:
                self.emit(
                    CacheEventKind.DISPLACED,
                    "a side call ran in the primary slot (one slot only); "
                    "the server's RAM cache brings the prefix back",
                    fp=previous_fp,
                    slot=slot,
                )
            return
        info = self.by_fp.get(fp) if fp else None
        expected, what = 0, ""
        if previous_session and previous_session == st.session_of_last and previous_prompt:
            expected, what = previous_prompt - pfx.MIN_PREFIX_TOKENS, "the conversation so far"
        elif info is not None and previous_fp == fp:
            head = int(info.meta.get("head_n") or info.n_tokens)
            expected, what = head - REUSE_SLACK, "the stable prefix"
            if self.disk.rewinds:  # back to the checkpoint 4 tokens before its end
                expected -= boundary.CHECKPOINT_TAIL
        short = expected > 0 and timings.cache_n < expected
        if short and previous_body is not None and renderable(req):
            reason = f"reused {timings.cache_n} tokens; expected ≥ {expected} ({what})"
            self._spawn(self._diagnose(req, reason, timings))
        if plan.session:
            self.conversations.after_response(slot)  # debounced conversation save
        if info is not None and self.disk.usable and fp not in self._persisting:
            rec = self.store.for_fingerprint(fp)
            if rec is not None:
                self.store.touch(rec.filename)
            elif self.conversations.covering(info) is None:
                self.persist_soon(info, slot)  # from this slot, which holds it now

    def _keep_for_explaining(self, req: ProxyRequest, timings: Timings) -> None:
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
            self.prefill_rate(),
        )

    async def explain(self, request_id: str | None) -> Explanation | None:
        """Why a request reused what it did (the latest when None), computed now when it
        was not yet: two renderings and tokenizations on the server. None when the
        request is not kept (core.cache.explain)."""
        client = self.client
        if client is None:
            return self.explainer.find(request_id)
        return await self.explainer.explain(client, request_id)

    async def _diagnose(self, req: ProxyRequest, reason: str, t: Timings) -> None:
        """Explain a request that reused less than expected once the server is quiet
        (its explanation costs two renderings and tokenizations there), and record where
        it diverged."""
        if not await self.slots.wait_quiet(DIAGNOSE_WAIT_S):
            log.info("request %s not diagnosed: the server was never quiet", req.request_id)
            return
        rec = await self.explain(req.request_id)
        self._record_divergence(req, reason, rec.get("where") if rec else None, t)

    def _record_divergence(
        self, req: ProxyRequest, reason: str, where: DivergenceWhere | None, t: Timings
    ) -> None:
        entry: Divergence = {
            "ts": self.clock.time(),
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
        self.emit(
            CacheEventKind.DIVERGENCE,
            text,
            fp=req.plan.prefix_fp if req.plan is not None else "",
            slot=req.slot,
            tokens=t.cache_n,
            client=req.client,
            request_id=req.request_id,
            where=where,
        )

    # ------------------------------------------------------------ warm / save / restore
    async def prewarm(
        self, info: pfx.PrefixInfo, slot: int, *, reason: str, chunk: int = 0
    ) -> Timings | None:
        """Fill `slot` with exactly the prefix (n_predict 0 keeps only the prompt in KV).

        With `chunk`, a slot known to be empty is filled `chunk` tokens at a time, each
        request extending the one before (the server reuses it, sliding-window models
        included). llama-server notices a cancelled request only between batches
        (2,048 tokens by default; measured ~8 s for Gemma 3 270M on 2 cores), so this
        bounds how long a client request that stops the boot re-warm waits for the slot.
        """
        client = self.client
        if client is None:
            return None
        st = self.slots.slots[slot]
        ends = [info.n_tokens]
        if chunk > 0 and not st.tokens_hint:  # a shorter prompt would cut a slot's content
            ends = [*range(chunk, info.n_tokens, chunk), info.n_tokens]
        first: Timings | None = None
        prompt_n, prompt_ms = 0, 0.0
        for end in ends:
            resp = await client.completion(prewarm_body(info.tokens[:end], slot))
            t = Timings.parse(resp.get("timings"))
            first = first or t
            prompt_n += t.prompt_n if t else 0
            prompt_ms += t.prompt_ms if t else 0.0
        # What was reused is what the first request found; the cost is every request's.
        total = first
        if first is not None and len(ends) > 1:
            total = Timings(first.cache_n, prompt_n, round(prompt_ms, 3), 0, 0.0)
        st.prefix_fp = info.fingerprint
        st.tokens_hint = info.n_tokens
        st.promised = (info.n_tokens, "re-warmed prefix")
        hit = total is not None and total.cache_n >= info.n_tokens - REUSE_SLACK - 4
        self.emit(
            CacheEventKind.PREWARM_HIT if hit else CacheEventKind.PREWARM_COLD,
            reason,
            fp=info.fingerprint,
            slot=slot,
            tokens=info.n_tokens,
            cache_n=total.cache_n if total else None,
            prompt_n=total.prompt_n if total else None,
            prompt_ms=total.prompt_ms if total else None,
            requests=len(ends),
        )
        return total

    async def wait_idle(self, exclude: int, timeout: float = 30.0) -> None:
        """Wait until no other slot is busy: a probe's log-probs depend on the batch it
        shares with other requests, so reference and check must both run alone."""
        if not await self.slots.wait_quiet(timeout, exclude=exclude):
            log.warning("probing while other requests run: verification may be noisy")

    def scratch_slot(self, exclude: int | None = None) -> int | None:
        """An idle slot no session holds (the side-call slot first), other than `exclude`."""
        aux = self.slots.aux_slot
        if aux is not None and aux != exclude and self.slots.slots[aux].inflight == 0:
            return aux
        idle = [
            s
            for s in self.slots.primary_slots
            if s.inflight == 0 and not s.session and s.id != exclude
        ]
        return idle[0].id if idle else None

    async def _persist(self, info: pfx.PrefixInfo, live: int | None = None) -> None:
        """Get the prefix state onto disk (core.cache.prefix_save); a later request may
        start another save of it once this one ended."""
        try:
            await self.prefix_saver.persist(info, live)
        finally:
            self._persisting.discard(info.fingerprint)

    def _server_slot_dir(self) -> Path:
        sup = self.server
        if sup is not None and sup.resolved is not None and sup.resolved.slot_dir is not None:
            return sup.resolved.slot_dir
        return self.deps.slot_dir

    async def restore(self, rec: StateRecord, slot: int) -> None:
        """Restore `rec` into an expendable slot and verify it; raise VerificationFailed."""
        client = self.client
        assert client is not None
        t0 = time.perf_counter()
        problem = self.store.check_file(rec)
        resp: dict[str, Any] = {}
        if problem is None:
            try:
                resp = await client.slot_action(slot, "restore", rec.filename)
                if int(resp.get("n_restored", -1)) != rec.n_tokens:
                    problem = f"restored {resp.get('n_restored')} tokens, expected {rec.n_tokens}"
            except UpstreamError as e:
                problem = f"server refused the file: {e}"
        if problem is None:
            try:
                problem = await self._verify(rec, slot, client)
            except BaseException as e:
                # The probe could not run (the server went away, a time-out, a bug): the
                # restored state is unverified, so it must not stay in the slot, where
                # llama-server's own slot choice could reuse it. The file may be fine: kept.
                await self._unload(slot, client)
                self.emit(
                    CacheEventKind.RESTORE_REJECTED,
                    f"could not verify ({e!r}); the slot was cleared, the file kept",
                    fp=rec.fingerprint,
                    slot=slot,
                    tokens=rec.n_tokens,
                )
                if isinstance(e, Exception):
                    raise VerificationFailed(f"could not verify: {e!r}") from e
                raise
        ms = (time.perf_counter() - t0) * 1000
        if problem is None:
            st = self.slots.slots[slot]
            st.prefix_fp = rec.fingerprint
            st.tokens_hint = rec.n_tokens
            st.promised = (rec.n_tokens, f"restored {rec.kind} state")
            self.store.mark_verified(rec.filename, "ok")
            self.store.touch(rec.filename)
            self.emit(
                CacheEventKind.RESTORE_OK,
                "restored and verified",
                fp=rec.fingerprint,
                slot=slot,
                tokens=rec.n_tokens,
                nbytes=rec.bytes,
                ms=round(ms, 1),
                restore_ms=(resp.get("timings") or {}).get("restore_ms"),
            )
            return
        # NaN/inf cells outlive an erase: overwrite them first. On a sliding-window (or
        # recurrent) model a wrong state can hold such cells where the probe does not look
        # (outside its window): a 4,096-byte flip rejected on a finite difference left Gemma
        # 3's next cold answer wrong (docs/cache.md#verification), so every rejection there.
        if non_finite(problem) or self.disk.rewinds:
            with contextlib.suppress(UpstreamError):
                await client.completion(
                    scrub_request(rec.probe["prefix"], rec.probe["suffix"], slot)
                )
        await self._unload(slot, client)
        freed = self.retention.discard(rec, problem)  # an undeletable file is quarantined
        self.emit(
            CacheEventKind.RESTORE_REJECTED,
            problem,
            fp=rec.fingerprint,
            slot=slot,
            tokens=rec.n_tokens,
            nbytes=freed,
            ms=round(ms, 1),
        )
        info = self.by_fp.get(rec.fingerprint)
        if info is not None and self.disk.usable:
            self.persist_soon(info)
        raise VerificationFailed(problem)

    async def _unload(self, slot: int, client: LlamaClient) -> None:
        """Erase `slot` (best effort, even while cancelled) and forget what it held."""
        with contextlib.suppress(UpstreamError, OSError, asyncio.CancelledError):
            await asyncio.shield(client.slot_action(slot, "erase"))
        st = self.slots.slots[slot]
        st.prefix_fp, st.tokens_hint = "", 0

    async def _verify(self, rec: StateRecord, slot: int, client: LlamaClient) -> str | None:
        probe = rec.probe
        suffix, prefix_tokens = probe.get("suffix"), probe.get("prefix")
        if not suffix or not prefix_tokens or "tokens" not in probe:
            return "no known-answer probe recorded"
        problem = await self._probe(rec, slot, client)
        if not second_look(problem):
            return problem
        # A request of another slot in the same batch changes the matrix shapes and so the
        # last bits of the probe's log-probs (docs/cache.md#verification): restore once more
        # and probe alone. A wrong state fails again, bit for bit.
        try:
            await client.slot_action(slot, "erase")
            again = await client.slot_action(slot, "restore", rec.filename)
        except UpstreamError:
            return problem
        if int(again.get("n_restored", -1)) != rec.n_tokens:
            return problem
        second = await self._probe(rec, slot, client)
        if second is None:
            log.info("%s verified on a second probe (first: %s)", rec.filename, problem)
        return second

    async def _probe(self, rec: StateRecord, slot: int, client: LlamaClient) -> str | None:
        probe = rec.probe
        await self.wait_idle(exclude=slot)
        # Under the gate: never beside another of our probes (docs/cache.md#verification).
        run = await self.probe_gate.probe(client, probe_request_for(probe, slot), slot)
        resp = run.answer
        t = Timings.parse(resp.get("timings"))
        return check_answer(
            resp,
            t.cache_n if t else None,
            rec.prefix_n,
            probe,
            tolerance=self.disk.logprob_tolerance,
        )

    # ------------------------------------------------------------ status / lifecycle
    def idle(self) -> bool:
        """True when no background cache work (warm-up after start, persist, restore) runs."""
        ready = self._ready_task is None or self._ready_task.done()
        return ready and not self._jobs and not any(lk.locked() for lk in self._locks.values())

    async def status(self) -> CacheStatus:
        """Cache inventory: slots, saved states, prefixes, last divergences."""
        slots_live: dict[int, int] = {}
        client = self.client
        if client is not None:
            with contextlib.suppress(UpstreamError):
                slots_live = {s.id: s.n_prompt_tokens for s in await client.slots()}
        ident = self.launch_id if self.identity else None
        states = self.store.all() if self.has_db else []
        out: CacheStatus = {
            "enabled": self.settings.cache.enabled,
            "identity": ident,
            "disk_tier": {"usable": self.disk.usable, "reason": self.disk.reason},
            "aux_slot": self.slots.aux_slot,
            "slots": [
                {
                    "id": s.id,
                    "session": s.session,
                    "prefix": s.prefix_fp[:16],
                    "tokens": slots_live.get(s.id, s.tokens_hint),
                    "inflight": s.inflight,
                    "kind": s.last_kind,
                }
                for s in self.slots.slots
            ],
            "prefixes": [
                {
                    "fingerprint": i.fingerprint[:16],
                    "client": i.client,
                    "tokens": i.n_tokens,
                    "source": i.source,
                    # Unknown for prefixes reloaded from disk until a request renders again.
                    "share": round(i.n_tokens / i.meta["rendered_tokens"], 4)
                    if i.meta.get("rendered_tokens")
                    else None,
                }
                for i in self.by_fp.values()
            ],
            "saved": [
                {
                    "file": r.filename,
                    "fingerprint": r.fingerprint[:16],
                    "tokens": r.n_tokens,
                    "bytes": r.bytes,
                    "ttl_class": r.ttl_class,
                    "pinned": r.pinned,
                    "last_used": r.last_used,
                    "verified": r.verify_result,
                    "current": r.identity == ident,
                    "kind": r.kind,  # "prefix" or "conversation" (with its session)
                    "session": r.session,
                    "client": r.client,
                    "created": r.created,
                }
                for r in states
            ],
            "divergences": list(self.divergences)[:5],
            "restore_shortfalls": list(self.restore_shortfalls)[:5],
            # How prefixes reached the disk since the start (core.cache.prefix_save).
            "prefix_saves": self.prefix_saver.status(),
            "explained": self.explainer.status(),
            "context_limits": self.context_limits.status(),
            "template_warning": self.learner.template_warning,
            # API → why the running server's requests of it are not managed (core.chat)
            "unmanaged_apis": {
                f"/v1/{e}": why
                for e in apis.CHAT_ENDPOINTS
                if self.identity is not None
                and (why := apis.unmanaged_reason(e, self.identity.patches))
            },
            # True while the restore / prewarm after a (re)start still runs.
            "warming": self._ready_task is not None and not self._ready_task.done(),
            "boot_rewarm": self.boot.snapshot(),
            "pressure": self.pressure.snapshot(),
            "paused": list(self.pressure.paused().values()),
            "sweeps": self.sweeps.status() if self.sweeps is not None else [],
            "keepalive": {"last": self.keepalive.last},
            "text": "",
        }
        if self.has_db:  # the index is open (the engine's cache index)
            self.retention.annotate(out)  # TTL classes, expiries, the disk's use
        out["warmth"] = warmth(out)
        out["text"] = format_inventory(out) + "\n" + bg.format_background(out)
        if recent := format_recent(out["explained"]):
            out["text"] += "\n" + recent
        return out

    # ------------------------------------------------------------ commands
    async def pin(self, filename: str, pinned: bool = True) -> PinResult:
        """Pin or unpin a saved state (pinned: never expires or swept, kept warm)."""
        return await bg.pin(self, filename, pinned)

    async def evict(self, filename: str) -> EvictResult:
        """Delete a saved state now; refuses names Warmslot did not write."""
        return await bg.evict(self, filename)

    async def rewarm(self, fingerprint: str) -> RewarmResult:
        """Re-warm a prefix in its slot, or restore/prewarm it into a free slot."""
        return await bg.rewarm(self, fingerprint)

    async def warmed(self) -> None:
        """Wait until the warm-up after the last start (restore + verify, or prewarm) is done."""
        task = self._ready_task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def save_for_unload(self, timeout: float = 120.0) -> UnloadSaves:
        """Before the server is unloaded: finish the saves under way, then save every prefix
        its slots hold that is not on disk yet (only when the disk tier is valid)."""
        await self.warmed()
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=timeout)
        if not self.disk.usable or self.identity is None or self.client is None:
            return {"saved": 0, "on_disk": 0, "reason": self.disk.reason}
        # The live conversations first: a prefix they start with is then on disk too.
        conversations = await self.conversations.save_all()
        saved = 0
        for st in self.slots.slots:
            fp = st.prefix_fp
            info = self.by_fp.get(fp) if fp else None
            if info is None or fp in self._persisting or self.store.for_fingerprint(fp):
                continue
            if self.conversations.covering(info) is not None:
                continue
            self._persisting.add(fp)
            await self._persist(info, st.id)  # from the slot that holds it
            saved += 1
        on_disk = len(self.store.all(self.launch_id))
        return {
            "saved": saved,
            "on_disk": on_disk,
            "reason": self.disk.reason,
            "conversations": conversations,
        }

    async def save_conversation(self, slot: int, why: str) -> str:
        """Save the conversation `slot` holds beyond its stable prefix; "" when there is
        none to save, else what happened, in words."""
        if self.conversations.unsaved(slot) <= 0:
            return ""
        return await self.conversations.save(slot, why)

    async def close(self) -> None:
        """At shutdown (the server still runs): save live conversations, then stop."""
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self.client is not None and self.identity is not None:
            try:  # before the jobs are cancelled: a conversation save is a few ms each
                out = await self.conversations.save_all()
                log.info("conversations at shutdown: %s", self.conversations.describe(out))
            except Exception:
                log.exception("saving conversations at shutdown failed")
        self._write_definitions()  # learned by requests whose completion was not heard
        if self._definitions is not None and self.has_db:
            with contextlib.suppress(sqlite3.Error):
                self._definitions.flush()  # the uses noted since the last write
        for task in list(self._jobs):
            task.cancel()
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=5)


def policy_factory(core: EngineParts) -> CacheManager:
    """Entry point the CLI and the tray use to attach the cache manager to a core."""
    return CacheManager(deps_from(core))
