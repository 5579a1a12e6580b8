"""Events: frozen dataclasses the core publishes to subscribers.

Subscribers (the CLI, the tray's bridge, tests) register with
`Core.subscribe` (an `EventBus`). Callbacks run on the core thread and must return
quickly; the GUI's bridge re-emits them as queued Qt signals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

log = logging.getLogger("warmslot.core")


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class Event:
    """Base of every event; `ts` is wall-clock seconds."""

    ts: float = field(default_factory=_now, kw_only=True)


@dataclass(frozen=True)
class ServerStateChanged(Event):
    """The supervisor moved between stopped/starting/ready/stopping/failed."""

    state: str
    previous: str
    reason: str = ""
    pid: int | None = None
    port: int | None = None
    model: str = ""  # the model profile's name; "" for the primary server


@dataclass(frozen=True)
class ServerLaunched(Event):
    """A llama-server process was started with exactly this argv."""

    run_id: str
    pid: int
    port: int
    argv: tuple[str, ...]
    binary: str
    binary_version: str
    model: str
    attempt: str = "start"  # start | restart | no-repack-retry


@dataclass(frozen=True)
class ServerExited(Event):
    """llama-server exited; `outcome` is 'requested', 'crashed' or 'start_failed'."""

    run_id: str
    pid: int
    returncode: int | None
    signal: int | None
    outcome: str
    requested_by: str
    last_lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class LogLine(Event):
    """One line of llama-server's output, parsed (see `core.server.logparse`)."""

    level: str
    area: str
    text: str
    raw: str


@dataclass(frozen=True)
class RequestCompleted(Event):
    """A proxied request finished (successfully or not)."""

    request_id: str
    client: str
    session: str
    endpoint: str
    stream: bool
    has_tools: bool
    status: int
    slot: int | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    ttfb_ms: float | None = None
    total_ms: float | None = None
    kind: str = "agent"
    error: str = ""
    user: str = ""  # the name of the caller's API key ("" when none is configured)
    model: str = ""  # the model that served it, by file name (`Upstream.served_model`)


@dataclass(frozen=True)
class RequestExplained(Event):
    """Why a request reused what it did (core.cache.explain): its prompt's sections and the
    first token where it left its slot's previous prompt (`div_token`, None when none)."""

    request_id: str
    client: str
    session: str
    slot: int | None
    n_tokens: int
    cache_n: int
    prompt_n: int
    previous_tokens: int | None = None
    div_token: int | None = None
    div_section: str = ""
    lost_tokens: int = 0
    cost_s: float | None = None
    summary: str = ""
    sections: str = "[]"  # JSON: [{"name", "start", "n_tokens"}, …]
    divergence: str = "null"  # JSON: {"token", "section", "offset", "before", "old", "new"}
    compute_ms: float = 0.0


class CacheEventKind(StrEnum):
    """What a `CacheEvent` says happened. A `StrEnum`: each member equals its string, so
    telemetry rows, JSON and the kinds read back from the database stay plain strings."""

    # The server's identity and what Warmslot knows about it
    SERVER_IDENTITY = "server_identity"  # the server is ready and its identity was read
    IDENTITY_FAILED = "identity_failed"  # the identity could not be read: cache paused
    DEFINITIONS_IGNORED = "definitions_ignored"  # damaged stored prefix definitions deleted
    INVALIDATED = "invalidated"  # a saved state of another server identity was deleted
    # Learning prefixes from requests
    PREFIX_LEARNED = "prefix_learned"  # a new stable prefix was found for a client
    NO_BOUNDARY = "no_boundary"  # no stable prefix found for this client (yet)
    TEMPLATE_DROPS_TOOLS = "template_drops_tools"  # the chat template drops tools/system text
    # Slots and requests
    AUX_ISOLATED = "aux_isolated"  # a side call was sent to the auxiliary slot
    DISPLACED = "displaced"  # a side call ran in the only primary slot, displacing its prefix
    DIVERGENCE = "divergence"  # a request reused less of its slot than its prefix promised
    BYPASS = "bypass"  # the cache manager failed; the request was forwarded untouched
    # Prewarming a prefix into a slot
    PREWARM_HIT = "prewarm_hit"  # a prewarm found the prefix already in the slot
    PREWARM_COLD = "prewarm_cold"  # a prewarm had to compute the prefix
    PREWARM_SKIPPED = "prewarm_skipped"  # a prewarm or restore was skipped under pressure
    # Saving prefix states to disk and restoring them
    SAVE = "save"  # a prefix state was saved to disk with its probe answer
    SAVE_FAILED = "save_failed"  # saving a prefix state failed
    PERSIST_SKIPPED = "persist_skipped"  # a save was not attempted (pressure, no scratch slot)
    REFERENCE = "reference"  # a saved state's known-answer reference was taken after its save
    RESTORE_OK = "restore_ok"  # a saved state was restored and verified
    RESTORE_REJECTED = "restore_rejected"  # a restored state failed checks and was deleted
    RESTORE_UNPAID = "restore_unpaid"  # the request after a restore reused less than it held
    CONTEXT_LIMIT = "context_limit"  # a request hit its slot's context (refused or cut short)
    SLOT_STALLED = "slot_stalled"  # a request's slot made no progress: cancelled, slot freed
    EVICTED = "evicted"  # a saved state was deleted (retention rule, disk cap or the user)
    UNDELETABLE = "undeletable"  # a file that had to go could not be deleted: quarantined
    PINNED = "pinned"  # the user pinned a saved state
    UNPINNED = "unpinned"  # the user unpinned a saved state
    # Keeping prefixes warm
    KEEPALIVE = "keepalive"  # keep-alive re-warmed (or restored) a prefix in its slot
    KEEPALIVE_FAILED = "keepalive_failed"  # a keep-alive re-warm failed
    REWARM = "rewarm"  # a re-warm the user asked for
    REWARM_FAILED = "rewarm_failed"  # a re-warm the user asked for failed
    BOOT_REWARM_STARTED = "boot_rewarm_started"  # re-warming recent prefixes after a start
    BOOT_REWARM_SKIPPED = "boot_rewarm_skipped"  # one boot re-warm step skipped or stopped
    BOOT_REWARM_FAILED = "boot_rewarm_failed"  # one boot re-warm step failed
    BOOT_REWARM_DONE = "boot_rewarm_done"  # the boot re-warm finished (counts in details)


