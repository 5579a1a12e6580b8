"""The model pool: the ``[[models]]`` profiles, one entry of the server set each
(`core.models.servers`: a supervised llama-server and its cache manager).

The primary profile is the set's primary (the core's own supervisor and cache manager);
every other profile gets its own when it is first needed. Loads and unloads go through the
arbiter (core.models.arbiter) and are serialized; each decision is a `ModelEvent`
with its reason and numbers. Before a model is unloaded its cache manager saves
the prefixes its slots hold (when its disk tier is valid); after it loads again
the manager restores and verifies them before the first request is let through.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from core.config import ServerSettings
from core.errors import WarmslotError
from core.events import ModelEvent
from core.machine import devices
from core.models import arbiter, profiles
from core.models.profiles import MIB, Footprint, Profile
from core.models.servers import Server, ServerSet
from core.proxy.types import Route
from core.routing.router import BackendChooser, Decision, Router, Target
from core.server import model
from core.server.supervisor import Supervisor
from core.status import ModelList, PoolDecision
from core.status.server import ServerRow

log = logging.getLogger("warmslot.models")
VRAM_MARGIN = 1024 * MIB  # per GPU, like the fit planner's


class ModelUnavailable(WarmslotError):
    """A model could not be loaded (the arbiter refused it, or its server failed)."""


ServerFactory = Callable[[Profile], Supervisor]


class ModelPool:
    """The ``[[models]]`` profiles, one entry of the server set each; loads them when a
    request needs them, unloads them when idle or under pressure."""

    def __init__(
        self,
        servers: ServerSet,
        *,
        server_factory: ServerFactory | None = None,
        budget: arbiter.Budget | None = None,
        pressure_level: Callable[[], str] | None = None,
        backend: BackendChooser | None = None,
    ) -> None:
        self.servers = servers
        self.core = core = servers.host
        self.clock = core.clock
        self._server_factory = server_factory or self._make_server
        self._budget = budget
        self._pressure_level = pressure_level
        self._ops = asyncio.Lock()  # one load or unload at a time
        self._loading: dict[str, asyncio.Task[Server]] = {}
        self.profiles: dict[str, Profile] = {}
        self._profile_of: dict[str, Profile] = {}  # by entry name
        self.entries: dict[str, Server] = {}
        self.decisions: list[PoolDecision] = []
        self.routed_side = 0
        for prof in profiles.profiles(core.settings):
            if prof.primary:
                e = servers.primary
            else:  # the one HTTP session to the model's server, whenever it runs
                e = servers.launched(prof.name, model=prof.name, what=f"model {prof.name!r}")
            e.bring_up = self._bring_up
            self.profiles[prof.name] = prof
            self._profile_of[e.name] = prof
            self.entries[prof.name] = e
        # The proxy's router: by the `model` field, side calls to the side profile; the
        # primary's backend chosen by `backend` when there are several.
        self.router = Router(
            self.targets,
            strict=lambda: self.core.settings.pool.strict_models,
            side_calls=lambda: self.core.settings.pool.side_calls,
            backend=backend,
        )

    def targets(self) -> list[Target]:
        """Every configured model, as the router sees it."""
        return [
            Target(name, e.upstream, p.primary, p.role == "side")
            for (name, e), p in zip(self.entries.items(), self.profiles.values(), strict=True)
        ]

    # ------------------------------------------------------------ plumbing
    @property
    def primary(self) -> Server:
        return self.servers.primary

    def profile(self, e: Server) -> Profile:
        """The profile `e` serves."""
        return self._profile_of[e.name]

    def _emit(self, kind: str, name: str, reason: str, numbers: Mapping[str, object]) -> None:
        self.decisions.append(
            {"ts": self.clock.time(), "kind": kind, "model": name, "reason": reason}
        )
        del self.decisions[:-50]
        log.info("model %s: %s — %s", name, kind, reason)
        self.core.emit(ModelEvent(kind=kind, model=name, reason=reason, numbers=dict(numbers)))

    def _make_server(self, prof: Profile) -> Supervisor:
        core = self.core

        def settings() -> ServerSettings:
            return profiles.server_settings(core.settings, prof)

        return self.servers.supervisor(prof.name, settings, prof.name)

    async def budget(self) -> arbiter.Budget:
        """The budget: configured, else free VRAM per GPU and available RAM at first use."""
        if self._budget is None:
            s = self.core.settings.pool
            loop = asyncio.get_running_loop()
            gpus = await loop.run_in_executor(None, devices.read_gpus)
            host = await loop.run_in_executor(None, devices.read_host, self.core.paths.state_dir)
            used = await self._used_now()
            vram = tuple(
                s.vram_budget_mib * MIB
                if s.vram_budget_mib
                else max(0, g.free_bytes + used[0][i] - VRAM_MARGIN)
                for i, g in enumerate(gpus)
            )
            ram = s.ram_budget_mib * MIB if s.ram_budget_mib else host.ram_available + used[1]
            self._budget = arbiter.Budget(vram, max(0, ram - s.ram_floor_mib * MIB))
        return self._budget

    async def _used_now(self) -> tuple[list[int], int]:
        vram = [0] * 16
        ram = 0
        for e in self.entries.values():
            if e.loaded:
                fp = await self.footprint(e)
                for i, b in enumerate(fp.vram[:16]):
                    vram[i] += b
                ram += fp.ram
        return vram, ram

    async def footprint(self, e: Server) -> Footprint:
        prof = self.profile(e)
        mib = prof.source.footprint_mib
        if e.footprint is None and mib:
            e.footprint = Footprint((), mib * MIB, "configured (footprint_mib)")
        if e.footprint is None:
            settings = profiles.server_settings(self.core.settings, prof)
            paths = self.core.paths

            def compute() -> Footprint:
                path = model.resolve(paths, settings.model).path
                try:
                    return profiles.footprint(
                        prof,
                        settings,
                        path,
                        devices.read_gpus(),
                        devices.read_host(paths.state_dir),
                    )
                except Exception as exc:  # unreadable metadata: the file size is a floor
                    log.warning("fit planner failed for %s: %r", prof.name, exc)
                    return Footprint((), Path(path).stat().st_size, f"file size ({exc!r})")

            e.footprint = await asyncio.get_running_loop().run_in_executor(None, compute)
        return e.footprint

    def _view(self) -> list[arbiter.Loaded]:
        return [
            arbiter.Loaded(
                name=p.name,
                priority=p.priority,
                footprint=e.footprint or Footprint((), 0, "unknown"),
                inflight=e.inflight,
                last_used=e.last_used,
                primary=p.primary,
                ttl_s=p.ttl_s,
            )
            for p, e in self._pairs()
            if e.loaded
        ]

    # ------------------------------------------------------------ load / unload
    async def ensure(self, name: str) -> Server:
        """Make `name` loaded and warm (restored + verified); raise ModelUnavailable."""
        e = self.entries[name]
        if e.ready and name not in self._loading:
            return e
        task = self._loading.get(name)
        if task is None:
            task = asyncio.ensure_future(self._load(e))
            self._loading[name] = task
            task.add_done_callback(lambda _t: self._loading.pop(name, None))
        return await asyncio.shield(task)

    async def _load(self, e: Server) -> Server:
        prof = self.profile(e)
        name = prof.name
        async with self._ops:
            if e.ready:
                return e
            need = await self.footprint(e)
            for other in self.entries.values():
                if other.loaded:
                    await self.footprint(other)
            budget = await self.budget()
            self._emit("load_requested", name, "a request needs it", {"need": need.as_dict()})
            d = arbiter.admit(name, need, prof.priority, self._view(), budget)
            self._emit(d.action, name, d.reason, d.numbers)
            e.last_decision = d.reason
            if d.action != "admit":
                raise ModelUnavailable(f"model {name!r} cannot be loaded: {d.reason}")
            for victim in d.evict:
                await self._unload_locked(
                    self.entries[victim], f"making room for {name}", d.numbers
                )
            if e.server is None:
                e.server = self._server_factory(prof)
                self.servers.give_manager(e, prof.name)
            try:
                await e.server.start("pool")
            except WarmslotError as exc:
                self._emit("load_failed", name, str(exc), {})
                raise ModelUnavailable(f"model {name!r} failed to start: {exc}") from exc
            if e.manager is not None:
                await e.manager.warmed()  # restore + verify before the first request
            e.loads += 1
            e.last_used = self.clock.monotonic()
            self._emit(
                "loaded",
                name,
                "ready" + (" and its saved prefixes restored" if e.manager else ""),
                {"footprint": need.as_dict(), "port": e.server.port},
            )
            return e

    async def unload(self, name: str, reason: str = "requested") -> bool:
        async with self._ops:
            e = self.entries[name]
            if not e.loaded:
                return False
            if e.inflight:
                self._emit("keep", name, f"not unloaded: {e.inflight} request(s) in flight", {})
                return False
            await self._unload_locked(e, reason, {})
            return True

    async def _unload_locked(self, e: Server, reason: str, numbers: Mapping[str, object]) -> None:
        name = self.profile(e).name
        assert e.inflight == 0, "never unload a model with requests in flight"
        fp = e.footprint.as_dict() if e.footprint else {}
        self._emit("unload", name, reason, {**numbers, "footprint": fp})
        if e.manager is not None and self.core.settings.pool.save_before_unload:
            try:
                saved = await e.manager.save_for_unload()
                self._emit("saved_before_unload", name, saved["reason"], saved)
            except Exception as exc:
                log.exception("saving %s before unload failed", name)
                self._emit("saved_before_unload", name, f"failed: {exc!r}", {})
        assert e.server is not None
        await e.server.stop("pool")
        e.unloads += 1
        self._emit("unloaded", name, reason, {"freed": fp})

    async def sweep(self) -> list[arbiter.Decision]:
        """Idle unloads (TTL) and unloads under critical pressure; returns what was done."""
        async with self._ops:
            now = self.clock.monotonic()
            level = self._pressure_level() if self._pressure_level else self._level()
            view = self._view()
            done: dict[str, arbiter.Decision] = {}
            for d in [
                *arbiter.pressure_unloads(view, level, now),
                *arbiter.idle_unloads(view, now),
            ]:
                e = self.entries[d.model]
                if d.model in done or e.inflight or not e.loaded:
                    continue
                await self._unload_locked(e, d.reason, d.numbers)
                done[d.model] = d
            return list(done.values())

    def _level(self) -> str:
        pressure = self.core.pressure
        return pressure.level if pressure is not None else "nominal"

    async def preload(self, name: str) -> bool:
        """Load `name` ahead of need, only under nominal pressure."""
        d = arbiter.may_preload(
            self._level() if self._pressure_level is None else self._pressure_level()
        )
        self._emit("preload" if d.action == "admit" else "refuse", name, d.reason, d.numbers)
        if d.action != "admit":
            return False
        await self.ensure(name)
        return True

    @property
    def loading(self) -> bool:
        """Whether a model is being loaded now."""
        return bool(self._loading)

    async def close(self) -> None:
        """Cancel the loads under way (the server set stops the servers)."""
        for task in list(self._loading.values()):
            task.cancel()

    # ------------------------------------------------------------ admission
    async def _bring_up(self, e: Server, decision: Decision) -> Route | None:
        """The server set's admission for one of the pool's models: load it if needed
        (through the arbiter, restored and verified), or say why not."""
        if decision.routed_to_side:
            self.routed_side += 1
        name = self.profile(e).name
        try:
            await asyncio.wait_for(self.ensure(name), self.core.settings.pool.load_timeout_s)
        except TimeoutError:
            return Route(
                status=503,
                error=f"Warmslot: model {name!r} is still loading; retry shortly",
                retry_after=5,
            )
        except ModelUnavailable as exc:
            return Route(status=503, error=f"Warmslot: {exc}", retry_after=30)
        return None

    def _pairs(self) -> list[tuple[Profile, Server]]:
        return [(self.profiles[name], e) for name, e in self.entries.items()]

    # ------------------------------------------------------------ status
    def models_list(self) -> ModelList:
        """The body of GET /v1/models: every profile, loaded or not."""
        return {
            "object": "list",
            "data": [
                {
                    "id": p.name,
                    "object": "model",
                    "owned_by": "warmslot",
                    "warmslot": {"role": p.role, "loaded": e.loaded},
                }
                for p, e in self._pairs()
            ],
        }

    def status(self) -> list[ServerRow]:
        """One row per model: its server's row, with its profile, loads and the pool's
        last decision about it."""
        out: list[ServerRow] = []
        for p, e in self._pairs():
            row = self.servers.row(e, p.name)
            row["role"] = p.role
            row["priority"] = p.priority
            row["ttl_s"] = p.ttl_s
            row["loading"] = p.name in self._loading
            row["footprint"] = e.footprint.as_dict() if e.footprint else None
            row["loads"] = e.loads
            row["unloads"] = e.unloads
            row["last_decision"] = e.last_decision
            out.append(row)
        return out
