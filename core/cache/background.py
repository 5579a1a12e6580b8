"""Background work: the engine's cache sweeps for every model, user commands, status.

`Background` registers four sweeps on the engine's one `Sweeps` scheduler. Each
runs over the cache managers of every model the engine has (the primary's, and
each pooled model's once it was first loaded; a model whose server is not
running skips its turn), and the pressure monitor is one for the machine:

========== ======================================= ==================
sweep      what                                    interval
========== ======================================= ==================
pressure   sample memory, set the pressure level   pressure.sample_interval_s (5 s)
sessions   release sessions idle past their TTL    60 s
keepalive  keep slots' prefixes warm               cache.keepalive_interval_s (240 s, ≥ 30)
retention  disk retention: TTLs, keep-N, byte cap  cache.retention_interval_s (300 s, ≥ 60)
========== ======================================= ==================

Saved states of every model share one index and one slot directory root, so
the disk retention runs once per interval over all of them, protecting what
any model holds or recently used. A model whose sweep fails does not stop the
others' (the run records the failure).

The user commands `pin`, `evict` and `rewarm` (wrapped by `CacheManager` and
the Core) each record a `CacheEvent`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from core import fmt
from core.cache.retention import human_age
from core.cache.store import StateRecord, safe_name
from core.config import Settings
from core.errors import CacheError
from core.events import CacheEvent, CacheEventKind
from core.machine.pressure import PressureMonitor
from core.machine.sweeps import Outcome, Sweeps
from core.status import CacheStatus, EvictResult, PinResult, RewarmResult, SavedRow, SlotRow

if TYPE_CHECKING:
    from core.cache import prefix as pfx
    from core.cache.idle import IdleRelease
    from core.cache.keepalive import KeepAlive
    from core.cache.retention import Retention
    from core.cache.state import CacheState


class Managed(Protocol):
    """A model's cache manager as the sweeps see it: its name, keep-alive, retention and
    idle-session release."""

    @property
    def model(self) -> str: ...  # the model profile's name; "" for the primary server
    @property
    def keepalive(self) -> KeepAlive: ...
    @property
    def retention(self) -> Retention: ...
    @property
    def idle_release(self) -> IdleRelease: ...


__all__ = [
    "Background",
    "evict",
    "expiry_text",
    "format_background",
    "pin",
    "rewarm",
]

log = logging.getLogger("warmslot.cache")

SESSIONS_INTERVAL_S = 60.0
KEEPALIVE_MIN_S = 30.0
RETENTION_MIN_S = 60.0


class SweepFailed(Exception):
    """One or more models' part of a sweep raised (the others' parts still ran)."""


class Background:
    """The cache sweeps of every model, and the machine's pressure, on one scheduler.

    `managers` lists the cache managers of the models the engine has, the
    primary's first; it is read at every run, so a model the pool loads later
    joins at the next interval.
    """

    def __init__(
        self,
        sweeps: Sweeps,
        pressure: PressureMonitor,
        settings: Callable[[], Settings],
        managers: Callable[[], Sequence[Managed]],
    ) -> None:
        self.sweeps = sweeps
        self.pressure = pressure
        self._settings = settings
        self._managers = managers

    def register(self) -> None:
        """Add the four sweeps to the scheduler (once)."""
        if "pressure" in self.sweeps.sweeps:
            return
        settings = self._settings
        self.sweeps.add(
            "pressure",
            self.pressure.sample,
            lambda: settings().pressure.sample_interval_s,
            minimum=1.0,
            first_delay=0.0,
        )
        self.sweeps.add("sessions", self.release_idle, lambda: SESSIONS_INTERVAL_S, minimum=30.0)
        self.sweeps.add(
            "keepalive",
            self.keepalive,
            lambda: settings().cache.keepalive_interval_s,
            minimum=KEEPALIVE_MIN_S,
        )
        self.sweeps.add(
            "retention",
            self.retention,
            lambda: settings().cache.retention_interval_s,
            minimum=RETENTION_MIN_S,
        )

    async def release_idle(self) -> Outcome:
        """Every model's idle-session release."""
        return await _each(self._managers(), lambda m: m.idle_release.sweep())

    async def keepalive(self) -> Outcome:
        """Every model's keep-alive."""
        return await _each(self._managers(), lambda m: m.keepalive.sweep())

    async def retention(self) -> Outcome:
        """The disk retention, once over every model's saved states."""
        managers = list(self._managers())
        if not managers:
            return Outcome()
        return await managers[0].retention.sweep_disk(peers=managers[1:])