@dataclass(frozen=True)
class CacheEvent(Event):
    """Something happened to a cached prefix/state: kind + reason + numbers."""

    kind: CacheEventKind
    reason: str = ""
    fingerprint: str = ""
    slot: int | None = None
    tokens: int | None = None
    bytes: int | None = None
    details: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A plain string (a test, a row read back) becomes its member; an unknown one raises.
        object.__setattr__(self, "kind", CacheEventKind(self.kind))


@dataclass(frozen=True)
class PressureSample(Event):
    """One memory-pressure sample and the level it implies."""

    level: str
    ram_available_pct: float
    swap_used_pct: float
    server_rss_bytes: int | None
    disk_free_pct: float
    gpus: tuple[tuple[int, int, int], ...] = ()  # (index, total bytes, free bytes)


@dataclass(frozen=True)
class PressureChanged(Event):
    """The memory-pressure level changed (nominal / low / critical), and why."""

    level: str
    previous: str
    reasons: tuple[str, ...] = ()
    paused: tuple[str, ...] = ()  # behaviours now paused or limited, in words


@dataclass(frozen=True)
class SweepRun(Event):
    """One run of a background sweep (retention, keep-alive, pressure …)."""

    name: str
    started: float
    duration_s: float
    actions: int = 0
    error: str = ""
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildProgress(Event):
    """Progress of a llama-server build: 0..100 and the current step."""

    build_id: str
    percent: float
    step: str
    done: bool = False
    ok: bool | None = None
    steps_done: int = 0  # compile steps finished / in all (0 when the build tool says not)
    steps_total: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None  # from the last build's time, then this one's pace
    purpose: str = ""  # why it runs, in words ("no llama-server works on this CPU" …)
    background: bool = False  # serving goes on meanwhile (the patched build for the disk tier)

    def describe(self) -> str:
        """One line for status and the tray: "building …: 45 % (94/208), 4 min so far,
        about 5 min left"."""
        steps = f" ({self.steps_done}/{self.steps_total})" if self.steps_total else ""
        left = ""
        if self.eta_s is not None:
            left = f", about {max(1, round(self.eta_s / 60))} min left"
        what = self.purpose or "building llama-server"
        return f"{what}: {self.percent:.0f} %{steps}, {self.elapsed_s / 60:.0f} min so far{left}"


@dataclass(frozen=True)
class Notice(Event):
    """A message meant for the user (warnings, errors with hints)."""

    level: str
    text: str
    hint: str = ""


@dataclass(frozen=True)
class SettingsChanged(Event):
    """Settings were changed through the core (the tray's dialog, the API): what changed,
    as ``(name, old, new)`` with secrets masked — the visible cause of what follows (a
    pressure level after a threshold change, a proxy on a new port)."""

    changes: tuple[tuple[str, Any, Any], ...]

    def text(self) -> str:
        return "; ".join(f"{n}: {old!r} → {new!r}" for n, old, new in self.changes)


@dataclass(frozen=True)
class ModelEvent(Event):
    """A decision or step of the model pool (core.models): load, unload, refusal, route.

    `kind`: load_requested · admit · refuse · loaded · load_failed · unload · unloaded ·
    saved_before_unload. `numbers` holds the footprint, the budget and what would be used.
    """

    kind: str
    model: str
    reason: str = ""
    numbers: dict[str, object] = field(default_factory=dict)


Subscriber = Callable[[Event], None]


class EventBus:
    """The subscribers and their event types. Subscribing is thread-safe; `publish`
    runs every matching callback in turn, and one that raises is logged, never a
    reason the others miss the event."""

    def __init__(self) -> None:
        self._subscribers: list[tuple[Subscriber, tuple[type[Event], ...] | None]] = []
        self._lock = threading.Lock()

    def subscribe(
        self, callback: Subscriber, types: tuple[type[Event], ...] | None = None
    ) -> Callable[[], None]:
        """Call `callback(event)` for every event (or only those of `types`); returns
        the function that unsubscribes it."""
        entry = (callback, types)
        with self._lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._lock:
                if entry in self._subscribers:
                    self._subscribers.remove(entry)

        return unsubscribe

    def publish(self, event: Event) -> None:
        with self._lock:
            subs = list(self._subscribers)
        for callback, types in subs:
            if types is None or isinstance(event, types):
                try:
                    callback(event)
                except Exception:
                    log.exception("event subscriber %r failed", callback)
