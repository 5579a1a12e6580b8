"""Keep-alive: keep each slot's prefix in its slot.

Every ``cache.keepalive_interval_s`` (default 4 min, at least 30 s), for each
stable prefix assigned to a primary slot (what Warmslot last put there), the
sweep reads ``GET /slots`` and compares the slot's ``n_prompt_tokens`` with
what Warmslot last sent:

- **displaced** — the slot holds fewer tokens than the prefix, or fewer than
  we left there (another client used the slot directly, the server cleared it,
  it restarted or slept): the prefix is re-warmed into the slot
  (``/completion`` with the prefix tokens, ``n_predict`` 0). With the server's
  RAM cache on, a displaced prefix usually comes back from there cheaply.
- **resident but idle** ≥ 80 % of the short TTL, and the slot holds just the
  prefix: re-warmed too, which costs one token (the server re-evaluates the last
  cached token; measured on a real server: ``cache_n`` = n − 1, ``prompt_n`` = 1).
  A slot that holds a whole conversation on top of the prefix is left alone:
  sending only the prefix would cut the conversation off.

Pinned prefixes that no slot holds are brought back into a free slot (restored
from disk and verified, or prewarmed). Under memory pressure (level ``low`` or
``critical``) only pinned prefixes are kept alive; if none qualifies, the sweep
does not call ``/slots`` at all (``/slots`` wakes a sleeping server).

Every re-warm is a ``CacheEvent`` of kind ``keepalive`` with ``cache_n``,
``prompt_n``, ``prompt_ms`` and ``cost_tokens`` (= ``prompt_n``), so its cost is
measured, not assumed.

A re-warmed prefix that has no saved state (it was evicted, rejected, or never saved) is
then saved from the slot that now holds it, where the server can write part of a slot
(patch 0004, ``prefix-save-v1``): a disk write and a probe, so that the next time it is
displaced it comes back by a restore, not by another prefill. Without the patch nothing
is saved here (saving would mean building it again in a scratch slot).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.cache import prefix as pfx
from core.cache.prefix_save import PATCH_PREFIX_SAVE
from core.cache.slot_ops import prewarm_body
from core.cache.slots import SlotState
from core.errors import UpstreamError, VerificationFailed
from core.events import CacheEvent, CacheEventKind
from core.machine.sweeps import Outcome
from core.server.client import SlotInfo, Timings
from core.status import KeepaliveDecision

if TYPE_CHECKING:
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState

__all__ = ["IDLE_SHARE", "KeepAlive", "Residency", "residency"]

log = logging.getLogger("warmslot.cache")

# The failure kind of each re-warm kind (keep-alive's own, or one the user asked for).
FAILED = {
    CacheEventKind.KEEPALIVE: CacheEventKind.KEEPALIVE_FAILED,
    CacheEventKind.REWARM: CacheEventKind.REWARM_FAILED,
}

IDLE_SHARE = 0.8  # re-warm a resident prefix idle this share of the short TTL
HINT_SLACK = 2  # the slot holds prompt + output − 1 tokens; our hint counts the last one


@dataclass(frozen=True)
class Residency:
    resident: bool
    reason: str


def residency(prefix_n: int, expected: int, live: int) -> Residency:
    """Does a slot still hold its prefix? `expected` is what Warmslot left there (0: unknown)."""
    if live < prefix_n:
        return Residency(
            False,
            f"displaced: the slot holds {live} tokens, fewer than the {prefix_n}-token prefix",
        )
    if expected and live < expected - HINT_SLACK:
        return Residency(
            False,
            f"displaced: the slot holds {live} tokens, Warmslot last left {expected} there",
        )
    # More than we left (a verification probe's tail, say) still starts with the prefix
    # as far as counts can tell; /slots shows no content
    # (docs/llama-server-facts.md#slots-endpoint).
    return Residency(True, "resident")


class KeepAlive:
    """The keep-alive sweep of one cache manager."""

    def __init__(self, state: CacheState, ops: SlotOps) -> None:
        self.state = state
        self.ops = ops
        self.clock = state.clock
        self.rewarmed_at: dict[int, float] = {}  # slot → monotonic time of our last re-warm
        self.last: list[KeepaliveDecision] = []  # the last sweep's decisions (status)

    def _emit(self, kind: CacheEventKind, reason: str, **kw: Any) -> None:
        details = kw.pop("details", {})
        self.state.publish(
            CacheEvent(kind=kind, reason=reason, details=details, ts=self.clock.time(), **kw)
        )

    def pinned(self, fp: str) -> bool:
        rec = self.state.store.for_fingerprint(fp)
        return rec is not None and rec.pinned

    def idle_threshold(self) -> float:
        return IDLE_SHARE * self.state.settings.cache.ttl_short_s

    def _busy(self, st: SlotState) -> bool:
        return st.inflight > 0 or self.ops.lock(st.id).locked()

    async def sweep(self) -> Outcome:
        state = self.state
        client = state.client
        decisions: list[KeepaliveDecision] = []
        self.last = decisions
        if client is None or state.identity is None or not state.settings.cache.enabled:
            return Outcome(0, {"skipped": "server not ready or cache management off"})
        aux = state.slots.aux_slot
        targets: list[tuple[SlotState, pfx.PrefixInfo, bool]] = []
        held: set[str] = set()
        for st in state.slots.slots:
            if not st.prefix_fp or st.id == aux or st.prefix_fp in held:
                continue
            info = state.by_fp.get(st.prefix_fp)
            if info is None or not info.tokens:
                continue
            held.add(st.prefix_fp)
            pinned = self.pinned(st.prefix_fp)
            if not state.pressure.allows_keepalive(pinned):
                decisions.append(
                    {
                        "slot": st.id,
                        "prefix": st.prefix_fp[:16],
                        "action": "skipped",
                        "why": state.pressure.paused().get("keepalive", ""),
                    }
                )
                continue
            targets.append((st, info, pinned))
        homeless = self._homeless_pinned(held)
        if homeless and self.free_slot() is None:
            for info in homeless:
                decisions.append(
                    {
                        "prefix": info.fingerprint[:16],
                        "pinned": True,
                        "action": "skipped",
                        "why": "pinned prefix has no slot and none is free",
                    }
                )
            homeless = []
        if not targets and not homeless:
            return Outcome(0, {"decisions": decisions})
        live = {s.id: s for s in await client.slots()}
        actions = 0
        for st, info, pinned in targets:
            if await self._check(st, info, pinned, live.get(st.id), decisions):
                actions += 1
        for info in homeless:
            if await self._bring_back(info, decisions):
                actions += 1
        return Outcome(actions, {"decisions": decisions})

    async def _check(
        self,
        st: SlotState,
        info: pfx.PrefixInfo,
        pinned: bool,
        live: SlotInfo | None,
        decisions: list[KeepaliveDecision],
    ) -> bool:
        entry: KeepaliveDecision = {
            "slot": st.id,
            "prefix": info.fingerprint[:16],
            "pinned": pinned,
        }
        decisions.append(entry)
        if live is None or live.is_processing or self._busy(st):
            entry.update({"action": "skipped", "why": "slot busy"})
            return False
        res = residency(info.n_tokens, st.tokens_hint, live.n_prompt_tokens)
        now = self.clock.monotonic()
        idle = now - max(st.last_used, self.rewarmed_at.get(st.id, float("-inf")))
        entry.update(
            {"live_tokens": live.n_prompt_tokens, "expected": st.tokens_hint, "idle_s": idle}
        )
        if res.resident:
            if st.tokens_hint > info.n_tokens + HINT_SLACK:
                entry.update({"action": "none", "why": "resident (holds a conversation on top)"})
                return False
            threshold = self.idle_threshold()
            if idle < threshold:
                entry.update({"action": "none", "why": "resident"})
                return False
            reason = (
                f"resident, idle {idle:.0f} s ≥ {IDLE_SHARE:.0%} of the short TTL "
                f"({threshold:.0f} s)"
            )
        else:
            reason = res.reason
        t = await self.rewarm_in(info, st.id, reason=reason, resident=res.resident)
        entry.update(
            {"action": "rewarmed", "why": reason, "cost_tokens": t.prompt_n if t else None}
        )
        return t is not None

    async def rewarm_in(
        self,
        info: pfx.PrefixInfo,
        slot: int,
        *,
        reason: str,
        resident: bool | None = None,
        kind: CacheEventKind = CacheEventKind.KEEPALIVE,
    ) -> Timings | None:
        """Prewarm `info` into `slot` under the slot's lock; record the cost."""
        state = self.state
        client = state.client
        if client is None:
            return None
        async with self.ops.lock(slot):
            st = state.slots.slots[slot]
            if st.inflight:
                return None
            try:
                resp = await client.completion(prewarm_body(info.tokens, slot))
            except UpstreamError as e:
                self._emit(
                    FAILED[kind],
                    f"re-warm failed: {e}",
                    fingerprint=info.fingerprint[:16],
                    slot=slot,
                )
                return None
            t = Timings.parse(resp.get("timings"))
            st.prefix_fp = info.fingerprint
            st.tokens_hint = info.n_tokens
            self.rewarmed_at[slot] = self.clock.monotonic()
        saving = self._save_from_live(info, slot)
        self._emit(
            kind,
            reason,
            fingerprint=info.fingerprint[:16],
            slot=slot,
            tokens=info.n_tokens,
            details={
                "resident": resident,
                "cache_n": t.cache_n if t else None,
                "prompt_n": t.prompt_n if t else None,
                "prompt_ms": t.prompt_ms if t else None,
                "cost_tokens": t.prompt_n if t else None,
                "saving": saving,
            },
        )
        return t

    def _save_from_live(self, info: pfx.PrefixInfo, slot: int) -> bool:
        """Start saving `info` from `slot`, which now holds exactly it, when it has no saved
        state and the server can save part of a slot (no prefill); whether it started."""
        state = self.state
        ident = state.identity
        if ident is None or PATCH_PREFIX_SAVE not in ident.patches or not state.disk.usable:
            return False
        if state.store.for_fingerprint(info.fingerprint) is not None:
            return False
        return self.ops.persist_soon(info, slot)

    def _homeless_pinned(self, held: set[str]) -> list[pfx.PrefixInfo]:
        """Pinned prefixes of this server that no slot holds."""
        state = self.state
        if state.identity is None:
            return []
        out = []
        for rec in state.store.all(state.launch_id):
            if rec.pinned and rec.kind == "prefix" and rec.fingerprint not in held:
                info = state.by_fp.get(rec.fingerprint)
                if (
                    info is not None
                    and info.tokens
                    and not any(s.prefix_fp == rec.fingerprint for s in state.slots.slots)
                ):
                    out.append(info)
        return out

    def free_slot(self) -> int | None:
        """A primary slot no session holds and no request uses, least recently used first."""
        state = self.state
        free = [
            s
            for s in state.slots.primary_slots
            if not s.session and not self._busy(s) and not self._pinned_prefix_in(s)
        ]
        if not free:
            return None
        return min(free, key=lambda s: s.last_used).id

    def _pinned_prefix_in(self, st: SlotState) -> bool:
        return bool(st.prefix_fp) and self.pinned(st.prefix_fp)

    async def _bring_back(self, info: pfx.PrefixInfo, decisions: list[KeepaliveDecision]) -> bool:
        slot = self.free_slot()
        entry: KeepaliveDecision = {"prefix": info.fingerprint[:16], "pinned": True, "slot": slot}
        decisions.append(entry)
        if slot is None:
            entry.update({"action": "skipped", "why": "pinned prefix has no slot and none is free"})
            return False
        ok = await self.restore_or_rewarm(info, slot, reason="pinned prefix was in no slot")
        entry.update(
            {"action": "rewarmed" if ok else "failed", "why": "pinned prefix was in no slot"}
        )
        return ok

    async def restore_or_rewarm(
        self,
        info: pfx.PrefixInfo,
        slot: int,
        *,
        reason: str,
        kind: CacheEventKind = CacheEventKind.KEEPALIVE,
    ) -> bool:
        """Restore the prefix from disk (verified) into `slot`, else prewarm it there."""
        state = self.state
        rec = state.store.for_fingerprint(info.fingerprint)
        if rec is not None and state.disk.usable:
            async with self.ops.lock(slot):
                if state.slots.slots[slot].inflight:
                    return False
                try:
                    await self.ops.restore(rec, slot)
                except (VerificationFailed, UpstreamError):
                    pass
                else:
                    self.rewarmed_at[slot] = self.clock.monotonic()
                    self._emit(
                        kind,
                        f"{reason}: restored from disk",
                        fingerprint=info.fingerprint[:16],
                        slot=slot,
                        tokens=info.n_tokens,
                        details={"resident": False, "restored": True},
                    )
                    return True
        if not info.tokens:
            return False
        t = await self.rewarm_in(info, slot, reason=reason, resident=False, kind=kind)
        return t is not None
