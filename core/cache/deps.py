"""What a cache manager is built from, and what the modules split out of it use.

`CacheDeps` is everything `core.cache.manager.CacheManager` needs from the rest of
Warmslot — settings, the llama-server it works on, the HTTP session to it, the
cache index's database (`core.cache.index`), an `emit` callable, the clock, paths,
the machine's pressure monitor and the scheduler — so the manager never holds the
engine (`core.engine.Core`).
`deps_from` builds it from anything shaped like the engine (`EngineParts`).

`CacheHost` is the manager's public surface that warm-up, keep-alive, retention,
the background commands and the boot re-warm work through (slot locks, prewarm,
restore + verify, background saves, cache events): they type against it, never
against the manager, so no module imports the manager back and none reaches into
its private members.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from core.cache.boot import BootRewarm, Emit
from core.cache.definitions import DefinitionStore
from core.cache.fingerprint import ServerIdentity
from core.cache.learner import PrefixLearner
from core.cache.prefix import PrefixInfo
from core.cache.probe import LOGPROB_TOLERANCE, ProbeGate
from core.cache.slots import SlotMap
from core.cache.store import StateRecord, StateStore
from core.clock import Clock
from core.config import Settings
from core.events import Event
from core.machine.pressure import PressureMonitor
from core.machine.sweeps import Sweeps
from core.server.client import LlamaClient, Timings
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


class CacheHost(Protocol):
    """The cache manager as warm-up, keep-alive, retention and the commands use it."""

    model: str
    clock: Clock
    slots: SlotMap
    identity: ServerIdentity | None
    disk: DiskTier
    by_fp: dict[str, PrefixInfo]
    probe_suffix: list[int] | None  # the known-answer probe's tokens (learned at start)
    pressure: PressureMonitor
    boot: BootRewarm
    probe_gate: ProbeGate  # one known-answer probe at a time (docs/cache.md#verification)
    learner: PrefixLearner  # the known prefixes by request shape, and what they belong to

    @property
    def prefixes(self) -> dict[str, PrefixInfo]: ...  # shape key → prefix
    @property
    def settings(self) -> Settings: ...
    @property
    def client(self) -> LlamaClient | None: ...
    @property
    def server(self) -> ServerHandle | None: ...
    @property
    def store(self) -> StateStore: ...
    @property
    def definitions(self) -> DefinitionStore | None: ...
    @property
    def has_db(self) -> bool: ...
    @property
    def launch_id(self) -> str: ...
    @property
    def persisting(self) -> frozenset[str]: ...
    @property
    def sweeps(self) -> Sweeps | None: ...

    def lock(self, slot: int) -> asyncio.Lock:
        """Held while Warmslot itself uses `slot`; a request for it waits."""
        ...

    @property
    def emit(self) -> Emit:
        """Emit a cache event (fingerprint shortened); the signature is `boot.Emit`'s."""
        ...

    def publish(self, event: Event) -> None:
        """Emit any event as it is."""
        ...

    def prefill_rate(self) -> float | None:
        """This model's measured cold prefill rate (ms per token); None until measured."""
        ...

    def remember(self, info: PrefixInfo) -> None: ...

    async def prewarm(
        self, info: PrefixInfo, slot: int, *, reason: str, chunk: int = 0
    ) -> Timings | None: ...

    async def restore(self, rec: StateRecord, slot: int) -> None:
        """Restore `rec` into `slot` and verify it; raise VerificationFailed."""
        ...

    def persist_soon(self, info: PrefixInfo, slot: int | None = None) -> bool:
        """Save the prefix in the background unless a save of it is under way (from
        `slot`, which holds it, where that needs no prefill)."""
        ...

    async def save_conversation(self, slot: int, why: str) -> str:
        """Save the conversation `slot` holds beyond its stable prefix (core.cache.conversations);
        what happened, in words."""
        ...
