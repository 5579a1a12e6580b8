"""The memory arbiter: pure decisions about which models may be loaded.

Nothing here touches a process or a clock: the pool passes in what is loaded
(footprint, priority, in-flight requests, last use), the budget and the time,
and gets back decisions, each with its reason and the numbers behind it.

Rules:
- a load is admitted only when the budget (VRAM per GPU, host RAM minus a floor)
  proves the new model fits next to what stays loaded;
- otherwise idle models of lower or equal priority are unloaded first, lowest
  priority, then least recently used first; a model with requests in flight is
  never unloaded; if no such set makes room the load is refused;
- idle models are unloaded after their TTL (-1: never);
- under `critical` pressure idle non-primary models are unloaded;
- preloading happens only under `nominal` pressure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from core.models.profiles import MIB, Footprint


@dataclass(frozen=True)
class Budget:
    """What all loaded models may use together, in bytes (floors already taken off)."""

    vram: tuple[int, ...]  # per GPU index
    ram: int

    def as_dict(self) -> dict[str, object]:
        """The budget in MiB, as decisions report it."""
        return {"vram_mib": [_mib(b) for b in self.vram], "ram_mib": _mib(self.ram)}


@dataclass(frozen=True)
class Loaded:
    """A loaded (or loading) model as the arbiter sees it."""

    name: str
    priority: int
    footprint: Footprint
    inflight: int
    last_used: float  # monotonic seconds
    primary: bool = False
    ttl_s: int = -1


@dataclass(frozen=True)
class Decision:
    """One arbiter decision: action ('admit' | 'refuse' | 'unload' | 'keep'), why, numbers."""

    action: str
    model: str
    reason: str
    numbers: dict[str, object] = field(default_factory=dict)
    evict: tuple[str, ...] = ()


def _mib(b: int) -> float:
    return round(b / MIB, 1)


def _use(models: Sequence[Loaded], n_gpu: int) -> tuple[list[int], int]:
    vram = [0] * n_gpu
    ram = 0
    for m in models:
        for i, b in enumerate(m.footprint.vram):
            if i < n_gpu:
                vram[i] += b
            else:  # a GPU the budget does not know: count it against host RAM
                ram += b
        ram += m.footprint.ram
    return vram, ram


def _fits(
    need: Footprint, others: Sequence[Loaded], budget: Budget
) -> tuple[bool, dict[str, object]]:
    vram, ram = _use([*others, Loaded("", 0, need, 0, 0.0)], len(budget.vram))
    over_gpu = [i for i, b in enumerate(vram) if b > budget.vram[i]]
    numbers: dict[str, object] = {
        "need": need.as_dict(),
        "would_use": {"vram_mib": [_mib(b) for b in vram], "ram_mib": _mib(ram)},
        "budget": budget.as_dict(),
    }
    return not over_gpu and ram <= budget.ram, numbers


def admit(
    name: str,
    need: Footprint,
    priority: int,
    loaded: Sequence[Loaded],
    budget: Budget,
) -> Decision:
    """May `name` load? 'admit' (with the models to unload first, in order) or 'refuse'."""
    others = [m for m in loaded if m.name != name]
    ok, numbers = _fits(need, others, budget)
    if ok:
        return Decision("admit", name, "fits in the budget next to what is loaded", numbers)
    candidates = sorted(
        (m for m in others if m.inflight == 0 and m.priority <= priority),
        key=lambda m: (m.priority, m.last_used),
    )
    evict: list[str] = []
    for m in candidates:
        evict.append(m.name)
        others = [o for o in others if o.name != m.name]
        ok, numbers = _fits(need, others, budget)
        if ok:
            numbers["unload"] = [
                {"model": e.name, "priority": e.priority, "idle_since": e.last_used}
                for e in candidates
                if e.name in evict
            ]
            return Decision(
                "admit",
                name,
                f"fits after unloading {', '.join(evict)} (idle, priority ≤ {priority}, "
                "coldest first)",
                numbers,
                tuple(evict),
            )
    busy = [m.name for m in loaded if m.name != name and m.inflight > 0]
    higher = [m.name for m in loaded if m.name != name and m.priority > priority]
    why = "does not fit in the budget"
    if busy:
        why += f"; in use: {', '.join(busy)}"
    if higher:
        why += f"; higher priority: {', '.join(higher)}"
    numbers["blocked_by"] = {"in_use": busy, "higher_priority": higher}
    return Decision("refuse", name, why, numbers)


def idle_unloads(loaded: Sequence[Loaded], now: float) -> list[Decision]:
    """Models idle for longer than their TTL (never one with requests in flight)."""
    out = []
    for m in loaded:
        idle = now - m.last_used
        if m.ttl_s >= 0 and m.inflight == 0 and idle >= m.ttl_s:
            out.append(
                Decision(
                    "unload",
                    m.name,
                    f"idle for {idle:.0f} s ≥ its TTL of {m.ttl_s} s",
                    {
                        "idle_s": round(idle, 1),
                        "ttl_s": m.ttl_s,
                        "footprint": m.footprint.as_dict(),
                    },
                )
            )
    return out


def pressure_unloads(loaded: Sequence[Loaded], level: str, now: float) -> list[Decision]:
    """Under `critical` pressure: every idle non-primary model, lowest priority first."""
    if level != "critical":
        return []
    idle = sorted(
        (m for m in loaded if not m.primary and m.inflight == 0),
        key=lambda m: (m.priority, m.last_used),
    )
    return [
        Decision(
            "unload",
            m.name,
            "memory pressure is critical: unloading idle non-primary models",
            {
                "level": level,
                "priority": m.priority,
                "idle_s": round(now - m.last_used, 1),
                "footprint": m.footprint.as_dict(),
            },
        )
        for m in idle
    ]


def may_preload(level: str) -> Decision:
    ok = level == "nominal"
    return Decision(
        "admit" if ok else "refuse",
        "",
        "pressure is nominal" if ok else f"no preloading under {level} pressure",
        {"level": level},
    )
