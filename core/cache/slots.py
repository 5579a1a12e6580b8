"""Which session lives in which slot, and what each slot holds.

Agent sessions are pinned to slots (least-recently-used free slot first, never
one another in-flight session holds); auxiliary calls go to a reserved slot
when there are at least two, so they never displace the primary's prefix.

A session seen for the first time goes where its stable prefix already is: a free
slot holding it, else — when the prefix is not saved on disk to be restored into an
empty slot — the idle slot of another session that holds it. That session's
conversation is saved before it is displaced (core.cache.manager) and comes back,
restored, into a slot of its own on its next turn: a save and a restore instead of
prefilling the whole shared prefix again (never worse than a bare llama-server with the
same memory, which routes the new session to the slot with the longest common prefix).

With API keys per user (docs/security.md#serving-a-team) each slot's session has an
owner, and slots are shared fairly: a new session may take an idle slot only when it is
empty, its own user's, or held by a user above their fair share (the agent slots ÷ the
users holding slots, the new session's user counted). One user's sessions never push
another user within their share out of a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from core.chat import JsonObject


@dataclass
class SlotState:
    id: int
    prefix_fp: str = ""  # fingerprint of the prefix the slot's content starts with
    session: str = ""  # session pinned here
    owner: str = ""  # the user (API key name) of that session; "" without keys
    last_used: float = 0.0
    inflight: int = 0
    last_body: JsonObject | None = None  # last chat request run here (its chat view)
    head_key: str = ""  # that request's system text and tools (`ChatView.head_key`)
    last_kind: str = ""
    tokens_hint: int = 0  # tokens we believe the slot holds
    session_of_last: str = ""  # session of the last request that ran here
    prompt_n_last: int = 0  # its prompt length
    # What the next request here should reuse because Warmslot just restored (or
    # re-warmed) it, and what was done: checked once in `completed`, so that a restore
    # that did not pay is said.
    promised: tuple[int, str] = (0, "")


@dataclass
class SlotMap:
    n_slots: int
    # Whether the last slot is kept for side calls (cache.aux_slot), asked each time:
    # the setting applies to the next request.
    reserve_aux: Callable[[], bool]
    clock: Callable[[], float] = time.monotonic
    slots: list[SlotState] = field(default_factory=list)
    sessions: dict[str, int] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # sessions that ever had a slot
    owners: dict[str, str] = field(default_factory=dict)  # session → its user (with keys)
    # Set (and replaced) whenever a request ends: what `wait_quiet` waits on.
    _ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self.slots = [SlotState(i) for i in range(self.n_slots)]

    @property
    def aux_slot(self) -> int | None:
        """The reserved side-call slot (the last one), or None with fewer than 2 slots."""
        return self.n_slots - 1 if self.n_slots >= 2 and self.reserve_aux() else None

    @property
    def primary_slots(self) -> list[SlotState]:
        aux = self.aux_slot
        return [s for s in self.slots if s.id != aux]

    def pick(
        self,
        session: str,
        kind: str,
        holding: Collection[int] = (),
        displace: bool = False,
        owner: str = "",
    ) -> tuple[int, str]:
        """The slot for a request, and why. `holding`: the slots whose content starts with
        the request's stable prefix; `displace`: a new session may take another session's
        idle slot among them (the caller decides: no saved state of the prefix to restore
        into an empty slot, and a prefix long enough that re-reading it costs more than
        moving a conversation); `owner`: the session's user (`fair`)."""
        aux = self.aux_slot
        if kind == "aux" and aux is not None:
            return aux, "side call → reserved slot"
        pinned = self.sessions.get(session)
        if pinned is not None and pinned != aux:
            return pinned, "session pinned"
        may = self.fair(owner)
        idle = [s for s in self.primary_slots if s.inflight == 0 and may(s)]
        free = [s for s in idle if not s.session or s.session not in self._active()]
        new = session not in self.seen
        holders = [s for s in idle if s.id in holding]
        if new and (held := [s for s in holders if not s.session]):
            best, why = min(held, key=lambda s: s.last_used), "free slot holding its prefix"
        elif new and holders and displace:
            best = min(holders, key=lambda s: s.last_used)
            why = "a new session goes where its prefix is (its session is saved and moves)"
        else:
            mine = [s for s in self.primary_slots if may(s)]
            candidates = free or idle or mine or self.primary_slots
            best = min(candidates, key=lambda s: (s.session != "", s.last_used))
            why = "least recently used free slot"
        if best.session and best.session != session:
            self.sessions.pop(best.session, None)
        best.session = session
        best.owner = owner
        self.sessions[session] = best.id
        self.seen.add(session)
        if owner:
            self.owners[session] = owner
        return best.id, why

    def fair(self, owner: str) -> Callable[[SlotState], bool]:
        """Which slots a new session of `owner` may take: an empty one, its own user's, or
        one of a user holding more than the fair share (agent slots ÷ users). With one
        user (or none: no API keys) every slot."""
        held: dict[str, int] = {}
        for s in self.primary_slots:
            if s.session:
                held[s.owner] = held.get(s.owner, 0) + 1
        users = set(held) | {owner}
        if len(users) < 2:
            return lambda s: True
        share = len(self.primary_slots) / len(users)
        return lambda s: not s.session or s.owner == owner or held.get(s.owner, 0) > share

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
        self._wake()

    def _wake(self) -> None:
        self._ended.set()
        self._ended = asyncio.Event()

    def busy(self, exclude: int | None = None) -> bool:
        """Whether a request is in flight in any slot but `exclude`."""
        return any(s.inflight for s in self.slots if s.id != exclude)

    async def wait_quiet(self, timeout: float, *, exclude: int | None = None) -> bool:
        """Until no request is in flight in any slot but `exclude` (woken by `end`, not
        polled); False when `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.busy(exclude):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), remaining)
        return True

    def reset(self) -> None:
        """Forget slot contents (after a server restart); keep session pins."""
        for s in self.slots:
            s.prefix_fp = ""
            s.inflight = 0
            s.tokens_hint = 0
            s.last_body = None
            s.head_key = ""
            s.session_of_last = ""
            s.prompt_n_last = 0
        self._wake()

    def release(self, session: str) -> int | None:
        slot = self.sessions.pop(session, None)
        if slot is not None and self.slots[slot].session == session:
            self.slots[slot].session = ""
        return slot
