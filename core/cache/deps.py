"""What a cache manager is built from, and what the modules split out of it use.

`CacheDeps` is everything `core.cache.manager.CacheManager` needs from the rest of
Warmslot — settings, the llama-server it works on, the HTTP session to it, the
cache index's database (`core.cache.index`), an `emit` callable, the clock, paths,
the machine's pressure monitor and the scheduler — so the manager never holds the
engine (`core.engine.Core`).
`deps_from` builds it from anything shaped like the engine (`EngineParts`).

The modules split out of the manager work on its `CacheState` (core.cache.state)
and `SlotOps` (core.cache.slot_ops), handed to them explicitly, never on the
manager: no module imports the manager back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from core.cache.probe import LOGPROB_TOLERANCE
from core.clock import Clock
from core.config import Settings
from core.events import Event
from core.machine.pressure import PressureMonitor
from core.machine.sweeps import Sweeps
from core.server.upstream import Upstream
from core.telemetry.rates import PrefillRates

if TYPE_CHECKING:
    import sqlite_utils

    from core.cache.index import CacheIndex
    from core.paths import Paths
    from core.server.supervisor import Resolved

Subscriber = Callable[[Event], None]


class PeerRetention(Protocol):
    """What the shared disk sweep reads of another model's retention (core.cache.retention)."""

    def current_identity(self) -> str | None: ...
    def in_use(self) -> set[str]: ...


class HasRetention(Protocol):
    """Another model's cache manager, as the shared disk sweep sees it."""

    @property
    def retention(self) -> PeerRetention: ...


def _unmeasured() -> float | None:
    return None


def _alone() -> Sequence[HasRetention]:
    return ()


@dataclass
class DiskTier:
    usable: bool
    reason: str
    # How far a restored state's probe log-probs may move. Dense models and full SWA
    # state reproduce them exactly; a sliding-window ring buffer restored in another
    # cell order sums in another order (measured up to ~0.15, greedy tokens equal —
    # docs/llama-server-facts.md#swa-log-prob-noise), so only the tokens are held exact there.
    logprob_tolerance: float = LOGPROB_TOLERANCE
    # Sliding-window or recurrent layers: llama-server reaches a position through its
    # checkpoints, so a request that differs late may still go back further than that.
    rewinds: bool = False


class ServerHandle(Protocol):
    """What the cache reads of the llama-server it works on (a `Supervisor`)."""

    @property
    def run_id(self) -> str: ...
    @property
    def resolved(self) -> Resolved | None: ...
    @property
    def argv(self) -> list[str]: ...


@dataclass(frozen=True)
class CacheDeps:
    """Everything a cache manager uses from outside the cache package."""

    settings: Callable[[], Settings]  # read on every use: settings can change while running
    server: Callable[[], ServerHandle | None]  # the llama-server this manager works on
    upstream: Upstream | None  # the one HTTP session to it (its maker closes it)
    db: Callable[[], sqlite_utils.Database | None]  # the cache index's (None: none yet)
    emit: Callable[[Event], None]
    subscribe: Callable[[Subscriber, tuple[type[Event], ...]], object]
    clock: Clock
    slot_dir: Path  # the default slot-file directory (a server's own lies under it)
    pressure: PressureMonitor  # the machine's one pressure monitor
    sweeps: Sweeps | None = None  # the engine's scheduler (for status)
    model: str = ""  # the model profile's name; "" for the primary server
    # This model's measured cold prefill rate in ms per token (the proxy's
    # `PrefillRates`, the one estimator); None until measured.
    prefill_rate: Callable[[], float | None] = _unmeasured
    # Every model's cache manager (this one's among them): their saved states share the
    # index and the disk cap (core.cache.retention).
    peers: Callable[[], Sequence[HasRetention]] = _alone


class EngineParts(Protocol):
    """The parts of the engine (`core.engine.Core`) a cache manager's deps are made of."""

    @property
    def settings(self) -> Settings: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def paths(self) -> Paths: ...
    @property
    def supervisor(self) -> ServerHandle | None: ...
    @property
    def upstream(self) -> Upstream | None: ...
    @property
    def cache_index(self) -> CacheIndex | None: ...
    @property
    def pressure(self) -> PressureMonitor | None: ...
    @property
    def sweeps(self) -> Sweeps | None: ...
    @property
    def prefill_rates(self) -> PrefillRates: ...
    def emit(self, event: Event) -> None: ...
    def subscribe(
        self, callback: Subscriber, types: tuple[type[Event], ...] | None = None
    ) -> Callable[[], None]: ...
    def cache_managers(self) -> Sequence[HasRetention]: ...


def deps_from(
    core: EngineParts,
    server: ServerHandle | None = None,
    *,
    model: str = "",
    upstream: Upstream | None = None,
) -> CacheDeps:
    """The deps of a manager working on `server` (default: the engine's primary one,
    over the engine's upstream session)."""
    pressure = core.pressure
    assert pressure is not None, "the engine makes the pressure monitor before any manager"

    def settings() -> Settings:
        return core.settings

    def handle() -> ServerHandle | None:
        return server if server is not None else core.supervisor

    def db() -> sqlite_utils.Database | None:
        index = core.cache_index
        return index.db if index is not None else None

    up = upstream if upstream is not None else core.upstream

    def prefill_rate() -> float | None:  # keyed as the proxy keys it (`Proxy._served`)
        return core.prefill_rates.ms_per_token((up.served_model() if up else "") or model)

    return CacheDeps(
        settings=settings,
        server=handle,
        upstream=up,
        db=db,
        emit=core.emit,
        subscribe=core.subscribe,
        clock=core.clock,
        slot_dir=core.paths.slot_dir,
        pressure=pressure,
        sweeps=core.sweeps,
        peers=core.cache_managers,
        model=model,
        prefill_rate=prefill_rate,
    )
