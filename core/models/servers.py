"""One registry of the llama-servers requests go to, and the proxy's one admission.

An entry (`Server`) is one llama-server: its supervisor (None for a remote backend,
or a pooled model not loaded yet), the one HTTP session to it (`Upstream`), its cache
policy (its own cache manager, or the engine's for the primary), what it serves (the
model profile, the backend name) and its numbers (in flight, calls, tokens).

Single-model mode is a set of one: the primary, started on demand when a request finds
it stopped (``server.start_on_request``). The model pool (`core.models.pool`) adds an
entry per ``[[models]]`` profile and loads it through the arbiter; the backends
(`core.models.backends`) add one per ``[[backends]]`` table, for the primary model.
Each says how its entries are brought up for a request (`BringUp`); `ServerSet.route`
is the same for all of them: find the entry the router's `Decision` names, bring it
up, count the request in flight, hand back its upstream and cache policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from core.cache.deps import EngineParts, deps_from
from core.config import ServerSettings
from core.errors import WarmslotError
from core.events import Event, Notice, RequestCompleted
from core.models import profiles
from core.models.profiles import Footprint
from core.proxy.types import Route
from core.routing.router import Decision
from core.server.supervisor import Resolved, ServerState, Supervisor
from core.server.upstream import Upstream
from core.status.server import ServerRow

if TYPE_CHECKING:
    from core.cache.manager import CacheManager
    from core.proxy.types import CachePolicy

__all__ = ["PRIMARY", "BringUp", "Server", "ServerHost", "ServerSet", "server_lines"]

log = logging.getLogger("warmslot.servers")
PRIMARY = "main"  # the primary server's name as a backend (and without [[models]])
_SERVED_MAX = 20_000  # (session, kind) pairs remembered for the accounting


class ServerHost(EngineParts, Protocol):
    """What the server set uses of the engine (`core.engine.Core`): its parts, the
    primary's server and cache policy, and how a server's binary and model are found."""

    @property
    def supervisor(self) -> Supervisor | None: ...
    @property
    def policy(self) -> CachePolicy | None: ...
    @property
    def stopping(self) -> bool: ...
    async def resolve_for(self, s: ServerSettings) -> Resolved: ...


@dataclass(eq=False)
class Server:
    """One llama-server of the set, and its numbers."""

    name: str  # its key in the set
    upstream: Upstream  # the one HTTP session to it
    server: Supervisor | None = None  # None: remote, or a pooled model not made yet
    policy: CachePolicy | None = None  # its cache manager (None: remote, or cache off)
    model: str = ""  # the model profile it serves ("" without [[models]])
    backend: str = ""  # its name as a backend of the primary model ("" when not one)
    primary: bool = False
    what: str = "llama-server"  # what a 503 calls it
    bring_up: BringUp | None = None  # None: started on demand (`ServerSet.start_on_demand`)
    url: str = ""  # a remote backend's
    remote_ok: bool = False
    remote_problem: str = "not checked yet"
    inflight: int = 0
    side_inflight: int = 0
    last_used: float = 0.0
    calls: dict[str, int] = field(default_factory=lambda: {"agent": 0, "aux": 0})
    moved_in: int = 0  # sessions that moved here from a backend that was not ready
    prompt_tokens: int = 0  # of the requests it completed
    cached_tokens: int = 0
    errors: int = 0
    # The model pool's: what it takes in memory, its loads and unloads, its last decision.
    footprint: Footprint | None = None
    loads: int = 0
    unloads: int = 0
    last_decision: str = ""

    @property
    def manager(self) -> CacheManager | None:
        """Its cache manager, when its policy is one."""
        from core.cache.manager import CacheManager

        return self.policy if isinstance(self.policy, CacheManager) else None

    @manager.setter
    def manager(self, value: CacheManager | None) -> None:
        self.policy = value

    @property
    def loaded(self) -> bool:
        """Its server runs or is starting."""
        s = self.server
        return s is not None and s.state in (ServerState.READY, ServerState.STARTING)

    @property
    def ready(self) -> bool:
        if self.server is None:
            return bool(self.url) and self.remote_ok
        return self.server.state is ServerState.READY

    @property
    def state(self) -> str:
        """Its state in words, with why when it is not ready."""
        s = self.server
        if s is None:
            if not self.url:
                return "unloaded"
            return "ready" if self.remote_ok else f"unreachable ({self.remote_problem})"
        return s.state.value + (f" — {s.state_reason}" if s.state_reason else "")


# How an entry is brought up for a request: None when it may take it, else the error.
BringUp = Callable[[Server, Decision], Awaitable[Route | None]]


class ServerSet:
    """Every llama-server by name; `route` is the proxy's admission (`core.proxy.types.Admit`)."""

    def __init__(self, host: ServerHost, *, state_words: Callable[[], str] | None = None) -> None:
        self.host = host
        # The primary's state for a 503 (the engine adds a build under way, a failure's
        # hint); other entries say their own.
        self._state_words = state_words
        self.entries: dict[str, Server] = {}
        self._by_backend: dict[str, Server] = {}
        self._served: dict[tuple[str, str], str] = {}  # (session, kind) → entry name
        self._demand: dict[str, asyncio.Future[None]] = {}  # starts for a request
        upstream = host.upstream
        assert upstream is not None, "the engine makes the primary's upstream first"
        models = host.settings.models
        name = profiles.primary(host.settings).name if models else PRIMARY
        self.primary = self.add(
            Server(
                name,
                upstream,
                server=host.supervisor,
                policy=host.policy,
                model=name if models else "",
                primary=True,
                last_used=host.clock.monotonic(),
            )
        )
        host.subscribe(self._on_completed, (RequestCompleted,))

    # ------------------------------------------------------------ making entries
    def add(self, e: Server) -> Server:
        """Register `e` under its name (and its backend name)."""
        assert e.name not in self.entries, f"two servers named {e.name!r}"
        self.entries[e.name] = e
        if e.backend:
            self._by_backend[e.backend] = e
        return e

    def as_backend(self, e: Server, backend: str) -> None:
        """Make `e` (already registered) the backend named `backend`."""
        e.backend = backend
        self._by_backend[backend] = e

    def launched(self, name: str, *, model: str = "", backend: str = "", what: str = "") -> Server:
        """A new entry for a llama-server launched here; its supervisor is set by the
        caller (now, or when it is first needed). Its upstream follows the supervisor."""

        def server() -> Supervisor | None:
            return e.server

        def base_url() -> str | None:
            s = server()
            return s.base_url if s is not None else None

        upstream = Upstream(
            base_url,
            name=backend or model or name,
            api_key=lambda: s.api_key if (s := server()) is not None else None,
            quarantine=lambda: s.quarantine if (s := server()) is not None else None,
            served=lambda: s.model_name if (s := server()) is not None else "",
        )
        e = Server(
            name,
            upstream,
            model=model,
            backend=backend,
            what=what or name,
            last_used=self.host.clock.monotonic(),
        )
        return self.add(e)

    def remote(self, name: str, url: str, api_key: str, *, backend: str) -> Server:
        """A new entry for a server elsewhere (a remote Warmslot by URL); its health is
        its owner's to check (`Server.remote_ok`)."""
        url = url.rstrip("/")

        def base_url() -> str | None:
            return url if e.remote_ok else None

        upstream = Upstream(base_url, name=backend, api_key=lambda: api_key or None)
        what = f"backend {backend!r}"
        e = Server(name, upstream, model=self.primary.model, backend=backend, what=what, url=url)
        return self.add(e)

    def supervisor(
        self, label: str, settings: Callable[[], ServerSettings], log_name: str
    ) -> Supervisor:
        """A supervisor for a llama-server launched with `settings` (called at each
        launch), its output in ``llama-server.<log_name>.log``; `label` names it in events."""
        host = self.host

        async def resolve() -> Resolved:
            return await host.resolve_for(settings())

        return Supervisor(
            paths=host.paths,
            settings=settings,
            resolve=resolve,
            emit=host.emit,
            name=label,
            log_path=host.paths.log_dir / f"llama-server.{_safe(log_name)}.log",
        )

    def give_manager(self, e: Server, model: str) -> None:
        """Give `e` a cache manager of its own for its server (none when cache
        management is off for the whole core); `model` names it in events and the index."""
        from core.cache.manager import CacheManager

        if e.server is None or not isinstance(self.host.policy, CacheManager):
            return
        e.policy = CacheManager(deps_from(self.host, e.server, model=model, upstream=e.upstream))

    # ------------------------------------------------------------ admission
    def find(self, d: Decision) -> Server:
        """The entry the router's decision names: its backend, else its model, else the
        primary."""
        if d.backend and d.backend in self._by_backend:
            return self._by_backend[d.backend]
        return self.entries.get(d.model, self.primary) if d.model else self.primary

    async def route(self, d: Decision) -> Route:
        """Admit a request: bring its server up (start it on demand, load it through
        the pool, wait for a starting backend), count it in flight, and return its
        upstream and cache policy, or the error the client gets instead."""
        e = self.find(d)
        t0 = time.perf_counter()
        waited = e.upstream.base_url is None
        bring_up = e.bring_up or self.start_on_demand
        refused = await bring_up(e, d)
        if refused is not None:
            return refused
        if e.upstream.base_url is None:
            state = self._state_words() if e.primary and self._state_words else e.state
            return Route(
                status=503,
                error=f"Warmslot: {e.what} is not ready (state: {state}); retry shortly",
                retry_after=2,
            )
        side = d.side
        kind = "aux" if side else "agent"
        e.inflight += 1
        e.side_inflight += side
        e.calls[kind] += 1
        e.last_used = self.host.clock.monotonic()
        if d.session:
            if len(self._served) > _SERVED_MAX:
                self._served.clear()  # bounded; only the accounting forgets
            self._served[(d.session, kind)] = e.name

        def release() -> None:
            e.inflight = max(0, e.inflight - 1)
            e.side_inflight = max(0, e.side_inflight - side)
            e.last_used = self.host.clock.monotonic()

        load_ms = (time.perf_counter() - t0) * 1000 if waited else None
        return Route(
            model=e.model, upstream=e.upstream, policy=e.policy, release=release, load_ms=load_ms
        )

    async def start_on_demand(self, e: Server, _d: Decision) -> Route | None:
        """Wait for `e`'s llama-server on behalf of a request that came while it was not
        ready: start it if it is stopped (``server.start_on_request``), then wait until
        it is ready, failed, or ``server.start_timeout_s`` passed. Concurrent requests
        wait for the same start; a failed server is not started again here (the 503
        says why)."""
        sup, host = e.server, self.host
        # Not while stopping: a request under way then gets its 503 rather than a
        # llama-server that would be stopped again at once.
        if e.upstream.base_url is not None or sup is None or host.stopping:
            return None
        s = host.settings.server
        if not s.start_on_request:
            return None
        if sup.state is ServerState.STOPPED and e.name not in self._demand:
            host.emit(Notice(level="info", text=f"{e.what} is starting for a request"))
            self._demand[e.name] = asyncio.ensure_future(self._start_demanded(e.name, sup))
        demand = self._demand.get(e.name)
        if sup.state is not ServerState.STARTING and demand is None:
            return None
        ready = asyncio.ensure_future(sup.wait_ready(s.start_timeout_s))
        waits: set[asyncio.Future[Any]] = {ready}
        if demand is not None:  # ends early when the start fails
            waits.add(asyncio.shield(demand))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        return None

    async def _start_demanded(self, name: str, sup: Supervisor) -> None:
        try:
            await sup.start("request")
        except WarmslotError as e:
            self.host.emit(Notice(level="error", text=str(e), hint=e.hint))
        finally:
            self._demand.pop(name, None)

    def _on_completed(self, event: Event) -> None:
        """Count a completed request's tokens and errors where it was served."""
        if not isinstance(event, RequestCompleted) or not event.session:
            return
        e = self.entries.get(self._served.get((event.session, event.kind), ""))
        if e is None:
            return
        if event.status >= 500:
            e.errors += 1
        if event.prompt_n is not None and event.cache_n is not None:
            e.prompt_tokens += event.prompt_n + event.cache_n
            e.cached_tokens += event.cache_n

    # ------------------------------------------------------------ status
    def row(self, e: Server, name: str) -> ServerRow:
        """`e`'s row in the status, under `name` (what its list calls it); the pool and
        the backends add their own keys to it."""
        s = e.server
        if s is not None:
            state, reason = s.state.value, s.state_reason
        elif e.url:
            state, reason = ("ready", "") if e.remote_ok else ("unreachable", e.remote_problem)
        else:
            state, reason = "unloaded", ""
        return {
            "name": name,
            "model": e.model,
            "backend": e.backend,
            "primary": e.primary,
            "where": e.url or "launched here",
            "ready": e.ready,
            "state": state,
            "reason": reason,
            "port": s.port if s is not None and e.loaded else None,
            "pid": s.pid if s is not None else None,
            "inflight": e.inflight,
            "idle_s": round(self.host.clock.monotonic() - e.last_used, 1),
            "calls": dict(e.calls),
            "errors": e.errors,
            "prompt_tokens": e.prompt_tokens,
            "cached_tokens": e.cached_tokens,
            "hit_ratio": e.cached_tokens / e.prompt_tokens if e.prompt_tokens else None,
        }

    # ------------------------------------------------------------ the set
    def managers(self) -> list[CacheManager]:
        """The cache manager of every entry that has one, the primary's first."""
        return [m for e in self.entries.values() if (m := e.manager) is not None]

    def supervisors(self) -> list[Supervisor]:
        """Every supervisor made so far, the primary's first."""
        return [e.server for e in self.entries.values() if e.server is not None]

    def pids(self) -> list[int]:
        """Every running llama-server's pid."""
        return [pid for s in self.supervisors() if (pid := s.pid) is not None]

    async def close(self) -> None:
        """Stop every entry but the primary (the engine stops the primary): its cache
        saves what it must, then its server stops and its HTTP session closes."""
        self.cancel_starts()
        for e in self.entries.values():
            if e.primary:
                continue
            if e.manager is not None:
                with contextlib.suppress(Exception):
                    await e.manager.close()
            if e.server is not None:
                await e.server.close()
            await e.upstream.close()

    def cancel_starts(self) -> None:
        """Cancel the starts requests asked for (at shutdown, before anything else)."""
        for task in list(self._demand.values()):
            task.cancel()


def server_lines(heading: str, rows: Sequence[ServerRow]) -> list[str]:
    """The servers in `warmslot status` and the tray's Server tab: `heading`, then a line
    each — ready, or its state and why; the backends' sessions, the models' loads."""
    lines = [heading]
    for r in rows:
        hit = "—" if r["hit_ratio"] is None else f"{r['hit_ratio'] * 100:.1f} %"
        calls = r["calls"]
        state = "ready" if r["ready"] else " — ".join(filter(None, (r["state"], r["reason"])))
        sessions = f"  {r['active_sessions']} sessions" if "active_sessions" in r else ""
        loads = f"  {r['loads']} loads, {r['unloads']} unloads" if "loads" in r else ""
        lines.append(
            f"  {r['name']:<10} {state[:60]:<6} {r['where'][:40]:<14}"
            f" {r['inflight']} in flight{sessions}"
            f"  {calls.get('agent', 0)} agent + {calls.get('aux', 0)} side req  hit {hit}"
            + (f"  {r['moved_in']} moved in" if r.get("moved_in") else "")
            + loads
        )
    return lines


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
