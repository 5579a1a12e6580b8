"""The Core: Warmslot's headless engine on one background thread.

One asyncio loop runs on a dedicated thread and owns everything stateful: the
proxy, the supervisor, the llama-server client, the telemetry writer and every
timer. Other threads (the CLI, the Qt GUI) talk to it only through this class:

- **commands** return `concurrent.futures.Future` objects and never block the caller;
- **events** are frozen dataclasses delivered to `subscribe`d callbacks (on the core thread).

Lifecycle: `start()` returns once the proxy's port is bound (llama-server keeps
starting in the background unless ``wait_ready=True``); `stop()` shuts down in
stages — stop accepting requests (new ones get a 503 with Retry-After on the
still-open socket; those under way finish, `STOP_GRACE_S` at most) → let the cache
save what it must → stop llama-server → close the proxy's socket → flush telemetry
→ close the database → join the thread. The runtime file says "stopping" meanwhile,
so a new instance waits for this one instead of handing over to it.

`Core` is the composition root, the one place that knows all the parts; beside it:
`loop` (the core thread and its loop), `status` (the `Status` gathered from the parts)
and `settings` (a settings change applied to the running core).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from core import config as config_mod
from core.build import BuildRequest
from core.cache import explain
from core.cache.background import Background
from core.cache.index import CacheIndex
from core.cache.manager import CacheManager
from core.clock import Clock, RealClock
from core.config import ServerSettings, Settings, SettingsUpdate
from core.config.keys import KeyRing, keys_file, local_key_file, write_local_key
from core.engine import settings as settings_mod
from core.engine.loop import LoopThread
from core.engine.status import collect as collect_status
from core.engine.status import server_state_words
from core.errors import CacheError, CoreStopped, WarmslotError
from core.events import Event, EventBus, Notice, ServerStateChanged, Subscriber
from core.local_api import RuntimeFile
from core.machine.devices import GpuInfo, read_llama_devices
from core.machine.pressure import PressureMonitor, Sampler
from core.machine.sweeps import Outcome, Sweeps
from core.models import profiles
from core.models.backends import BackendSet
from core.models.pool import ModelPool
from core.models.servers import ServerSet
from core.paths import Paths
from core.proxy.app import CacheService, Proxy, ProxyDeps
from core.proxy.metrics import COUNTED, Counters, Metrics
from core.server import discover
from core.server.fit import FitPlan
from core.server.launch import resolve_launch
from core.server.provision import Provisioner
from core.server.rpc import WorkerSet, watch_in_use
from core.server.supervisor import Resolved, ServerState, Supervisor
from core.server.upgrade import PatchedUpgrade
from core.server.upstream import Upstream
from core.status import EvictResult, Explanation, PinResult, RewarmResult, Status
from core.telemetry import QUERIES, Telemetry
from core.telemetry.rates import PrefillRates
from core.telemetry.totals import lifetime

log = logging.getLogger("warmslot.core")
# At shutdown, how long the requests under way may take before the cache saves and
# llama-server stops (docs/gui.md#quitting-and-relaunching). One still running then is
# answered 503 with Retry-After, or its stream ends with an error event.
STOP_GRACE_S = 30.0
T = TypeVar("T")
PolicyFactory = Callable[["Core"], CacheService | None]


class Core:
    """Warmslot's engine. Create, `start()`, use commands, `stop()`."""

    def __init__(
        self,
        paths: Paths,
        settings: Settings | None = None,
        *,
        policy_factory: PolicyFactory | None = None,
        clock: Clock | None = None,
        binary_check: discover.Checker | None = discover.smoke_check,
        build_request: BuildRequest | None = None,
    ) -> None:
        self.paths = paths
        self.clock: Clock = clock if clock is not None else RealClock()  # sweeps, TTLs
        self.settings = settings if settings is not None else config_mod.load(paths.config_file)
        self._policy_factory = policy_factory
        self._thread = LoopThread("warmslot-core")  # the core thread, its one loop
        self._bus = EventBus()
        self.telemetry: Telemetry | None = None  # the history
        # Lifetime totals behind /metrics: seeded from the history at start, then
        # counted from events (core.proxy.metrics).
        self.counters = Counters()
        self.cache_index: CacheIndex | None = None  # what the slot files are (its own file)
        self.supervisor: Supervisor | None = None
        # The HTTP session to the primary llama-server, shared by the proxy and the
        # cache manager (the model pool makes one per other model).
        self.upstream: Upstream | None = None
        self.proxy: Proxy | None = None
        self.policy: CacheService | None = None
        # Every llama-server requests go to (the primary alone in single-model mode).
        self.servers: ServerSet | None = None
        self.pool: ModelPool | None = None  # only when [[models]] profiles are configured
        self.backends: BackendSet | None = None  # only with [[backends]] (docs/scale.md)
        # The one scheduler for background work, and the machine's one pressure monitor
        # (made at start, on the core's clock): every model's cache sweeps run on them.
        self.sweeps: Sweeps | None = None
        self.pressure: PressureMonitor | None = None
        self.background: Background | None = None
        # Each model's measured cold prefill rate: fed by the proxy, read by the cache.
        self.prefill_rates = PrefillRates()
        self.fit_plan: FitPlan | None = None  # the primary's memory plan, launched with
        # llama.cpp RPC workers ([[workers]], docs/scale.md): checked before each launch.
        self.workers = WorkerSet(
            lambda: self.settings.workers,
            notify=self._warn_threadsafe,
        )
        # `binary_check` smoke-starts each llama-server candidate (None: trust --version,
        # for tests whose fake servers stage launch faults on purpose).
        # `build_request`: what automatic builds build (default: the pinned llama.cpp with
        # our patches); tests give a small stand-in tree.
        self.provision = Provisioner(
            self.paths, self.emit, self._record_build, check=binary_check, request=build_request
        )
        # server.build = auto: the patched server, built while the stock one serves.
        self.upgrade = PatchedUpgrade(
            self.provision,
            supervisor=lambda: self.supervisor,
            settings=self._primary_settings,
            idle_for=lambda: self.proxy.idle_for() if self.proxy is not None else math.inf,
            emit=self.emit,
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_at = 0.0
        self.runtime = RuntimeFile(paths.runtime_file)  # where `warmslot status` finds us

    # ------------------------------------------------------------- events
    def _warn_threadsafe(self, text: str) -> None:
        """A warning Notice from any thread (worker checks run off the loop)."""
        self._thread.call_soon(self.emit, Notice(level="warning", text=text))

    def subscribe(
        self, callback: Subscriber, types: tuple[type[Event], ...] | None = None
    ) -> Callable[[], None]:
        """Call `callback(event)` for every event (or only those of `types`).

        Callbacks run on the core thread and must be quick. Returns an unsubscribe function.
        """
        return self._bus.subscribe(callback, types)

    def emit(self, event: Event) -> None:
        """Publish an event (call on the core thread): into the history, then to the
        subscribers."""
        if self.telemetry is not None:
            try:
                self.telemetry.record(event)
            except Exception:
                log.exception("telemetry could not record %s", type(event).__name__)
        self._bus.publish(event)

    # ---------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self._thread.running

    @property
    def stopping(self) -> bool:
        """True while `stop()` runs: new requests get a 503, those under way finish."""
        return self._thread.stopping

    def start(
        self, *, start_server: bool = True, wait_ready: bool = False, timeout: float = 300.0
    ) -> None:
        """Start the core thread and the proxy; launch llama-server unless told not to.

        Returns when the proxy port is bound (raises PortInUse if taken). With
        `wait_ready`, also waits until llama-server is ready and raises its start error.
        """
        if self.running:
            return
        self.paths.ensure()
        self._thread.start(self._setup, self._teardown, timeout)
        if start_server:
            fut = self.start_server()
            if wait_ready:
                fut.result(timeout)

    async def _setup(self) -> None:
        self.started_at = time.time()
        # The cache index first: on the first start after the upgrade it takes its tables
        # out of the history database. Either file, if it cannot be used, is moved aside
        # and made afresh — said in a Notice, never a reason not to serve (docs/cache.md).
        self.cache_index = CacheIndex.open(
            self.paths.cache_index_db, slot_dir=self.paths.slot_dir, legacy=self.paths.telemetry_db
        )
        self.telemetry, history = Telemetry.open(self.paths.telemetry_db)
        self.counters.seed(lifetime(self.telemetry))  # once; then counted in memory
        # Each model's cold prefill rate continues from its history, so the headers'
        # estimate and the dashboard's "saved" agree from the first request on.
        for model, rate in self.telemetry.cold_prefill_rates().items():
            self.prefill_rates.seed(model, rate["tokens"], rate["ms"])
        self.subscribe(self.counters.record, COUNTED)
        if history is not None:
            log.warning("%s", history.text())
        for text in ([history.text()] if history else []) + self.cache_index.notes:
            self.emit(Notice(level="warning", text=text))
        try:
            local_key = write_local_key(self.paths.state_dir)
        except OSError as e:  # a read-only state folder
            local_key = ""
            self._state_unwritable(
                local_key_file(self.paths.state_dir),
                e,
                "`warmslot status` on this machine needs proxy.api_key for this run",
            )
        s = self.settings
        self.supervisor = Supervisor(
            paths=self.paths,
            settings=self._primary_settings,
            resolve=self._resolve,
            emit=self.emit,
        )
        sup = self.supervisor
        self.upstream = Upstream(
            lambda: sup.base_url,
            api_key=lambda: sup.api_key,
            quarantine=lambda: sup.quarantine,
            served=lambda: sup.model_name,
        )
        self.sweeps = Sweeps(self.clock, self.emit)
        self.pressure = PressureMonitor(
            lambda: self.settings.pressure,
            Sampler(
                self._watched_dirs,  # the slot files' disk first: its free space is what saves need
                self._server_pids,
                devices=self._llama_devices,
                clock=self.clock.monotonic,
            ),
            self.emit,
            self.clock,
            telemetry=lambda: self.telemetry,
        )
        if self._policy_factory is not None:
            self.policy = self._policy_factory(self)
        # One registry of llama-servers, one admission: the primary alone, or with its
        # backends ([[backends]]) and the pool's models ([[models]]), or both.
        servers = self.servers = ServerSet(self, state_words=self._state_words)
        router, models = None, None
        if s.backends:  # several backends of the primary model: chosen per request
            self.backends = BackendSet(servers, self._primary_settings)
            router = self.backends.router
        if s.models:
            backend = self.backends.choose if self.backends is not None else None
            pool = self.pool = ModelPool(servers, backend=backend)
            router, models = pool.router, pool.models_list
            self.sweeps.add("models", self._sweep_models, lambda: self.settings.pool.idle_check_s)
        admit = servers.route
        self.proxy = Proxy(
            ProxyDeps(
                upstream=self.upstream,
                settings=lambda: self.settings.proxy,
                server_state=self._state_words,
                # The slots llama-server was launched with: the fit plan's when it chose them.
                n_slots=lambda: (
                    self.fit_plan.slots if self.fit_plan else self.settings.server.launch_slots
                ),
                emit=self.emit,
                status=self._status_async,
                metrics=Metrics(
                    self.counters,
                    server_ready=lambda: sup.state is ServerState.READY,
                    backends=lambda: self.backends.status()["backends"] if self.backends else (),
                ).exposition,
                policy=self.policy,
                # Named keys (keys.toml, re-read when it changes), proxy.api_key as "default",
                # and this start's local key for `warmslot status` here (core.keys).
                keys=KeyRing(
                    keys_file(self.paths.config_file),
                    lambda: self.settings.proxy.api_key,
                    local=local_key,
                ),
                prefill_rates=self.prefill_rates,
                router=router,
                admit=admit,
                models=models,
                explain=self._explain,
            )
        )
        if self.cache_managers():
            self.background = Background(
                self.sweeps, self.pressure, lambda: self.settings, self.cache_managers
            )
            self.background.register()
        await self.proxy.start(s.proxy.host, s.proxy.port)
        self.subscribe(self.upgrade.on_state, (ServerStateChanged,))
        try:
            self._write_runtime()
        except OSError as e:
            self._state_unwritable(
                self.paths.runtime_file, e, "`warmslot status` will not find this run"
            )
        tel = self.telemetry  # flushed every second, pruned hourly
        self._tasks.append(
            asyncio.create_task(tel.housekeeping(lambda: self.settings.telemetry.retention_days))
        )
        # A lost RPC worker restarts the server before a request finds out (docs/scale.md).
        sup = self.supervisor
        self._tasks.append(
            asyncio.create_task(
                watch_in_use(self.workers, lambda: sup.state is ServerState.READY, sup.restart)
            )
        )
        if self.sweeps.sweeps:
            self._tasks.append(asyncio.create_task(self.sweeps.run_forever()))

    def _state_unwritable(self, path: Path, err: OSError, consequence: str) -> None:
        """Say that a file of the state folder cannot be written (serving goes on)."""
        text = f"cannot write {path} ({err.strerror or err}); {consequence}"
        log.warning("%s", text)
        self.emit(Notice(level="warning", text=text))

    def cache_managers(self) -> list[CacheManager]:
        """The cache manager of every model that has one: the primary's first, then each
        pooled model's (made when the pool first loads it)."""
        if self.servers is not None:
            return self.servers.managers()
        return [self.policy] if isinstance(self.policy, CacheManager) else []

    def _llama_devices(self) -> list[GpuInfo]:
        """GPUs NVML cannot see (Vulkan, ROCm, Metal): the running server binary's list."""
        r = self.supervisor.resolved if self.supervisor is not None else None
        return [] if r is None else read_llama_devices(r.binary.path, r.binary.launch_env())

    def _watched_dirs(self) -> list[Path]:
        """Where a full disk breaks Warmslot: each running server's ``--slot-save-path``
        (a folder per server identity, made at its launch), the slot folder they lie
        under, and the state folder (the databases)."""
        servers = self.servers.supervisors() if self.servers is not None else []
        own = [r.slot_dir for s in servers if s and (r := s.resolved) and r.slot_dir is not None]
        return [*own, self.paths.slot_dir, self.paths.state_dir]

    def _server_pids(self) -> list[int]:
        """Every running llama-server's pid (their RSS joins each pressure sample)."""
        return self.servers.pids() if self.servers is not None else []

    async def _sweep_models(self) -> Outcome:
        """The model pool's idle and pressure unloads, on the engine's scheduler."""
        assert self.pool is not None
        done = await self.pool.sweep()
        return Outcome(len(done), {"unloaded": [d.model for d in done]})

    def _primary_settings(self) -> ServerSettings:
        return profiles.primary_server_settings(self.settings)

    async def _resolve(self) -> Resolved:
        return await self.resolve_for(self._primary_settings(), primary=True)

    async def resolve_for(self, s: ServerSettings, *, primary: bool = False) -> Resolved:
        """Find the binary and model these server settings name (off the loop) and plan
        their launch (`core.server.launch`): the `primary` server's with the RPC workers,
        and its fit plan kept for status; any other server's on this machine alone."""
        resolved, primary_plan = await resolve_launch(
            s,
            paths=self.paths,
            provision=self.provision,
            workers=self.workers,
            primary=primary,
        )
        if primary_plan is not None:
            self.fit_plan = primary_plan
        return resolved

    def stop(self, timeout: float = 120.0) -> None:
        """Shut down in stages and join the core thread. Safe to call twice.

        `timeout` bounds the stages together (requests under way get `STOP_GRACE_S` of
        it, the cache's saves and llama-server's stop the rest), then the thread's join.
        """
        self._thread.stop(self._teardown, timeout)

    async def _teardown(self) -> None:
        self.provision.cancel()
        self.upgrade.cancel()
        if self.servers is not None:
            self.servers.cancel_starts()
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        if self.proxy is not None:  # 1. stop accepting requests: a 503 each from now on,
            self.proxy.stop_accepting()  # on the open socket; those under way finish
            self.runtime.mark_stopping()
            await self.proxy.drain(STOP_GRACE_S)
        if self.policy is not None:  # 2. the cache saves what it must
            try:
                await self.policy.close()
            except Exception:
                log.exception("cache manager failed while shutting down")
        if self.backends is not None:  # 3. stop llama-server: every other backend, pooled
            try:  # model, then the primary
                await self.backends.close()
            except Exception:
                log.exception("backends failed while shutting down")
        if self.pool is not None:
            try:
                await self.pool.close()
            except Exception:
                log.exception("model pool failed while shutting down")
        if self.servers is not None:
            try:
                await self.servers.close()
            except Exception:
                log.exception("llama-servers failed while shutting down")
        if self.supervisor is not None:
            await self.supervisor.close()
        if self.proxy is not None:  # no llama-server behind it any more: close the socket
            await self.proxy.stop()
        if self.upstream is not None:  # nothing talks to the primary server any more
            await self.upstream.close()
        if self.telemetry is not None:  # 4. flush and close the databases
            self.telemetry.close()
            self.telemetry = None
        if self.cache_index is not None:
            self.cache_index.close()
            self.cache_index = None
        self.runtime.remove()  # never another instance's (a start that found its port)
        with contextlib.suppress(OSError):
            local_key_file(self.paths.state_dir).unlink()  # this start's local key

    # ------------------------------------------------------------ commands
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the core loop; returns its future (CoreStopped when the
        core is not running)."""
        return self._thread.submit(coro)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run a plain function on the core thread (e.g. a telemetry query)."""

        async def run() -> T:
            return fn()

        return self.submit(run())

    def start_server(self) -> concurrent.futures.Future[None]:
        """Find the binary and model, launch llama-server; resolves when it is ready."""
        return self.submit(self._start_server())

    async def _start_server(self) -> None:
        assert self.supervisor is not None
        if self.backends is not None:  # launched in the background, beside the primary
            self.backends.start()
        try:
            await self.supervisor.start("user")
        except WarmslotError as e:
            self.emit(Notice(level="error", text=str(e), hint=e.hint))
            raise

    def stop_server(self) -> concurrent.futures.Future[None]:
        assert self.supervisor is not None
        return self.submit(self.supervisor.stop("user"))

    def restart_server(self) -> concurrent.futures.Future[None]:
        assert self.supervisor is not None
        return self.submit(self.supervisor.restart("user"))

    def pin(self, filename: str, pinned: bool = True) -> concurrent.futures.Future[PinResult]:
        """Pin (never expires, never swept, kept warm) or unpin a saved state."""
        return self.submit(self._cache().pin(filename, pinned))

    def evict(self, filename: str) -> concurrent.futures.Future[EvictResult]:
        """Delete a saved state now (only files Warmslot wrote)."""
        return self.submit(self._cache().evict(filename))

    def rewarm(self, fingerprint: str) -> concurrent.futures.Future[RewarmResult]:
        """Bring a prefix back into its slot (re-warm, or restore into a free slot)."""
        return self.submit(self._cache().rewarm(fingerprint))

    def explain(
        self, request_id: str | None = None
    ) -> concurrent.futures.Future[Explanation | None]:
        """Why a request reused what it did (the latest request when None): computed now
        by its cache manager while it keeps the request, else read from the history; None
        when neither has it (`core.cache.explain`)."""
        return self.submit(self._explain(request_id))

    async def _explain(self, request_id: str | None) -> Explanation | None:
        return await explain.lookup(self.cache_managers, lambda: self.telemetry, request_id)

    def _cache(self) -> CacheService:
        if self.policy is None:
            raise CacheError("cache management is not attached to this core")
        return self.policy

    def build_server(self) -> concurrent.futures.Future[Any]:
        """Build llama-server from source with Warmslot's patches (the pinned llama.cpp,
        cached by its inputs); progress arrives as `BuildProgress` events. Resolves to the
        build record; discovery then finds it in the build cache."""
        return self.submit(self.provision.build("building llama-server (requested)"))

    def cancel_build(self) -> concurrent.futures.Future[bool]:
        """Cancel a running build (its temp dir is removed); True if one was running."""

        async def cancel() -> bool:
            return self.provision.cancel()

        return self.submit(cancel())

    def _record_build(self, row: dict[str, object]) -> None:
        if self.telemetry is not None:
            self.telemetry.record_build(row)

    def server_status(self) -> concurrent.futures.Future[Status]:
        """`status()` without the telemetry history (cheap enough to poll every second)."""
        return self.submit(self._status_async(history=False))

    def status(self) -> concurrent.futures.Future[Status]:
        """Everything `warmslot status` and the tray show, as JSON-able typed dicts."""
        return self.submit(self._status_async())

    def query(self, name: str, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Run a telemetry query by name (one of `core.telemetry.QUERIES`) on the core thread.

        Raises ValueError at once for an unknown name.
        """
        if name not in QUERIES:
            raise ValueError(f"unknown query {name!r}")

        def run() -> Any:
            assert self.telemetry is not None
            return self.telemetry.query(name, **kwargs)

        return self.call(run)

    def update_settings(
        self, changes: Mapping[str, object], *, persist: bool = True
    ) -> concurrent.futures.Future[SettingsUpdate]:
        """Change the settings named in `changes` (dotted names, or ``models`` /
        ``workers`` / ``backends`` with their whole list) and apply what can be applied.

        With `persist` only those settings are written into the settings file (every
        other byte stays: `config.edit_file`), and the whole file is read back: when it
        is valid the core uses it from then on — what was changed by hand meanwhile too
        — else nothing changes here and the answer lists what is still wrong. Without
        `persist` the running settings change and the file is left alone. A change the
        file or the rules refuse raises ConfigError (nothing written); a new proxy
        address that is taken raises PortInUse (nothing written, the proxy stays).
        Works on a core that is not running too: the file, and what its start uses.
        The answer (`SettingsUpdate`) names what changed and what waits for a restart.
        """
        if self.running:
            with contextlib.suppress(CoreStopped):
                return self.submit(settings_mod.apply_running(self, changes, persist=persist))
        out: concurrent.futures.Future[SettingsUpdate] = concurrent.futures.Future()
        try:
            out.set_result(settings_mod.apply_stopped(self, changes, persist=persist))
        except Exception as e:
            out.set_exception(e)
        return out

    # ------------------------------------------------------------ status
    async def _status_async(self, *, history: bool = True) -> Status:
        return await collect_status(self, history=history)

    def _state_words(self) -> str:
        return server_state_words(self.supervisor, self.provision)

    def _write_runtime(self) -> None:
        assert self.proxy is not None
        self.runtime.write(self.proxy.host, self.proxy.port, self.started_at)
