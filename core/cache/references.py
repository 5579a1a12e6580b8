"""Known-answer references taken after the fact: `PendingReferences`.

A state written while a request waited for its slot (a displaced conversation,
core.cache.conversations) is indexed as `PENDING`: its file is hashed, but the probe
whose answer later restores are checked against must run alone (core.cache.probe.
ProbeGate), and the request must not wait for a quiet server. So the reference is taken
here, at the first quiet moment, in a slot whose content nobody needs (the side-call
slot, or an empty one): the file is restored there, probed, and the slot erased. A try
that found the server busy, no such slot, or a probe that shared the server is made
again after the next request ends — never given up; a restore that comes first takes
the reference itself (`SlotOps.restore`). A server start resumes what a previous run
left (docs/cache.md#conversations).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from core.cache.store import PENDING, StateRecord
from core.errors import UpstreamError

if TYPE_CHECKING:
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState

log = logging.getLogger("warmslot.cache")

QUIET_WAIT_S = 60.0  # one wait for a quiet server before looking again
TRY_PAUSES_S = (1.0, 4.0, 0.0)  # tries per kick, and the pause after each


class PendingReferences:
    """Takes the references of pending states when the server is quiet."""

    def __init__(
        self,
        state: CacheState,
        ops: SlotOps,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
    ) -> None:
        self.state = state
        self.ops = ops
        self._spawn = spawn  # the manager's background jobs (cancelled at close)
        self._pending: set[str] = set()  # file names of this server's pending states
        self._sought: set[str] = set()  # those whose reference is sought now

    def server_ready(self) -> None:
        """After a server start: learn what a previous run left pending, and seek it."""
        m = self.state
        self._pending.clear()
        if m.has_db:
            rows = m.store.table.rows_where(
                "identity = ? AND verify_result = ?", [m.launch_id, PENDING], select="filename"
            )
            self._pending.update(str(r["filename"]) for r in rows)
        self.kick()

    def add(self, rec: StateRecord) -> None:
        """A pending state was indexed: seek its reference."""
        self._pending.add(rec.filename)
        self.kick()

    def kick(self) -> None:
        """Seek every pending reference not sought now (after a request ended, at a
        start): one try each. O(1) when nothing is pending (the request path calls it)."""
        for name in self._pending - self._sought:
            self._sought.add(name)
            self._spawn(self._try(name))

    async def _try(self, name: str) -> bool:
        """A few tries, a little apart: the server may still be finishing a request its
        client left (it notices between batches) when the proxy already counts it done."""
        try:
            for pause in TRY_PAUSES_S:
                if await self._take(name):
                    return True
                if name not in self._pending:
                    return False
                await asyncio.sleep(pause)
            return False
        finally:
            self._sought.discard(name)

    async def _take(self, name: str) -> bool:
        """One try at `name`'s reference once the server is quiet; True when taken. The
        next `kick` tries again: a busy server, no free slot or a probe that shared the
        server only postpones it."""
        m = self.state
        if not await m.slots.wait_quiet(QUIET_WAIT_S):
            return False
        rec = m.store.get(name) if m.has_db else None
        if rec is None or rec.verify_result != PENDING:
            self._pending.discard(name)  # deleted (retention, superseded) or verified
            return False
        slot = self._borrowable()
        if m.client is None or slot is None or self.ops.busy():
            return False
        async with self.ops.lock(slot):
            if m.slots.busy(None) or m.store.check_file(rec) is not None:
                return False  # a request came in, or the file changed: its restore decides
            try:
                answer, times, restore_ms = await self.ops.reference(
                    name, rec.probe["prefix"], slot, tries=1
                )
            except UpstreamError as e:
                log.info("the reference of %s was not taken now: %s", name, e)
                return False
        if answer is None:
            return False
        self.ops.record_reference(rec, answer, times, restore_ms)
        self._pending.discard(name)
        return True

    def _borrowable(self) -> int | None:
        """A slot whose content nobody needs: the side-call slot, else an empty one."""
        slots = self.state.slots
        aux = slots.aux_slot
        if aux is not None and slots.slots[aux].inflight == 0:
            return aux
        empty = [s.id for s in slots.primary_slots if not s.tokens_hint and not s.inflight]
        return empty[0] if empty else None
