"""When agents outnumber agent slots: a warning from the sessions and the slot map.

Agent sessions on fewer agent slots take turns: each turn's conversation is saved from
the slot it leaves and restored when its session returns (where that pays), which costs
more than a slot of its own (docs/cache.md#crowding). `warmslot status` and
the dashboard's Sessions tab say so.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.status import CacheStatus, SessionRow

ACTIVE_S = 600  # an agent session counts as active when it sent a request this recently


def agent_slots(cache: CacheStatus | None) -> int | None:
    """How many slots serve agents (all but the side-call slot); None when unknown."""
    if not cache or not cache["slots"]:
        return None
    return len(cache["slots"]) - (1 if cache["aux_slot"] is not None else 0)


def crowding(sessions: Sequence[SessionRow], cache: CacheStatus | None, now: float) -> str:
    """A warning when more agent sessions were active lately than there are agent slots
    ("" otherwise). `sessions` are telemetry's `sessions` rows, `cache` the cache status
    (None without one)."""
    slots = agent_slots(cache)
    active = [
        r
        for r in sessions
        if r["session"] and "agent" in (r["kinds"] or "") and now - r["last_seen"] < ACTIVE_S
    ]
    if slots is None or len(active) <= slots:
        return ""
    return (
        f"{len(active)} agent sessions were active in the last {ACTIVE_S // 60} minutes but "
        f"llama-server has {slots} agent slot{'s' if slots != 1 else ''}: they take turns, "
        "and each turn's conversation is saved and restored (or re-read where restoring does "
        "not pay). More slots keep each in its own: server.slots = 0 lets the fit plan "
        "choose as many as memory allows (`warmslot fit`)."
    )
