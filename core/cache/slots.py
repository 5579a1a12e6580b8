"""Which session lives in which slot, and what each slot holds.

Agent sessions are pinned to slots (least-recently-used free slot first, never
one another in-flight session holds); auxiliary calls go to a reserved slot
when there are at least two, so they never displace the primary's prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SlotState:
    id: int
    prefix_fp: str = ""  # fingerprint of the prefix the slot's content starts with
    session: str = ""  # session pinned here
    last_used: float = 0.0
    inflight: int = 0
    last_body: dict[str, Any] | None = None  # last chat request run here (for diagnosis)
    last_kind: str = ""
    tokens_hint: int = 0  # tokens we believe the slot holds
    session_of_last: str = ""  # session of the last request that ran here
    prompt_n_last: int = 0  # its prompt length
    # What the next request here should reuse because Warmslot just restored (or
    # re-warmed) it, and what was done: checked once in `completed` (issue 16, 0c).
    promised: tuple[int, str] = (0, "")


@dataclass
class SlotMap:
    n_slots: int
    reserve_aux: bool
    clock: Callable[[], float] = time.monotonic
    slots: list[SlotState] = field(default_factory=list)
    sessions: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slots = [SlotState(i) for i in range(self.n_slots)]

    @property
    def aux_slot(self) -> int | None:
        """The reserved side-call slot (the last one), or None with fewer than 2 slots."""
        return self.n_slots - 1 if self.reserve_aux and self.n_slots >= 2 else None

    @property
    def primary_slots(self) -> list[SlotState]:
        aux = self.aux_slot
        return [s for s in self.slots if s.id != aux]

    def pick(self, session: str, kind: str) -> tuple[int, str]:
        """The slot for a request, and why."""
        aux = self.aux_slot
        if kind == "aux" and aux is not None:
            return aux, "side call → reserved slot"
        pinned = self.sessions.get(session)
        if pinned is not None and pinned != aux:
            return pinned, "session pinned"
        free = [
            s
            for s in self.primary_slots
            if s.inflight == 0 and (not s.session or s.session not in self._active())
        ]
        candidates = (
            free or [s for s in self.primary_slots if s.inflight == 0] or self.primary_slots
        )
        best = min(candidates, key=lambda s: (s.session != "", s.last_used))
        if best.session and best.session != session:
            self.sessions.pop(best.session, None)
        best.session = session
        self.sessions[session] = best.id
        return best.id, "least recently used free slot"

    def _active(self) -> set[str]:
        return {s.session for s in self.slots if s.inflight > 0}

    def begin(self, slot: int) -> None:
        st = self.slots[slot]
        st.inflight += 1
        st.last_used = self.clock()

    def end(self, slot: int) -> None:
        st = self.slots[slot]
        st.inflight = max(0, st.inflight - 1)
        st.last_used = self.clock()

    def reset(self) -> None:
        """Forget slot contents (after a server restart); keep session pins."""
        for s in self.slots:
            s.prefix_fp = ""
            s.inflight = 0
            s.tokens_hint = 0
            s.last_body = None
            s.session_of_last = ""
            s.prompt_n_last = 0

    def release(self, session: str) -> int | None:
        slot = self.sessions.pop(session, None)
        if slot is not None and self.slots[slot].session == session:
            self.slots[slot].session = ""
        return slot
