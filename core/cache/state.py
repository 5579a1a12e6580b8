"""What one llama-server's prefix cache knows now: `CacheState`.

The slot map, the known prefixes by fingerprint, the running server's identity and
disk tier, the known-answer probe's tokens — and the way to the things the cache works
on (settings, the server and its client, the cache index, events, the clock), read
from `CacheDeps` on every use. The cache manager (`core.cache.manager`), its slot
operations (`core.cache.slot_ops`) and the modules that serve it (warm-up, keep-alive,
retention, conversations, prefix saves, the commands) all read and change one
`CacheState`, handed to them explicitly, never the manager.

A (re)started server's facts come in one step (`server_ready`), and go in one
(`server_gone`), so nothing outside assigns them piecemeal.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.cache import prefix as pfx
from core.cache.definitions import DefinitionStore, PrefixDefinition
from core.cache.deps import CacheDeps, DiskTier, ServerHandle
from core.cache.fingerprint import ServerIdentity
from core.cache.slots import SlotMap
from core.cache.store import StateStore
from core.clock import Clock
from core.config import Settings
from core.events import CacheEvent, CacheEventKind, Event
from core.machine.pressure import PressureMonitor
from core.machine.sweeps import Sweeps
from core.server.client import LlamaClient
from core.server.upstream import Upstream

log = logging.getLogger("warmslot.cache")


@dataclass(frozen=True)
class ServerFacts:
    """What the cache learns of a server that became ready (`core.cache.warmup.read_server`)."""

    identity: ServerIdentity
    n_slots: int  # as the server reports them (GET /props total_slots)
    disk: DiskTier  # whether its slot files can be valid
    probe_suffix: list[int]  # the known-answer probe's tokens, tokenized by it
    n_ctx: int | None  # tokens one slot holds (None when the server does not say)


class CacheState:
    """The prefix cache of one llama-server, as it is now (see the module docstring)."""

    def __init__(self, deps: CacheDeps) -> None:
        self.deps = deps
        # The llama-server this cache works on (the primary's, or a pooled model's) and
        # the HTTP session to it, which its maker (the engine or the pool) closes.
        self.upstream: Upstream | None = deps.upstream
        self.model = deps.model  # the model profile's name; "" for the primary server
        self.clock: Clock = deps.clock
        # The machine's one pressure monitor (the engine's): it gates background work.
        self.pressure: PressureMonitor = deps.pressure
        self.sweeps: Sweeps | None = deps.sweeps  # the engine's scheduler (for status)
        self.slots = SlotMap(
            self.settings.server.launch_slots,
            reserve_aux=self._aux_slot,
            clock=self.clock.monotonic,
        )
        self.by_fp: dict[str, pfx.PrefixInfo] = {}
        # fingerprint → the user whose request first used the prefix (with API keys per
        # user): the owner its saved state is accounted to (core.cache.retention_plan).
        self.prefix_owners: dict[str, str] = {}
        self.identity: ServerIdentity | None = None
        self.disk = DiskTier(False, "server not started yet")
        self.probe_suffix: list[int] | None = None  # the known-answer probe's tokens
        self._store: StateStore | None = None
        self._definitions: DefinitionStore | None = None
        # Definitions of prefixes learned, not written yet (`remember`, `write_definitions`).
        self._unwritten: dict[str, pfx.PrefixInfo] = {}

    # ------------------------------------------------------------ the server's facts
    def server_ready(self, facts: ServerFacts) -> None:
        """Take the facts of a server that became ready (a new slot map when its slot
        count differs from the one the cache assumed)."""
        self.identity = facts.identity
        if facts.n_slots != self.slots.n_slots:
            self.slots = SlotMap(
                facts.n_slots, reserve_aux=self.slots.reserve_aux, clock=self.clock.monotonic
            )
        self.disk = facts.disk
        self.probe_suffix = facts.probe_suffix

    def server_gone(self) -> None:
        """The server stopped (or restarts): its slots hold nothing, its identity is void."""
        self.slots.reset()
        self.identity = None

    # ------------------------------------------------------------ what the cache works on
    @property
    def settings(self) -> Settings:
        """The settings as they are now (they can change while running)."""
        return self.deps.settings()

    def _aux_slot(self) -> bool:
        """cache.aux_slot as it is now (the slot map asks per request)."""
        return self.settings.cache.aux_slot

    @property
    def server(self) -> ServerHandle | None:
        """The llama-server this cache works on."""
        return self.deps.server()

    @property
    def client(self) -> LlamaClient | None:
        """The client of this cache's llama-server; None while it is not running."""
        return self.upstream.client() if self.upstream is not None else None

    @property
    def has_db(self) -> bool:
        """Whether the engine's cache index is open (the states and definitions live there)."""
        return self.deps.db() is not None

    @property
    def store(self) -> StateStore:
        """The index of saved states (the cache index must be open)."""
        if self._store is None:
            db = self.deps.db()
            assert db is not None
            self._store = StateStore(db, self.deps.slot_dir, clock=self.clock.time)
        return self._store

    @property
    def definitions(self) -> DefinitionStore | None:
        """The learned prefix definitions (None while the core has no database)."""
        db = self.deps.db()
        if self._definitions is None and db is not None:
            self._definitions = DefinitionStore(db, monotonic=self.clock.monotonic)
        return self._definitions

    @property
    def launch_id(self) -> str:
        """The server's slot directory name: one per binary, model and KV-relevant flags."""
        return self.slot_dir().name

    def slot_dir(self) -> Path:
        """The running server's slot-file directory (the default one before it runs)."""
        sup = self.server
        if sup is not None and sup.resolved is not None and sup.resolved.slot_dir is not None:
            return sup.resolved.slot_dir
        return self.deps.slot_dir

    # ------------------------------------------------------------ events
    def emit(
        self,
        kind: CacheEventKind,
        reason: str = "",
        *,
        fp: str = "",
        slot: int | None = None,
        tokens: int | None = None,
        nbytes: int | None = None,
        **details: Any,
    ) -> None:
        """Emit a cache event (the fingerprint shortened); the signature is `boot.Emit`'s."""
        self.publish(
            CacheEvent(
                kind=kind,
                reason=reason,
                fingerprint=fp[:16],
                slot=slot,
                tokens=tokens,
                bytes=nbytes,
                details=details,
            )
        )

    def publish(self, event: Event) -> None:
        """Emit any event as it is."""
        self.deps.emit(event)

    def prefill_rate(self) -> float | None:
        """This model's measured cold prefill rate (ms per token); None until measured."""
        return self.deps.prefill_rate()

    # ------------------------------------------------------------ learned definitions
    def remember(self, info: pfx.PrefixInfo) -> None:
        """Keep a newly known prefix's definition across restarts (never fails a request).
        Written after the request that taught it has its response, or at shutdown
        (`write_definitions`): never a synchronous write on a request's path."""
        self._unwritten[info.fingerprint] = info

    def write_definitions(self) -> None:
        """Write the definitions `remember` noted."""
        book, ident = self.definitions, self.identity
        todo, self._unwritten = self._unwritten, {}
        if book is None or ident is None:
            return
        for info in todo.values():
            try:
                d = definition_of(info, ident)
                book.save(d, info.fingerprint)
            except (ValueError, sqlite3.Error):
                log.exception("could not store the definition of prefix %s", info.fingerprint[:16])
                continue
            info.meta["definition"] = d.id

    def touch(self, info: pfx.PrefixInfo) -> None:
        """Note a use of a prefix (written in batches, see core.cache.definitions)."""
        def_id = info.meta.get("definition")
        book = self.definitions
        if def_id and book is not None:
            try:
                book.touch(str(def_id), info.last_used)
            except sqlite3.Error:
                log.exception("could not note the use of prefix %s", info.fingerprint[:16])

    def flush_definitions(self) -> None:
        """At shutdown: write what `remember` noted and the uses noted since the last write."""
        self.write_definitions()
        if self._definitions is not None and self.has_db:
            with contextlib.suppress(sqlite3.Error):
                self._definitions.flush()


def definition_of(info: pfx.PrefixInfo, ident: ServerIdentity) -> PrefixDefinition:
    """The definition to store for a prefix learned on a server of identity `ident`."""
    meta = info.meta
    return PrefixDefinition(
        model=ident.model,
        template=ident.chat_template,
        tokens=tuple(int(t) for t in info.tokens),
        client=info.client[:256],
        source=info.source[:256],
        shape_key=info.key,
        first_seen=info.first_seen,
        last_used=max(info.last_used, info.first_seen),
        rendered_tokens=int(meta.get("rendered_tokens") or 0),
        head_n=int(meta.get("head_n") or 0),
    )
