"""Several backends for the primary model behind one proxy (``[[backends]]``).

The primary server (``server.*``, the engine's supervisor and cache manager) is the
first backend, named 'main'. Each ``[[backends]]`` table adds one: a llama-server
launched here with the same settings (its own supervisor and cache manager, over the
same slot folder and database, so the disk tier is shared), or a remote Warmslot by
URL (checked every `HEALTH_S` seconds; it manages its own cache).

The router (`core.routing.router`) asks `BackendSet.choose` for each request's backend
(`core.routing.choice` is the rule); `route` admits the request there and counts it.
A backend that is not ready takes no new request: its sessions move at their next
turn, and the cache manager where they land restores their stable prefix from the
shared disk tier when the fingerprint matches (else the request rebuilds it).
docs/scale.md#several-backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from core.cache.deps import EngineParts, deps_from
from core.config import BackendSettings, ServerSettings
from core.errors import WarmslotError
from core.events import Event, Notice, RequestCompleted, ServerStateChanged
from core.proxy.types import Route
from core.routing.choice import Affinity, BackendView, Pick
from core.routing.router import Decision, Router, Target
from core.server.supervisor import Resolved, ServerState, Supervisor
from core.server.upstream import Upstream
from core.status import BackendRow, BackendsStatus

if TYPE_CHECKING:
    from core.cache.manager import CacheManager
    from core.proxy.types import CachePolicy

__all__ = [
    "PRIMARY",
    "Backend",
    "BackendHost",
    "BackendSet",
    "backend_lines",
    "server_settings",
]

log = logging.getLogger("warmslot.backends")
PRIMARY = "main"  # the primary server's name as a backend
HEALTH_S = 2.0  # seconds between checks of a remote backend
HEALTH_TIMEOUT_S = 2.0


class BackendHost(EngineParts, Protocol):
    """What the backend set uses of the engine (`core.engine.Core`)."""

    @property
    def supervisor(self) -> Supervisor | None: ...
    @property
    def policy(self) -> CachePolicy | None: ...
    async def resolve_for(self, s: ServerSettings) -> Resolved: ...


def server_settings(primary: ServerSettings, b: BackendSettings) -> ServerSettings:
    """A launched backend's server settings: the primary's, on a free port, with its
    own threads and extra arguments."""
    return dataclasses.replace(
        primary,
        port=0,
        threads=b.threads or primary.threads,
        extra_args=[*primary.extra_args, *b.extra_args],
    )


@dataclass
class Backend:
    """One backend: its server (launched) or URL (remote), and what it served."""

    name: str
    upstream: Upstream
    server: Supervisor | None = None  # None for a remote backend
    policy: CachePolicy | None = None  # its cache manager (None: remote, or cache off)
    url: str = ""
    remote_ok: bool = False
    remote_problem: str = "not checked yet"
    inflight: int = 0
    side_inflight: int = 0
    calls: dict[str, int] = field(default_factory=lambda: {"agent": 0, "aux": 0})
    moved_in: int = 0  # sessions that moved here from a backend that was not ready
    prompt_tokens: int = 0  # of the requests it completed
    cached_tokens: int = 0
    errors: int = 0

    @property
    def ready(self) -> bool:
        if self.server is None:
            return self.remote_ok
        return self.server.state is ServerState.READY

    @property
    def state(self) -> str:
        if self.server is None:
            return "ready" if self.remote_ok else f"unreachable ({self.remote_problem})"
        s = self.server
        return s.state.value + (f" — {s.state_reason}" if s.state_reason else "")

    def view(self) -> BackendView:
        return BackendView(self.name, self.ready, self.inflight, self.side_inflight > 0)


class BackendSet:
    """The backends of the primary model; the proxy's router and admission."""

    def __init__(self, core: BackendHost) -> None:
        self.core = core
        self.affinity = Affinity()
        sup, upstream = core.supervisor, core.upstream
        assert sup is not None and upstream is not None, "the engine makes them first"
        self.backends: dict[str, Backend] = {
            PRIMARY: Backend(PRIMARY, upstream, server=sup, policy=core.policy)
        }
        for b in core.settings.backends:
            self.backends[b.name] = self._make(b)
        # (session, kind) → the backend its latest request went to: completed requests
        # are counted there (the proxy's event names the session, not the backend).
        self._served: dict[tuple[str, str], str] = {}
        self._task: asyncio.Task[None] | None = None
        self.router = Router(lambda: (Target("", None, primary=True),), backend=self.choose)
        core.subscribe(self._on_completed, (RequestCompleted,))
        core.subscribe(self._on_state, (ServerStateChanged,))

    def _make(self, b: BackendSettings) -> Backend:
        if b.url:
            url = b.url.rstrip("/")
            made: list[Backend] = []  # the upstream reads its backend's health

            def base_url() -> str | None:
                return url if made and made[0].remote_ok else None

            upstream = Upstream(base_url, name=b.name, api_key=lambda: b.api_key or None)
            made.append(Backend(b.name, upstream, url=url))
            return made[0]
        core = self.core

        def settings() -> ServerSettings:
            return server_settings(core.settings.server, b)

        async def resolve() -> Resolved:
            return await core.resolve_for(settings())

        server = Supervisor(
            paths=core.paths,
            settings=settings,
            resolve=resolve,
            emit=core.emit,
            name=f"backend {b.name}",
            log_path=core.paths.log_dir / f"llama-server.backend-{b.name}.log",
        )
        upstream = Upstream(
            lambda: server.base_url,
            name=b.name,
            api_key=lambda: server.api_key,
            quarantine=lambda: server.quarantine,
            served=lambda: server.model_name,
        )
        return Backend(b.name, upstream, server=server, policy=self._manager(server, upstream))

    def _manager(self, server: Supervisor, upstream: Upstream) -> CacheManager | None:
        from core.cache.manager import CacheManager

        if not isinstance(self.core.policy, CacheManager):
            return None  # cache management is off for the whole core
        return CacheManager(deps_from(self.core, server, model=server.name, upstream=upstream))

    # ------------------------------------------------------------ choice
    def choose(self, session: str, side: bool, key: str) -> tuple[Pick, Upstream | None]:
        """The router's backend chooser (`core.routing.router.BackendChooser`)."""
        views = [b.view() for b in self.backends.values()]
        try:
            pick = self.affinity.choose(
                views, session=session, side=side, key=key, now=time.monotonic()
            )
        except Exception as e:  # fail open: the request still goes to a backend
            log.exception("choosing a backend failed; the first ready one serves")
            self.core.emit(Notice(level="warning", text=f"choosing a backend failed: {e!r}"))
            first = next((b for b in self.backends.values() if b.ready), None)
            name = first.name if first is not None else PRIMARY
            pick = Pick(name, f"backend choice failed ({e!r}): the first ready backend")
        if pick.moved_from:
            self.backends[pick.backend].moved_in += 1
            log.info("session %s moved: %s", session[:24], pick.why)
        return pick, self.backends[pick.backend].upstream

    async def route(self, decision: Decision) -> Route:
        """Admit a request the router sent to a backend: wait for a launched backend
        that is starting (up to ``server.start_timeout_s``), count it in flight."""
        b = self.backends[decision.backend]
        if not b.ready and b.server is not None and b.server.state is ServerState.STARTING:
            await b.server.wait_ready(self.core.settings.server.start_timeout_s)
        if not b.ready:
            return Route(
                status=503,
                error=f"Warmslot: backend {b.name!r} is not ready ({b.state}); "
                "no other backend is ready either",
                retry_after=5,
            )
        side = decision.side
        kind = "aux" if side else "agent"
        b.inflight += 1
        b.side_inflight += side
        b.calls[kind] += 1
        if decision.session:
            self._served[(decision.session, kind)] = b.name
            if len(self._served) > 4 * len(self.affinity.sessions) + 1000:
                self._served.clear()  # bounded; only the accounting forgets

        def release() -> None:
            b.inflight = max(0, b.inflight - 1)
            b.side_inflight = max(0, b.side_inflight - side)

        return Route(model="", upstream=b.upstream, policy=b.policy, release=release)

    def _on_state(self, event: Event) -> None:
        """A launched backend that leaves `ready` (a crash, a stop) has failed: its
        sessions move at their next turn (`core.routing.choice`)."""
        if not isinstance(event, ServerStateChanged) or event.previous != "ready":
            return
        name = PRIMARY if not event.model else event.model.removeprefix("backend ")
        if name in self.backends and event.state != "ready":
            log.info("backend %s is %s: its sessions move", name, event.state)
            self.affinity.backend_down(name, time.monotonic())

    def _on_completed(self, event: Event) -> None:
        if not isinstance(event, RequestCompleted) or not event.session:
            return
        name = self._served.get((event.session, event.kind))
        b = self.backends.get(name or "")
        if b is None:
            return
        if event.status >= 500:
            b.errors += 1
        if event.prompt_n is not None and event.cache_n is not None:
            b.prompt_tokens += event.prompt_n + event.cache_n
            b.cached_tokens += event.cache_n

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Launch every launched backend and watch the remote ones (in the background)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        launched = [b for b in self.backends.values() if b.server is not None and b.name != PRIMARY]
        await asyncio.gather(*(self._launch(b) for b in launched))
        remote = [b for b in self.backends.values() if b.server is None]
        if not remote:
            return
        async with aiohttp.ClientSession() as http:
            while True:
                await asyncio.gather(*(self._check(http, b) for b in remote))
                await asyncio.sleep(HEALTH_S)

    async def _launch(self, b: Backend) -> None:
        assert b.server is not None
        try:
            await b.server.start("backends")
        except WarmslotError as e:
            self.core.emit(Notice(level="error", text=f"backend {b.name}: {e}", hint=e.hint))

    async def _check(self, http: aiohttp.ClientSession, b: Backend) -> None:
        """One health check of a remote backend (GET /health, 200 within 2 s)."""
        was = b.remote_ok
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            async with http.get(f"{b.url}/health", timeout=timeout) as resp:
                b.remote_ok = resp.status == 200
                b.remote_problem = "" if b.remote_ok else f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            b.remote_ok = False
            b.remote_problem = str(e) or type(e).__name__
        if was and not b.remote_ok:
            self.affinity.backend_down(b.name, time.monotonic())
        if was != b.remote_ok:
            level = "info" if b.remote_ok else "warning"
            self.core.emit(Notice(level=level, text=f"backend {b.name} ({b.url}): {b.state}"))

    def managers(self) -> list[CacheManager]:
        """The cache managers of the launched backends other than the primary."""
        from core.cache.manager import CacheManager

        return [
            b.policy
            for b in self.backends.values()
            if b.name != PRIMARY and isinstance(b.policy, CacheManager)
        ]

    def pids(self) -> list[int]:
        """The pids of the launched backends other than the primary."""
        return [
            pid
            for b in self.backends.values()
            if b.name != PRIMARY and b.server is not None and (pid := b.server.pid) is not None
        ]

    async def close(self) -> None:
        """Stop the backends other than the primary (the engine stops the primary)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for b in self.backends.values():
            if b.name == PRIMARY:
                continue
            closer: Callable[[], Any] | None = getattr(b.policy, "close", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            if b.server is not None:
                await b.server.close()
            await b.upstream.close()

    # ------------------------------------------------------------ status
    def status(self) -> BackendsStatus:
        """Per-backend rows for `/warmslot/status` and `warmslot status`."""
        active = self.affinity.active(time.monotonic())
        rows: list[BackendRow] = []
        for b in self.backends.values():
            s = b.server
            rows.append(
                {
                    "name": b.name,
                    "where": b.url if s is None else "launched here",
                    "ready": b.ready,
                    "state": b.state,
                    "port": s.port if s is not None and b.ready else None,
                    "pid": s.pid if s is not None else None,
                    "inflight": b.inflight,
                    "active_sessions": active.get(b.name, 0),
                    "calls": dict(b.calls),
                    "moved_in": b.moved_in,
                    "errors": b.errors,
                    "prompt_tokens": b.prompt_tokens,
                    "cached_tokens": b.cached_tokens,
                    "hit_ratio": b.cached_tokens / b.prompt_tokens if b.prompt_tokens else None,
                }
            )
        return {
            "backends": rows,
            "sessions": len(self.affinity.sessions),
            "moved": self.affinity.moved,
        }


def backend_lines(st: BackendsStatus) -> list[str]:
    """The backends' rows in `warmslot status`."""
    lines = [f"backends ({st['sessions']} sessions, {st['moved']} moved):"]
    for r in st["backends"]:
        hit = "—" if r["hit_ratio"] is None else f"{r['hit_ratio'] * 100:.1f} %"
        calls = r["calls"]
        state = "ready" if r["ready"] else r["state"][:60]  # why, when it is not
        lines.append(
            f"  {r['name']:<10} {state:<6} {r['where'][:40]:<14}"
            f" {r['inflight']} in flight  {r['active_sessions']} sessions"
            f"  {calls.get('agent', 0)} agent + {calls.get('aux', 0)} side req  hit {hit}"
            + (f"  {r['moved_in']} moved in" if r["moved_in"] else "")
        )
    return lines
