"""Which backend serves a request: the choice rule of several backends (docs/scale.md).

Pure bookkeeping, no I/O: the router (`core.routing.router`) asks `Affinity.choose` once per
request with a view of every backend (`BackendView`) and gets a `Pick`. The rule:

1. An agent turn of a session that already has a ready backend goes there (a
   session sticks: its conversation lives in that backend's slot).
2. A new session goes to a ready backend that already holds its stable prefix — the
   last backends that served an agent turn with the same affinity key — unless that
   backend has `MAX_SPREAD` more active sessions than the least loaded one (then the
   prefix is restored there from the shared disk tier, or rebuilt).
3. Else the least loaded ready backend: fewest requests in flight, then fewest active
   sessions, then the order of the settings.

A backend that stops being ready after it was (a crash, a stop, a failed health
check: `backend_down`) has lost its slots: it holds no prefix any more, its sessions
are placed again by rules 2–3 at their next turn (they *move*), and for `COOLDOWN_S`
it takes no new placement while another ready backend can (a server that crashed and
came back at once may crash again; its sessions should not return to it).
4. A side call goes to its session's backend when that backend's side slot is free,
   else to the least loaded backend whose side slot is free, else to its session's
   backend (or the least loaded); side calls never pin a session.

With no backend ready the same rule runs over all of them (the admission then waits
for the chosen one to start, or answers 503).

The affinity key (`affinity_key`) is the text the stable prefix is made of: the system
text up to the client profile's first volatile marker (`core.cache.prefix`) and the
tools' names and descriptions. Equal stable text renders to the same prefix tokens,
so on backends with the same server identity it has the same prefix fingerprint
(`core.cache.fingerprint`): what one backend saved, another restores.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core import chat as apis
from core.routing import profiles

__all__ = [
    "ACTIVE_S",
    "COOLDOWN_S",
    "MAX_SESSIONS",
    "MAX_SPREAD",
    "Affinity",
    "BackendView",
    "Pick",
    "affinity_key",
]

MAX_SESSIONS = 10_000  # sessions remembered (least recently used forgotten first)
MAX_KEYS = 1_000  # stable prefixes remembered
HOLDERS = 4  # backends remembered per stable prefix (most recent first)
ACTIVE_S = 600.0  # a session counts towards its backend's load this long after its turn
MAX_SPREAD = 4  # active sessions a prefix holder may have beyond the least loaded
COOLDOWN_S = 60.0  # a failed backend takes no new placement this long (if others can)


@dataclass(frozen=True)
class BackendView:
    """One backend as the choice sees it at one moment."""

    name: str
    ready: bool
    inflight: int = 0  # requests it serves now
    side_busy: bool = False  # its side slot serves a side call now


@dataclass(frozen=True)
class Pick:
    """The chosen backend and why, in words."""

    backend: str
    why: str
    moved_from: str = ""  # the session's backend before, when it was not ready


def affinity_key(client: str, body: Mapping[str, object]) -> str:
    """The stable prefix's text as a short hash ("" when a request has neither tools
    nor system text: nothing to be affine to, or its messages are not readable)."""
    try:
        system = apis.system_text(body)
    except (AttributeError, TypeError):  # not a list of message objects: no affinity
        return ""
    tools = body.get("tools")
    if not system and not tools:
        return ""
    markers = profiles.PROFILES.get(client, profiles.GENERIC_MARKERS)
    cut = min((i for m in markers if (i := system.find(m)) >= 0), default=len(system))
    h = hashlib.sha256(system[:cut].encode() + b"\0")
    # Each tool's name and description, not its whole schema: serializing 20 KB of tool
    # schemas costs ~0.4 ms a request, hashing their text ~0.02 ms. Two tool sets that
    # differ only in a parameter share a key: their sessions share a backend, where the
    # cache manager's fingerprint (of the exact tokens) still tells the prefixes apart.
    for tool in tools if isinstance(tools, list) else ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict):
            h.update(f"{fn.get('name')}\0{fn.get('description')}\0".encode())
    return h.hexdigest()[:16]


class Affinity:
    """Where each session and each stable prefix lives; chooses a backend per request."""

    def __init__(
        self,
        *,
        active_s: float = ACTIVE_S,
        max_spread: int = MAX_SPREAD,
        cooldown_s: float = COOLDOWN_S,
    ) -> None:
        self.active_s = active_s
        self.max_spread = max_spread
        self.cooldown_s = cooldown_s
        # session → (backend, last agent turn), least recently used first.
        self.sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        # affinity key → backends that served it, most recent first.
        self.holders: OrderedDict[str, list[str]] = OrderedDict()
        self.moved = 0  # sessions moved off a backend that failed
        # Sessions of a failed backend, not placed again yet: session → that backend.
        self.orphans: OrderedDict[str, str] = OrderedDict()
        self._up: set[str] = set()  # backends seen ready (and not down since)
        self._failed_at: dict[str, float] = {}
        # `active`'s counts, recounted at most once a second and kept up as sessions
        # are placed (a recount walks every active session).
        self._counts: dict[str, int] | None = None
        self._counted_at = 0.0

    def backend_of(self, session: str) -> str:
        """The backend a session is pinned to ("" when none)."""
        entry = self.sessions.get(session)
        return entry[0] if entry is not None else ""

    def active(self, now: float) -> dict[str, int]:
        """Sessions per backend whose last agent turn was within `active_s` (recounted
        at most once a second; do not change the answer)."""
        if self._counts is not None and 0 <= now - self._counted_at < 1.0:
            return self._counts
        counts: dict[str, int] = {}
        for backend, last in reversed(self.sessions.values()):
            if now - last > self.active_s:
                break  # ordered by last use: everything before is older
            counts[backend] = counts.get(backend, 0) + 1
        self._counts, self._counted_at = counts, now
        return counts

    def _pin(self, session: str, backend: str, now: float) -> None:
        before = self.sessions.get(session)
        if self._counts is not None and (before is None or before[0] != backend):
            if before is not None and now - before[1] <= self.active_s:
                self._counts[before[0]] = max(0, self._counts.get(before[0], 0) - 1)
            self._counts[backend] = self._counts.get(backend, 0) + 1
        self.sessions[session] = (backend, now)
        self.sessions.move_to_end(session)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def choose(
        self,
        views: Sequence[BackendView],
        *,
        session: str,
        side: bool,
        key: str,
        now: float,
    ) -> Pick:
        """The backend for one request (rules in the module docstring); an agent turn's
        choice is remembered (session pinned, prefix holder noted)."""
        assert views, "at least the primary backend"
        for v in views:
            if v.ready:
                self._up.add(v.name)
            elif v.name in self._up:  # not told yet (`backend_down`): seen here
                self.backend_down(v.name, now)
        ready = [v for v in views if v.ready]
        fresh = [v for v in ready if now - self._failed_at.get(v.name, -1e18) > self.cooldown_s]
        pool = fresh or ready or list(views)
        names = {v.name for v in (ready or views)}
        order = {v.name: i for i, v in enumerate(views)}
        active = self.active(now)

        def load(v: BackendView) -> tuple[int, int, int]:
            return (v.inflight, active.get(v.name, 0), order[v.name])

        least = min(pool, key=load)
        home = self.backend_of(session) if session else ""
        if side:
            by_name = {v.name: v for v in (ready or views)}
            if home in by_name and not by_name[home].side_busy:
                return Pick(home, f"side call: its session's backend {home!r} has a free side slot")
            free = [v for v in pool if not v.side_busy]
            if free:
                slot = min(free, key=load)
                return Pick(slot.name, f"side call: backend {slot.name!r} has a free side slot")
            if home in by_name:
                return Pick(home, f"side call: no free side slot; its session's backend {home!r}")
            return Pick(least.name, f"side call: no free side slot; least loaded {least.name!r}")
        if home and home in names:
            pick = Pick(home, f"session sticks to backend {home!r}")
        else:
            failed = self.orphans.pop(session, "") if session else ""
            if home and not failed:  # its backend is not ready (never seen ready)
                failed = home
            pick = self._new_session(pool, key, least, load, active)
            if failed and failed != pick.backend:
                self.moved += 1
                pick = Pick(
                    pick.backend, f"moved from backend {failed!r} (failed): {pick.why}", failed
                )
        if session:
            self._pin(session, pick.backend, now)
        if key:
            held = [b for b in self.holders.get(key, []) if b != pick.backend]
            self.holders[key] = [pick.backend, *held][:HOLDERS]
            self.holders.move_to_end(key)
            while len(self.holders) > MAX_KEYS:
                self.holders.popitem(last=False)
        return pick

    def backend_down(self, name: str, now: float) -> None:
        """`name` stopped being ready after it was: it holds no prefix any more, its
        sessions are placed again at their next turn, and it cools down."""
        self._up.discard(name)
        self._failed_at[name] = now
        self._counts = None
        for held in self.holders.values():
            if name in held:
                held.remove(name)
        for session, (backend, _last) in list(self.sessions.items()):
            if backend == name:
                del self.sessions[session]
                self.orphans[session] = name
        while len(self.orphans) > MAX_SESSIONS:
            self.orphans.popitem(last=False)

    def _new_session(
        self,
        pool: Sequence[BackendView],
        key: str,
        least: BackendView,
        load: Any,
        active: dict[str, int],
    ) -> Pick:
        by_name = {v.name: v for v in pool}
        holders = [by_name[b] for b in self.holders.get(key, []) if key and b in by_name]
        if holders:
            best = min(holders, key=load)
            spread = active.get(best.name, 0) - active.get(least.name, 0)
            if spread <= self.max_spread:
                return Pick(best.name, f"backend {best.name!r} holds its stable prefix ({key})")
            return Pick(
                least.name,
                f"least loaded {least.name!r}: the prefix holder {best.name!r} has {spread} "
                "more active sessions",
            )
        return Pick(
            least.name,
            f"least loaded backend {least.name!r} ({least.inflight} in flight, "
            f"{active.get(least.name, 0)} active sessions)",
        )
