"""Idle sessions: a session whose slot has been untouched longer than its class's TTL
(under critical memory pressure: the short TTL; `Retention.session_limit`) gets its
stable prefix saved (when the disk tier is usable and persisting is not paused) and
the conversation beyond it, and its slot pin released, so another session can have the
slot. A returning session gets a slot again and its prefix or conversation restored
from disk (verified) or still warm. Every release is an ``evicted`` event with the reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from core.cache.retention import Retention
from core.cache.retention_plan import human_age
from core.cache.slot_ops import SlotOps
from core.cache.state import CacheState
from core.events import CacheEvent, CacheEventKind
from core.machine.sweeps import Outcome


class IdleRelease:
    """The idle-session sweep of one cache manager."""

    def __init__(
        self,
        state: CacheState,
        ops: SlotOps,
        retention: Retention,
        save_conversation: Callable[[int, str], Awaitable[str]],
    ) -> None:
        self.state = state
        self.ops = ops
        self.retention = retention
        # Saves the conversation a slot holds (core.cache.conversations): what happened.
        self._save_conversation = save_conversation

    async def sweep(self) -> Outcome:
        """Release every session idle past its limit (one ``evicted`` event each)."""
        state = self.state
        now = self.state.clock.monotonic()
        released: list[str] = []
        for st in state.slots.slots:
            if not st.session or st.inflight or self.ops.lock(st.id).locked():
                continue
            cls = self.retention.session_class(st.id, st.last_kind)
            limit = self.retention.session_limit(cls)
            idle = now - st.last_used
            if idle < limit:
                continue
            saved = self._save_for_release(st.prefix_fp, st.id)
            # The conversation beyond the prefix too, before another session may take
            # the slot (under the slot's lock; milliseconds, core.cache.conversations).
            session = st.session
            conversation = await self._save_conversation(st.id, "idle release")
            if st.inflight or st.session != session:
                continue  # the session came back while it was being saved
            if conversation:
                saved = f"{saved}; {conversation}"
            state.slots.release(session)
            ttl = self.retention.ttl(cls)
            why = (
                f"conversation idle {human_age(idle)} ≥ {cls} TTL {human_age(ttl)}"
                if limit == ttl
                else f"conversation idle {human_age(idle)} and memory pressure is critical "
                f"({state.pressure.why}): idle sessions are released first"
            )
            self.state.publish(
                CacheEvent(
                    kind=CacheEventKind.EVICTED,
                    reason=f"{why}: slot {st.id} released for other sessions; {saved}",
                    fingerprint=st.prefix_fp[:16],
                    slot=st.id,
                    tokens=st.tokens_hint or None,
                    details={
                        "rule": "idle_session",
                        "session": session,
                        "idle_s": round(idle, 1),
                        "ttl_class": cls,
                        "saved": saved,
                        "conversation": conversation,
                    },
                    ts=self.state.clock.time(),
                )
            )
            released.append(session)
        return Outcome(len(released), {"released": released})

    def _save_for_release(self, fp: str, slot: int) -> str:
        """Make sure the session's stable prefix is on disk (from `slot`, which holds it,
        where that needs no prefill: core.cache.prefix_save); say what happened."""
        state = self.state
        info = state.by_fp.get(fp) if fp else None
        if info is None:
            return "no stable prefix to save"
        if not state.disk.usable:
            return f"not saved: {state.disk.reason}"
        if state.store.for_fingerprint(fp) is not None:
            return "its prefix is already saved on disk"
        if fp in self.ops.persisting:
            return "its prefix is being saved"
        if not state.pressure.allows_persist():
            return f"not saved: {state.pressure.paused()['persist']}"
        if not self.retention.save_backoff.allows(fp):
            return "not saved: its last save failed, the next try waits (save backoff)"
        self.ops.persist_soon(info, slot)
        return "saving its prefix to disk"