def model_label(mgr: Managed) -> str:
    """How a model is named in sweep details: its profile name, or "primary"."""
    return mgr.model or "primary"


async def _each(
    managers: Sequence[Managed], part: Callable[[Managed], Awaitable[Outcome]]
) -> Outcome:
    """Run one sweep's part for each model; the details say what each did."""
    actions = 0
    details: dict[str, object] = {}
    errors: list[str] = []
    for mgr in managers:
        label = model_label(mgr)
        try:
            out = await part(mgr)
        except Exception as e:  # one model's failure must not skip the others
            log.exception("the %s part of a sweep failed", label)
            errors.append(f"{label}: {type(e).__name__}: {e}")
            continue
        actions += out.actions
        details[label] = out.details
    if errors:
        raise SweepFailed("; ".join(errors))
    return Outcome(actions, {"models": details})


# ---------------------------------------------------------------------------- commands
def _emit(state: CacheState, kind: CacheEventKind, reason: str, **kw: Any) -> None:
    details = kw.pop("details", {})
    state.publish(
        CacheEvent(kind=kind, reason=reason, details=details, ts=state.clock.time(), **kw)
    )


def _record(state: CacheState, filename: str) -> StateRecord:
    if not safe_name(filename):
        raise CacheError(f"refusing {filename!r}: not the name of a state Warmslot saved")
    rec = state.store.get(filename)
    if rec is None:
        raise CacheError(f"no saved state named {filename}")
    return rec


async def pin(state: CacheState, filename: str, pinned: bool) -> PinResult:
    """Pin (never expires, never swept, kept warm) or unpin a saved state."""
    rec = _record(state, filename)
    state.store.set_pinned(filename, pinned)
    _emit(
        state,
        CacheEventKind.PINNED if pinned else CacheEventKind.UNPINNED,
        "pinned by the user: never expires, never swept, kept warm by keep-alive"
        if pinned
        else f"unpinned by the user: expires after its {rec.ttl_class} TTL again",
        fingerprint=rec.fingerprint[:16],
        tokens=rec.n_tokens,
        bytes=rec.bytes,
        details={"file": filename},
    )
    return {"file": filename, "fingerprint": rec.fingerprint[:16], "pinned": pinned}


async def evict(state: CacheState, filename: str) -> EvictResult:
    """Delete a saved state (file and index row) now."""
    rec = _record(state, filename)
    try:
        freed = state.store.delete(rec)
    except OSError as e:
        raise CacheError(f"cannot delete {filename}: {e}") from e
    _emit(
        state,
        CacheEventKind.EVICTED,
        "deleted by the user",
        fingerprint=rec.fingerprint[:16],
        tokens=rec.n_tokens,
        bytes=freed,
        details={
            "file": filename,
            "identity": rec.identity,
            "rule": "user",
            "age_s": round(state.clock.time() - rec.last_used, 1),
            "ttl_class": rec.ttl_class,
            "pinned": rec.pinned,
        },
    )
    return {"file": filename, "bytes": freed}


def _find_prefix(state: CacheState, fingerprint: str) -> pfx.PrefixInfo:
    fp = fingerprint.strip().lower()
    if len(fp) < 8:
        raise CacheError("give at least 8 characters of the fingerprint")
    matches = [i for k, i in state.by_fp.items() if k.startswith(fp)]
    if not matches:
        raise CacheError(f"no known prefix with fingerprint {fingerprint}")
    if len(matches) > 1:
        raise CacheError(f"fingerprint {fingerprint} is ambiguous: give more characters")
    return matches[0]


