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

The manager is the policy (`prepare`, `completed`) and the composition of the parts:
what the cache knows of its server is one `CacheState` (core.cache.state), what it does
to a slot goes through `SlotOps` (core.cache.slot_ops), and warm-up, keep-alive,
retention, idle release, conversations and prefix saves are handed those two, never the
manager. `prepare` decides and returns a `SlotPlan`; the proxy renders the response's
``X-Warmslot-*`` headers from it (core.proxy.headers).

Nothing here may break a request: the proxy catches any exception from
`prepare` and forwards the request untouched (fail-open). A restored state is
used only after a known-answer probe proves it: same greedy tokens, log-probs
within tolerance, and the expected reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

from core import chat as apis
from core.cache import background as bg
from core.cache import boundary, sources, warmup
from core.cache import prefix as pfx
from core.cache.boot import BootRewarm
from core.cache.conversations import NOT_RESUMED, Conversations
from core.cache.deps import CacheDeps, EngineParts, deps_from
from core.cache.explain import Explainer, format_recent
from core.cache.idle import IdleRelease
from core.cache.inventory import format_inventory, warmth
from core.cache.keepalive import KeepAlive
from core.cache.learner import PrefixLearner, chat_of
from core.cache.prefix_save import PrefixSaver
from core.cache.probe import REUSE_SLACK
from core.cache.retention import Retention
from core.cache.reuse import ReuseCheck
from core.cache.slot_ops import SlotOps
from core.cache.slots import SlotState
from core.cache.state import CacheState
from core.errors import UpstreamError
from core.events import CacheEventKind, Event, Notice, ServerStateChanged
from core.proxy.context_limit import ContextLimits
from core.proxy.types import ProxyRequest, SlotPlan
from core.routing.router import Kind
from core.server.client import Timings
from core.status import (
    CacheStatus,
    EvictResult,
    Explanation,
    PinResult,
    RewarmResult,
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


class CacheManager:
    """Implements `core.proxy.types.CacheService` for one llama-server, built from `CacheDeps`:
    the policy (`prepare`, `completed`) over one `CacheState` and its `SlotOps`, which it
    hands to warm-up, keep-alive, retention, conversations and prefix saves."""

    def __init__(self, deps: CacheDeps) -> None:
        self.deps = deps
        self.state = state = CacheState(deps)
        self.clock = deps.clock
        # Saving is the prefix saver's, discarding a rejected state retention's: both made
        # below, from the state and these operations.
        self.ops = ops = SlotOps(
            state,
            save=lambda info, slot: self.prefix_saver.persist(info, slot),
            may_save=lambda fp: self.retention.save_backoff.allows(fp),
            discard=lambda rec, why: self.retention.discard(rec, why),
            spawn=self._spawn,
        )
        self.explainer = Explainer(state.publish)  # why each request reused what it did
        # What finished requests reused against what they should have (core.cache.reuse).
        self.reuse = ReuseCheck(state, self.explainer, self._spawn)
        # APIs whose requests the running server does not let the cache manage, once
        # told about (core.chat.unmanaged_reason).
        self._told_unmanaged: set[str] = set()
        self.context_limits = ContextLimits()  # requests that hit their slot's context
        # Finds each request's stable prefix (rendering, boundaries, template check).
        self.learner = PrefixLearner(
            state.emit,
            state.publish,
            state.remember,
            lambda: state.identity,
            lambda: state.by_fp,
            clock=self.clock.time,
        )
        self._jobs: set[asyncio.Task[Any]] = set()
        self._run_id = ""
        self._ready_task: asyncio.Task[None] | None = None
        # Set once the identity of the (re)started server is learned (or failed): a
        # request arriving right after "ready" waits for it rather than go unmanaged.
        self._identity_known = asyncio.Event()
        self.boot = BootRewarm(state.emit, self.clock.time)  # progress of the boot re-warm
        # Background work: the engine's scheduler runs this manager's retention and
        # keep-alive (core.cache.background).
        self.retention = Retention(state, ops, slot_dir=deps.slot_dir, peers=deps.peers)
        # Sessions idle past their TTL give up their slot (core.cache.idle).
        self.idle_release = IdleRelease(state, ops, self.retention, self.save_conversation)
        self.keepalive = KeepAlive(state, ops)
        # Whole conversations saved and restored (core.cache.conversations).
        self.conversations = Conversations(state, ops, self.retention, self._spawn)
        # Prefix states written from the live slot that holds them (core.cache.prefix_save).
        self.prefix_saver = PrefixSaver(state, ops, self.retention, self.conversations, self._spawn)
        deps.subscribe(self._on_event, (ServerStateChanged,))

    @property
    def model(self) -> str:
        """The model profile's name; "" for the primary server."""
        return self.state.model

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._jobs.add(task)
        task.add_done_callback(self._job_done)
        return task

    def _job_done(self, task: asyncio.Task[Any]) -> None:
        self._jobs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cache job failed: %r", task.exception(), exc_info=task.exception())

    def _on_event(self, event: Event) -> None:
        if not isinstance(event, ServerStateChanged) or event.model != self.state.model:
            return
        sup = self.state.server
        if event.state == "ready" and sup is not None and sup.run_id != self._run_id:
            self._run_id = sup.run_id
            self.state.slots.reset()
            self._identity_known.clear()
            if self._ready_task is not None and not self._ready_task.done():
                self._ready_task.cancel()  # the warm-up of a server that is gone
            self._ready_task = asyncio.ensure_future(self._after_ready())
        elif event.state in ("starting", "stopped", "failed"):
            self.state.server_gone()
            self.learner.server_gone()
            self._told_unmanaged.clear()  # the next server may carry the patch
            self.conversations.server_gone()
            self.prefix_saver.server_gone()
            self.boot.forget()  # the last start's re-warm says nothing about the next
            self.explainer.forget()

    # ------------------------------------------------------------ server start
    async def _after_ready(self) -> None:
        """Learn the server identity; restore (verified) or prewarm recent prefixes."""
        state = self.state
        try:
            facts = await warmup.read_server(state)
            state.server_ready(facts)
            warmup.know_prefixes(state, self.learner, facts)
        except Exception as e:
            log.exception("could not read the server identity; cache management paused")
            state.emit(CacheEventKind.IDENTITY_FAILED, f"could not read server identity: {e!r}")
            return
        finally:
            self._identity_known.set()
        if not state.settings.cache.enabled:
            return
        await warmup.warm_known(state, self.ops, self.boot, self.conversations)
        self.conversations.references.server_ready()  # what a previous run left pending

    # ------------------------------------------------------------ request path
    async def prepare(self, req: ProxyRequest) -> SlotPlan | None:
        """The slot for a chat request, made to hold its stable prefix where that is
        cheap; None when the cache leaves the request alone. Reads the router's
        decision (kind, session), classifies nothing."""
        settings = self.state.settings.cache
        if settings.enabled and self._ready_task is not None and not self._identity_known.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._identity_known.wait(), IDENTITY_WAIT_S)
        client = self.state.client
        if not settings.enabled or client is None or self.state.identity is None:
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
        fp = info.fingerprint if info is not None else ""
        # Compared in chat form: a slot keeps its last request's chat view (a Messages or
        # Responses body never equals it, and its new session went to an empty slot).
        chat = chat_of(req)
        head = req.chat.head_key
        holding = [st.id for st in self.state.slots.slots if fp and self._holds(st, fp, head)]
        # A new session takes another's idle slot holding its prefix only where nothing
        # brings the prefix into an empty slot (core.cache.sources.displace).
        can_copy = self.prefix_saver.can_save_prefix()
        displace = info is not None and sources.displace(
            self.state, self.conversations, info, session, holding, can_copy, DISPLACE_MIN_TOKENS
        )
        slot, why_slot = self.state.slots.pick(session, req.kind, holding, displace, owner=req.user)
        if info is not None and req.user:
            self.state.prefix_owners.setdefault(info.fingerprint, req.user)
        req.slot = slot
        if side and slot == self.state.slots.aux_slot:
            self.state.emit(CacheEventKind.AUX_ISOLATED, decision.why, slot=slot, client=req.client)
        # Never wait for the boot re-warm of another prefix: skip or stop it.
        self.boot.claim(slot, info.fingerprint if info is not None else "")
        async with self.ops.lock(slot):  # wait for Warmslot's own work on this slot
            pass
        resumed = NOT_RESUMED
        if info is not None:
            info.last_used = self.clock.time()  # noted in the index in `completed`
            await self._save_displaced(slot, session)
            # A saved conversation this request continues beats its stable prefix.
            resumed = await self.conversations.restore_for(req, info, slot, session)
            if not resumed.restored:
                await self._ensure_slot(info, slot, session, holding)
                st = self.state.slots.slots[slot]
                if self.state.disk.rewinds and boundary.needs_mark(
                    st, info.fingerprint, info.n_tokens, chat, session
                ):
                    req.split = await self.ops.read_prefix_alone(info, slot, req.gone)
        body["id_slot"] = slot
        body["cache_prompt"] = True
        self.state.slots.begin(slot)
        restored, what = self.state.slots.slots[slot].promised
        if restored:  # Warmslot filled the slot: it no longer holds the last request's prompt
            self.explainer.slot_changed(slot)
        warning = self.learner.template_warning
        return SlotPlan(
            slot,
            why_slot,
            session,
            decision.kind,
            info.fingerprint if info is not None else "",
            info.n_tokens if info is not None else 0,
            # From disk and verified (`SlotOps.restore`), not re-warmed.
            restored if what.startswith("restored") else 0,
            warning if warning and (req.has_tools or not side) else "",
            resumed.header,
        )

    def _api_managed(self, req: ProxyRequest) -> bool:
        """Whether the running server lets the cache pin `req`'s API to a slot; when it
        does not (stock llama-server drops id_slot on /v1/messages), say so once per
        server start — in `status` and as a notice — and leave the request alone."""
        assert self.state.identity is not None
        why = apis.unmanaged_reason(req.endpoint, self.state.identity.patches)
        if not why:
            return True
        if req.endpoint not in self._told_unmanaged:
            self._told_unmanaged.add(req.endpoint)
            log.warning("%s requests are forwarded unmanaged: %s", req.endpoint, why)
            self.state.publish(Notice(level="warning", text=f"{req.path}: {why}"))
        return False

    async def _ensure_slot(
        self, info: pfx.PrefixInfo, slot: int, session: str = "", holding: Sequence[int] = ()
    ) -> None:
        """Make the slot hold the prefix before the request runs, if that can be done
        cheaply: copied from an idle slot of `holding` (slots whose content starts with it),
        or restored from the longest verified state on disk that it starts with
        (core.cache.sources) — never a cold prefill while a copy exists."""
        st = self.state.slots.slots[slot]
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
        copy = self.prefix_saver.copy if self.prefix_saver.can_save_prefix() else None
        await sources.bring(self.state, self.ops, self.conversations, info, slot, holding, copy)

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
        overwrite in `slot` (when agents outnumber agent slots). llama-server's
        RAM cache keeps a displaced state only when the new prompt keeps less than half
        of it, so conversations under a shared prefix longer than their tails were lost;
        a live slot save costs milliseconds and no prefill (docs/cache.md#crowding)."""
        st = self.state.slots.slots[slot]
        if st.inflight or not st.session_of_last or st.session_of_last == session:
            return
        if self.conversations.unsaved(slot) <= 0:
            return
        t0 = time.perf_counter()
        try:
            # The file now (milliseconds); its hash and reference in the background: this
            # request waits for no probe and no quiet moment (docs/cache.md#conversations).
            outcome = await self.conversations.save(slot, "displaced", later=True)
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
        held = self.state.by_fp.get(held_fp) if held_fp else None
        n = info.n_tokens
        return held is not None and held.n_tokens >= n and held.tokens[:n] == info.tokens

    async def completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        # A request that hit its slot's context is never silent (core.proxy.context_limit).
        plan = req.plan
        if plan is not None:  # before anything that waits: the slot is free now
            self.state.slots.end(plan.slot)
            self.conversations.references.kick()  # a pending reference may be taken now
        await self.context_limits.observe(
            req, timings, self.state.client, self.state.identity, self.state.emit
        )
        if plan is None:
            return
        # The index learns of the request after its response: a new definition, a use.
        self.state.write_definitions()
        fp = plan.prefix_fp
        if (touched := self.state.by_fp.get(fp) if fp else None) is not None:
            self.state.touch(touched)
        slot = plan.slot
        st = self.state.slots.slots[slot]
        promised, st.promised = st.promised, (0, "")
        if status != 200 or timings is None:
            return
        self.reuse.keep(req, timings)
        if promised[0]:
            self.reuse.check_promise(req, promised, timings)
        previous_body, previous_fp = st.last_body, st.prefix_fp
        previous_session, previous_prompt = st.session_of_last, st.prompt_n_last
        st.tokens_hint = timings.cache_n + timings.prompt_n + timings.predicted_n
        st.last_body, st.last_kind, st.prefix_fp = chat_of(req), req.kind, fp
        st.head_key = req.chat.head_key if req.chat is not None else ""
        st.session_of_last = plan.session
        st.prompt_n_last = timings.cache_n + timings.prompt_n
        if plan.kind is Kind.SIDE:
            if previous_fp and slot != self.state.slots.aux_slot:
                self.state.emit(
                    CacheEventKind.DISPLACED,
                    "a side call ran in the primary slot (one slot only); "
                    "the server's RAM cache brings the prefix back",
                    fp=previous_fp,
                    slot=slot,
                )
            return
        info = self.state.by_fp.get(fp) if fp else None
        expected, what = 0, ""
        if previous_session and previous_session == st.session_of_last and previous_prompt:
            expected, what = previous_prompt - pfx.MIN_PREFIX_TOKENS, "the conversation so far"
        elif info is not None and previous_fp == fp:
            head = int(info.meta.get("head_n") or info.n_tokens)
            expected, what = head - REUSE_SLACK, "the stable prefix"
            if self.state.disk.rewinds:  # back to the checkpoint 4 tokens before its end
                expected -= boundary.CHECKPOINT_TAIL
        if previous_body is not None:
            self.reuse.diagnose_soon(req, timings, expected, what)
        if plan.session:
            self.conversations.after_response(slot)  # debounced conversation save
        if info is not None and self.state.disk.usable and fp not in self.ops.persisting:
            rec = self.state.store.for_fingerprint(fp)
            if rec is not None:
                self.state.store.touch(rec.filename)
            elif self.conversations.covering(info) is None:
                self.ops.persist_soon(info, slot)  # from this slot, which holds it now

    async def explain(self, request_id: str | None) -> Explanation | None:
        """Why a request reused what it did (the latest when None; core.cache.reuse)."""
        return await self.reuse.explain(request_id)

    # ------------------------------------------------------------ status / lifecycle
    def idle(self) -> bool:
        """True when no background cache work (warm-up after start, persist, restore) runs."""
        ready = self._ready_task is None or self._ready_task.done()
        return ready and not self._jobs and not self.ops.busy()

    async def status(self) -> CacheStatus:
        """Cache inventory: slots, saved states, prefixes, last divergences."""
        state = self.state
        slots_live: dict[int, int] = {}
        client = state.client
        if client is not None:
            with contextlib.suppress(UpstreamError):
                slots_live = {s.id: s.n_prompt_tokens for s in await client.slots()}
        ident = state.launch_id if state.identity else None
        states = state.store.all() if state.has_db else []
        out: CacheStatus = {
            "enabled": state.settings.cache.enabled,
            "identity": ident,
            "disk_tier": {"usable": state.disk.usable, "reason": state.disk.reason},
            "aux_slot": state.slots.aux_slot,
            "slots": [
                {
                    "id": s.id,
                    "session": s.session,
                    "prefix": s.prefix_fp[:16],
                    "tokens": slots_live.get(s.id, s.tokens_hint),
                    "inflight": s.inflight,
                    "kind": s.last_kind,
                }
                for s in state.slots.slots
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
                for i in state.by_fp.values()
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
            "divergences": list(self.reuse.divergences)[:5],
            "restore_shortfalls": list(self.reuse.restore_shortfalls)[:5],
            # How prefixes reached the disk since the start (core.cache.prefix_save).
            "prefix_saves": self.prefix_saver.status(),
            "explained": self.explainer.status(),
            "context_limits": self.context_limits.status(),
            "template_warning": self.learner.template_warning,
            # API → why the running server's requests of it are not managed (core.chat)
            "unmanaged_apis": {
                f"/v1/{e}": why
                for e in apis.CHAT_ENDPOINTS
                if state.identity is not None
                and (why := apis.unmanaged_reason(e, state.identity.patches))
            },
            # True while the restore / prewarm after a (re)start still runs.
            "warming": self._ready_task is not None and not self._ready_task.done(),
            "boot_rewarm": self.boot.snapshot(),
            "pressure": state.pressure.snapshot(),
            "paused": list(state.pressure.paused().values()),
            "sweeps": state.sweeps.status() if state.sweeps is not None else [],
            "keepalive": {"last": self.keepalive.last},
            "text": "",
        }
        if state.has_db:  # the index is open (the engine's cache index)
            self.retention.annotate(out)  # TTL classes, expiries, the disk's use
        out["warmth"] = warmth(out)
        out["text"] = format_inventory(out) + "\n" + bg.format_background(out)
        if recent := format_recent(out["explained"]):
            out["text"] += "\n" + recent
        return out

    # ------------------------------------------------------------ commands
    async def pin(self, filename: str, pinned: bool = True) -> PinResult:
        """Pin or unpin a saved state (pinned: never expires or swept, kept warm)."""
        return await bg.pin(self.state, filename, pinned)

    async def evict(self, filename: str) -> EvictResult:
        """Delete a saved state now; refuses names Warmslot did not write."""
        return await bg.evict(self.state, filename)

    async def rewarm(self, fingerprint: str) -> RewarmResult:
        """Re-warm a prefix in its slot, or restore/prewarm it into a free slot."""
        return await bg.rewarm(self.state, self.keepalive, fingerprint)

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
        if not self.state.disk.usable or self.state.identity is None or self.state.client is None:
            return {"saved": 0, "on_disk": 0, "reason": self.state.disk.reason}
        # The live conversations first: a prefix they start with is then on disk too.
        conversations = await self.conversations.save_all()
        saved = 0
        for st in self.state.slots.slots:
            fp = st.prefix_fp
            info = self.state.by_fp.get(fp) if fp else None
            if info is None or fp in self.ops.persisting or self.state.store.for_fingerprint(fp):
                continue
            if self.conversations.covering(info) is not None:
                continue
            await self.ops.persist_now(info, st.id)  # from the slot that holds it
            saved += 1
        on_disk = len(self.state.store.all(self.state.launch_id))
        return {
            "saved": saved,
            "on_disk": on_disk,
            "reason": self.state.disk.reason,
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
        if self.state.client is not None and self.state.identity is not None:
            try:  # before the jobs are cancelled: a conversation save is a few ms each
                out = await self.conversations.save_all()
                log.info("conversations at shutdown: %s", self.conversations.describe(out))
            except Exception:
                log.exception("saving conversations at shutdown failed")
        # Learned by requests whose completion was not heard, and the uses noted since the
        # last write.
        self.state.flush_definitions()
        for task in list(self._jobs):
            task.cancel()
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=5)


def policy_factory(core: EngineParts) -> CacheManager:
    """Entry point the CLI and the tray use to attach the cache manager to a core."""
    return CacheManager(deps_from(core))
