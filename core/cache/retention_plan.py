"""What the disk retention sweep deletes, decided from the index alone (pure: no I/O
but a file-size callback), so every rule can be tested on plain records.

The rules, in order (core.cache.retention applies the plan and records each eviction):

1. ``missing``: a row whose file is gone; ``corrupt``: a file whose size no longer
   matches its row (unless pinned);
2. protected: pinned files, files of prefixes a slot holds now, the ``keep_recent`` most
   recently used files of each running server;
3. ``per_session``: a session keeps at most ``cache.conversations_per_session`` saved
   conversation states (the newest); pinned ones are kept and do not count;
4. ``expired``: unused longer than its TTL class (unless protected);
5. ``cap``: while the total is above the byte cap, the oldest unprotected go, other
   server identities' first. With states of two or more users (API keys per user,
   docs/security.md#serving-a-team) each user's fair share is the cap ÷ those users, and
   after other identities' states only a user above their share loses states (their
   oldest first, until they are back at it): one user's saves never evict the states of
   a user within their share. With one user, or none, that is plain oldest first.

A state counts with its record beside it. At a save (`room`: the bytes about to be
written, core.cache.retention.Retention.make_room) the total must leave room for them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from core.cache.store import StateRecord

__all__ = ["MIB", "Eviction", "Plan", "human_age", "plan_disk_sweep"]

MIB = 1 << 20
CONVERSATION = "conversation"  # `StateRecord.kind` of a conversation state


def human_age(seconds: float) -> str:
    s = abs(seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


@dataclass(frozen=True)
class Eviction:
    """One file (or index row) the sweep deletes, and why."""

    rec: StateRecord
    rule: str  # missing | corrupt | per_session | expired | cap
    reason: str
    age_s: float


@dataclass
class Plan:
    evictions: list[Eviction] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # filename → why it is protected
    total_before: int = 0
    total_after: int = 0
    cap_bytes: int = 0


def plan_disk_sweep(
    records: list[StateRecord],
    *,
    now: float,
    ttl: Callable[[str], float],
    keep_recent: int,
    cap_bytes: int,
    current_identities: Collection[str],
    in_use: set[str],
    file_size: Callable[[StateRecord], int | None],
    per_session: int = 0,
    record_size: Callable[[StateRecord], int] = lambda _: 0,
    room: int = 0,
) -> Plan:
    """Decide what the retention sweep deletes (pure: no I/O but `file_size`).

    `current_identities` are the slot directories of the servers Warmslot runs (one
    per model; empty: none known yet, nothing counts as foreign); each keeps its
    `keep_recent` most recently used files. `in_use` holds fingerprints a slot holds
    (or that are being saved) right now; `file_size` returns a record's file size,
    or None when the file is gone. `per_session` (> 0) is how many saved conversation
    states each session keeps, the newest; pinned states are kept beyond it.
    `record_size` gives the bytes of a state's record beside its file (counted with it);
    `room` is what a save is about to add: the cap rule leaves room for it.
    """
    plan = Plan(cap_bytes=cap_bytes)
    alive: list[tuple[StateRecord, int]] = []
    for rec in records:
        age = now - rec.last_used
        size = file_size(rec)
        if size is None:
            plan.evictions.append(
                Eviction(rec, "missing", "the file is gone; dropping its index row", age)
            )
            continue
        footprint = size + record_size(rec)
        plan.total_before += footprint
        if size != rec.bytes and not rec.pinned:
            plan.evictions.append(
                Eviction(
                    rec,
                    "corrupt",
                    f"the file is {size} bytes but {rec.bytes} were written: truncated or replaced",
                    age,
                )
            )
            continue
        alive.append((rec, footprint))

    def foreign(rec: StateRecord) -> bool:
        return bool(current_identities) and rec.identity not in current_identities

    ours = sorted((r for r, _ in alive if not foreign(r)), key=lambda r: -r.last_used)
    recent: set[str] = set()
    for identity in {r.identity for r in ours}:
        mine = [r.filename for r in ours if r.identity == identity]
        recent.update(mine[: max(0, keep_recent)])
    protected: dict[str, str] = {}
    for rec, _ in alive:
        if rec.pinned:
            protected[rec.filename] = "pinned"
        elif rec.fingerprint in in_use:
            protected[rec.filename] = "current (held by a slot)"
        elif rec.filename in recent:
            protected[rec.filename] = f"one of the {keep_recent} most recently used"
    plan.kept = protected

    over = _over_per_session([r for r, _ in alive], per_session)
    gone = {r.filename for r in over}
    for rec in over:
        plan.evictions.append(
            Eviction(
                rec,
                "per_session",
                f"more than {per_session} saved conversation states of session "
                f"{rec.session[:24]}; newest kept",
                now - rec.last_used,
            )
        )
    remaining: list[tuple[StateRecord, int]] = []
    for rec, size in alive:
        if rec.filename in gone:
            continue
        age = now - rec.last_used
        horizon = ttl(rec.ttl_class)
        if rec.filename not in protected and age > horizon:
            other = " (another server identity: no longer used)" if foreign(rec) else ""
            plan.evictions.append(
                Eviction(
                    rec,
                    "expired",
                    f"unused for {human_age(age)} > {rec.ttl_class} TTL "
                    f"{human_age(horizon)}{other}",
                    age,
                )
            )
        else:
            remaining.append((rec, size))

    total = sum(size for _, size in remaining)
    target = cap_bytes - room
    saving = f" + {room / MIB:.1f} MiB being saved" if room else ""
    if total > target:
        candidates = sorted(
            ((r, s) for r, s in remaining if r.filename not in protected),
            key=lambda rs: (not foreign(rs[0]), rs[0].last_used),
        )
        # Each user's disk use (this server identity's states, protected ones included).
        used: dict[str, int] = {}
        for r, size in remaining:
            if not foreign(r):
                used[r.owner] = used.get(r.owner, 0) + size
        share = cap_bytes / len(used) if len(used) >= 2 else None
        for rec, size in candidates:
            if total <= target:
                break
            why = "oldest first"
            if foreign(rec):
                why += " (another server identity)"
            elif share is not None:
                if used[rec.owner] <= share:
                    continue  # within its user's fair share: others' saves cannot evict it
                why = (
                    f"user {rec.owner or '(no key)'!r} uses {used[rec.owner] / MIB:.1f} MiB "
                    f"> fair share {share / MIB:.1f} MiB (cap ÷ {len(used)} users); "
                    "their oldest first"
                )
                used[rec.owner] -= size
            plan.evictions.append(
                Eviction(
                    rec,
                    "cap",
                    f"saved states use {total / MIB:.1f} MiB{saving} > cap "
                    f"{cap_bytes / MIB:.1f} MiB; {why}",
                    now - rec.last_used,
                )
            )
            total -= size
    plan.total_after = total
    return plan


def _over_per_session(records: list[StateRecord], keep: int) -> list[StateRecord]:
    """Conversation states beyond the newest `keep` of their session (pinned excluded)."""
    if keep <= 0:
        return []
    by_session: dict[tuple[str, str], list[StateRecord]] = {}
    for rec in records:
        if rec.kind == CONVERSATION and rec.session and not rec.pinned:
            by_session.setdefault((rec.identity, rec.session), []).append(rec)
    over: list[StateRecord] = []
    for recs in by_session.values():
        recs.sort(key=lambda r: (r.created, r.last_used), reverse=True)
        over.extend(recs[keep:])
    return over