async def rewarm(state: CacheState, keepalive: KeepAlive, fingerprint: str) -> RewarmResult:
    """Bring a prefix into its slot now: re-warm it there, or restore it into a free slot."""
    if state.client is None or state.identity is None:
        raise CacheError("llama-server is not ready")
    info = _find_prefix(state, fingerprint)
    aux = state.slots.aux_slot
    holding = [s.id for s in state.slots.slots if s.prefix_fp == info.fingerprint]
    holding.sort(key=lambda i: i == aux)  # a primary slot first
    ka = keepalive
    reason = "re-warm requested by the user"
    if holding:
        slot = holding[0]
        t = await ka.rewarm_in(info, slot, reason=reason, kind=CacheEventKind.REWARM)
        if t is None:
            raise CacheError(f"slot {slot} is busy or the server refused the re-warm")
        return {
            "fingerprint": info.fingerprint[:16],
            "slot": slot,
            "restored": False,
            "cache_n": t.cache_n,
            "prompt_n": t.prompt_n,
        }
    free = ka.free_slot()
    if free is None:
        raise CacheError("no free slot: every slot holds a session or is busy")
    ok = await ka.restore_or_rewarm(info, free, reason=reason, kind=CacheEventKind.REWARM)
    if not ok:
        raise CacheError(f"could not re-warm the prefix into slot {free}")
    return {"fingerprint": info.fingerprint[:16], "slot": free, "restored": True}


# ---------------------------------------------------------------------------- status
def format_background(st: CacheStatus) -> str:
    """Lines for `warmslot status`: pressure, what is paused, each sweep's last run."""
    p = st["pressure"]
    lines = []
    ram = p["ram_available_pct"]
    lines.append(
        f"  pressure: {p['level']}"
        + (f" ({'; '.join(p['causes'])})" if p["causes"] else "")
        + (f"; RAM {ram:.1f} % available" if ram is not None else "")
    )
    lines.extend(f"    {text}" for text in st["paused"])
    disk = st.get("disk")
    if disk:
        unknown = disk["unknown_files_left_alone"]
        lines.append(
            f"  disk: {fmt.size(disk['used_bytes'])} of {fmt.size(disk['cap_bytes'])} cap "
            f"({disk['cap_source']})"
            + (f"; {unknown} files Warmslot did not write left alone" if unknown else "")
        )
    for s in st["sweeps"]:
        running, nxt_s = s["running_for_s"], s["next_in_s"]
        if running is not None:
            state = f"running for {human_age(running)}"
        elif s["last_start"] is None:
            state = "not run yet"
        else:
            took = (s["last_duration_s"] or 0.0) * 1000
            state = f"last run {s['last_actions']} actions in {took:.0f} ms"
            if s["last_error"]:
                state += f", FAILED: {s['last_error']}"
        nxt = "" if nxt_s is None else f", next in {human_age(nxt_s)}"
        lines.append(
            f"  sweep {s['name']} every {human_age(s['interval_s'])}: {state}{nxt}"
            + (f" ({s['failures']} failures)" if s["failures"] else "")
        )
    return "\n".join(lines)


def expiry_text(entry: SlotRow | SavedRow) -> str:
    """ ", long TTL, expires in 42 min" for a slot or saved entry that has the keys."""
    if "expires_in_s" not in entry:
        return ""
    exp = entry["expires_in_s"]
    cls = f", {entry['ttl_class']} TTL" if "idle_s" in entry else ""
    if exp is None:
        return f"{cls}, never expires"
    if exp <= 0:
        return f"{cls}, expired {human_age(-exp)} ago"
    return f"{cls}, expires in {human_age(exp)}"
