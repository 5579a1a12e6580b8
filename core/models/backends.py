"""Several backends for the primary model behind one proxy (``[[backends]]``).

The primary server (``server.*``, the engine's supervisor and cache manager) is the
first backend, named 'main'. Each ``[[backends]]`` table adds one: a llama-server
launched here with the same settings (its own supervisor and cache manager, over the
same slot folder and database, so the disk tier is shared), or a remote Warmslot by
URL (checked every `HEALTH_S` seconds; it manages its own cache).

Each backend is an entry of the server set (`core.models.servers`). The router
(`core.routing.router`) asks `BackendSet.choose` for each request's backend
(`core.routing.choice` is the rule); the set's `route` admits the request there and
counts it. With ``[[models]]`` the backends serve the primary profile's model.
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

import aiohttp

from core.config import BackendSettings, ServerSettings
from core.errors import WarmslotError
from core.events import Event, Notice, ServerStateChanged
from core.models.servers import PRIMARY, Server, ServerSet, server_lines
from core.proxy.types import Route
from core.routing.choice import Affinity, BackendView, Pick
from core.routing.router import Decision, Router, Target
from core.server.supervisor import ServerState
from core.server.upstream import Upstream
from core.status import BackendsStatus
from core.status.server import ServerRow

__all__ = [
    "PRIMARY",
    "BackendSet",
    "backend_lines",
    "server_settings",
]

log = logging.getLogger("warmslot.backends")
HEALTH_S = 2.0  # seconds between checks of a remote backend
HEALTH_TIMEOUT_S = 2.0


def server_settings(primary: ServerSettings, b: BackendSettings) -> ServerSettings:
    """A launched backend's server settings: the primary's, on a free port, with its
    own threads and extra arguments."""
    return dataclasses.replace(
        primary,
        port=0,
        threads=b.threads or primary.threads,
        extra_args=[*primary.extra_args, *b.extra_args],
    )


def _view(b: Server) -> BackendView:
    return BackendView(b.backend, b.ready, b.inflight, b.side_inflight > 0)


class BackendSet:
    """The backends of the primary model, entries of the server set: the router's
    backend chooser, and each launched backend's start and remote one's health."""

    def __init__(self, servers: ServerSet, primary_settings: Callable[[], ServerSettings]) -> None:
        self.servers = servers
        self.core = core = servers.host
        self._primary_settings = primary_settings
        self.affinity = Affinity()
        servers.as_backend(servers.primary, PRIMARY)
        self.backends: dict[str, Server] = {PRIMARY: servers.primary}
        for b in core.settings.backends:
            self.backends[b.name] = self._make(b)
        self._task: asyncio.Task[None] | None = None
        self.router = Router(lambda: (Target("", None, primary=True),), backend=self.choose)
        core.subscribe(self._on_state, (ServerStateChanged,))

    def _make(self, b: BackendSettings) -> Server:
        name, what = f"backend {b.name}", f"backend {b.name!r}"
        if b.url:
            return self.servers.remote(name, b.url, b.api_key, backend=b.name)
        e = self.servers.launched(name, model=self.servers.primary.model, backend=b.name, what=what)

        def settings() -> ServerSettings:
            return server_settings(self._primary_settings(), b)

        e.server = self.servers.supervisor(name, settings, f"backend-{b.name}")
        self.servers.give_manager(e, name)
        e.bring_up = self._bring_up
        return e

    # ------------------------------------------------------------ choice
    def choose(self, session: str, side: bool, key: str) -> tuple[Pick, Upstream | None]:
        """The router's backend chooser (`core.routing.router.BackendChooser`)."""
        views = [_view(b) for b in self.backends.values()]
        try:
            pick = self.affinity.choose(
                views, session=session, side=side, key=key, now=time.monotonic()
            )
        except Exception as e:  # fail open: the request still goes to a backend
            log.exception("choosing a backend failed; the first ready one serves")
            self.core.emit(Notice(level="warning", text=f"choosing a backend failed: {e!r}"))
            first = next((b for b in self.backends.values() if b.ready), None)
            name = first.backend if first is not None else PRIMARY
            pick = Pick(name, f"backend choice failed ({e!r}): the first ready backend")
        if pick.moved_from:
            self.backends[pick.backend].moved_in += 1
            log.info("session %s moved: %s", session[:24], pick.why)
        return pick, self.backends[pick.backend].upstream

    async def _bring_up(self, b: Server, _d: Decision) -> Route | None:
        """The server set's admission for a launched backend: wait for one that is
        starting (up to ``server.start_timeout_s``); one that is not ready is refused."""
        if not b.ready and b.server is not None and b.server.state is ServerState.STARTING:
            await b.server.wait_ready(self.core.settings.server.start_timeout_s)
        if not b.ready:
            return Route(
                status=503,
                error=f"Warmslot: backend {b.backend!r} is not ready ({b.state}); "
                "no other backend is ready either",
                retry_after=5,
            )
        return None

    def _on_state(self, event: Event) -> None:
        """A launched backend that leaves `ready` (a crash, a stop) has failed: its
        sessions move at their next turn (`core.routing.choice`)."""
        if not isinstance(event, ServerStateChanged) or event.previous != "ready":
            return
        name = PRIMARY if not event.model else event.model.removeprefix("backend ")
        if name in self.backends and event.state != "ready":
            log.info("backend %s is %s: its sessions move", name, event.state)
            self.affinity.backend_down(name, time.monotonic())

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Launch every launched backend and watch the remote ones (in the background)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        launched = [b for b in self.backends.values() if b.server is not None and not b.primary]
        await asyncio.gather(*(self._launch(b) for b in launched))
        remote = [b for b in self.backends.values() if b.server is None]
        if not remote:
            return
        async with aiohttp.ClientSession() as http:
            while True:
                await asyncio.gather(*(self._check(http, b) for b in remote))
                await asyncio.sleep(HEALTH_S)

    async def _launch(self, b: Server) -> None:
        assert b.server is not None
        try:
            await b.server.start("backends")
        except WarmslotError as e:
            self.core.emit(Notice(level="error", text=f"backend {b.backend}: {e}", hint=e.hint))

    async def _check(self, http: aiohttp.ClientSession, b: Server) -> None:
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
            self.affinity.backend_down(b.backend, time.monotonic())
        if was != b.remote_ok:
            level = "info" if b.remote_ok else "warning"
            self.core.emit(Notice(level=level, text=f"backend {b.backend} ({b.url}): {b.state}"))

    async def close(self) -> None:
        """Stop watching the remote backends (the server set stops the servers)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # ------------------------------------------------------------ status
    def status(self) -> BackendsStatus:
        """Per-backend rows for `/warmslot/status` and `warmslot status`."""
        active = self.affinity.active(time.monotonic())
        rows: list[ServerRow] = []
        for b in self.backends.values():
            row = self.servers.row(b, b.backend)
            row["active_sessions"] = active.get(b.backend, 0)
            row["moved_in"] = b.moved_in
            rows.append(row)
        return {
            "backends": rows,
            "sessions": len(self.affinity.sessions),
            "moved": self.affinity.moved,
        }


def backend_lines(st: BackendsStatus) -> list[str]:
    """The backends' lines in `warmslot status` and the tray's Server tab."""
    return server_lines(
        f"backends ({st['sessions']} sessions, {st['moved']} moved):", st["backends"]
    )
