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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
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
from core.errors import CacheError, CoreStopped, WarmslotError
from core.events import Event, Notice, ServerStateChanged, SettingsChanged
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
from core.server.fit_report import format_plan
from core.server.launch import resolve_launch
from core.server.provision import PATCHED_PURPOSE, Provisioner
from core.server.rpc import WorkerSet, watch_in_use
from core.server.supervisor import Resolved, ServerState, Supervisor
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
Subscriber = Callable[[Event], None]
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._subscribers: list[tuple[Subscriber, tuple[type[Event], ...] | None]] = []
        self._sub_lock = threading.Lock()
        self._stopping = False
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
        self._upgrade_task: asyncio.Task[None] | None = None
        self._upgrade_failed = False
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_at = 0.0
        self._runtime_written = False  # the runtime file is this core's to rewrite and remove

    # ------------------------------------------------------------- events
    def _warn_threadsafe(self, text: str) -> None:
        """A warning Notice from any thread (worker checks run off the loop)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.emit, Notice(level="warning", text=text))

    def subscribe(
        self, callback: Subscriber, types: tuple[type[Event], ...] | None = None
    ) -> Callable[[], None]:
        """Call `callback(event)` for every event (or only those of `types`).

        Callbacks run on the core thread and must be quick. Returns an unsubscribe function.
        """
        entry = (callback, types)
        with self._sub_lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._sub_lock:
                if entry in self._subscribers:
                    self._subscribers.remove(entry)

        return unsubscribe

    def emit(self, event: Event) -> None:
        """Publish an event (call on the core thread)."""
        if self.telemetry is not None:
            try:
                self.telemetry.record(event)
            except Exception:
                log.exception("telemetry could not record %s", type(event).__name__)
        with self._sub_lock:
            subs = list(self._subscribers)
        for callback, types in subs:
            if types is None or isinstance(event, types):
                try:
                    callback(event)
                except Exception:
                    log.exception("event subscriber %r failed", callback)

    # ---------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self._loop is not None and self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """True while `stop()` runs: new requests get a 503, those under way finish."""
        return self._stopping

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
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="warmslot-core", daemon=True
        )
        self._thread.start()
        try:
            started.result(timeout)
        except BaseException:
            self._thread.join(10)
            self._thread = None
            self._loop = None
            raise
        if start_server:
            fut = self.start_server()
            if wait_ready:
                fut.result(timeout)

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as e:
            started.set_exception(e)
            with contextlib.suppress(Exception):
                loop.run_until_complete(self._teardown())
            loop.close()
            return
        self._loop = loop
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()

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
        servers = self.servers = ServerSet(self, state_words=self._server_state_words)
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
                server_state=self._server_state_words,
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
        self.subscribe(self._on_server_state, (ServerStateChanged,))
        try:
            self._write_runtime()
        except OSError as e:
            self._state_unwritable(
                self.paths.runtime_file, e, "`warmslot status` will not find this run"
            )
        self._tasks.append(asyncio.create_task(self._housekeeping()))
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
        """`server.*`, with the primary profile's overrides when profiles are configured."""
        if not self.settings.models:
            return self.settings.server
        return profiles.server_settings(self.settings, profiles.primary(self.settings))

    async def _resolve(self) -> Resolved:
        return await self.resolve_for(self._primary_settings())

    async def resolve_for(self, s: ServerSettings) -> Resolved:
        """Find the binary and model these server settings name (off the loop) and plan
        their launch (`core.server.launch`); the primary's fit plan is kept for status."""
        resolved, primary_plan = await resolve_launch(
            s,
            paths=self.paths,
            provision=self.provision,
            workers=self.workers,
            is_primary=lambda x: x == self._primary_settings(),
        )
        if primary_plan is not None:
            self.fit_plan = primary_plan
        return resolved

    async def _housekeeping(self) -> None:
        """Flush telemetry every second; prune old rows hourly."""
        last_prune = 0.0
        while True:
            await asyncio.sleep(1.0)
            tel = self.telemetry
            if tel is None:
                return
            try:
                tel.maybe_flush(1.0)
                if time.time() - last_prune > 3600:
                    last_prune = time.time()
                    tel.prune(self.settings.telemetry.retention_days)
            except Exception:
                log.exception("telemetry housekeeping failed")

    def stop(self, timeout: float = 120.0) -> None:
        """Shut down in stages and join the core thread. Safe to call twice.

        `timeout` bounds the stages together (requests under way get `STOP_GRACE_S` of
        it, the cache's saves and llama-server's stop the rest), then the thread's join.
        """
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._stopping:
            return
        self._stopping = True
        try:
            fut = asyncio.run_coroutine_threadsafe(self._teardown(), loop)
            try:
                fut.result(timeout)
            except Exception:
                log.exception("shutdown did not finish cleanly")
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
        finally:
            self._loop = None
            self._thread = None
            self._stopping = False

    async def _teardown(self) -> None:
        self.provision.cancel()
        if self._upgrade_task is not None:
            self._upgrade_task.cancel()
        if self.servers is not None:
            self.servers.cancel_starts()
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        if self.proxy is not None:  # 1. stop accepting requests: a 503 each from now on,
            self.proxy.stop_accepting()  # on the open socket; those under way finish
            self._mark_stopping()
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
        if self._runtime_written:  # never another instance's (a start that found its port)
            self._runtime_written = False
            with contextlib.suppress(OSError):
                self.paths.runtime_file.unlink()
        with contextlib.suppress(OSError):
            local_key_file(self.paths.state_dir).unlink()  # this start's local key

    # ------------------------------------------------------------ commands
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the core loop; returns its future."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise CoreStopped("the Warmslot core is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop)

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

    # ------------------------------------------------- patched build in the background
    def _on_server_state(self, event: Event) -> None:
        """When the primary server is ready on a stock binary that the model's disk tier
        needs patched, build the patched server in the background (server.build = auto)."""
        if not isinstance(event, ServerStateChanged) or event.model or event.state != "ready":
            return
        if self._upgrade_task is not None and not self._upgrade_task.done():
            return
        self._upgrade_task = asyncio.ensure_future(self._upgrade())

    async def _upgrade(self) -> None:
        sup = self.supervisor
        s = self._primary_settings()
        if sup is None or sup.resolved is None or s.build != "auto" or self.provision.building:
            return
        if self._upgrade_failed:  # once per run: a failing build is not retried per restart
            return
        binary, mdl = sup.resolved.binary, sup.resolved.model
        loop = asyncio.get_running_loop()
        why = await loop.run_in_executor(None, self.provision.upgrade_reason, s, binary, mdl.path)
        if why is None:
            return
        self.emit(
            Notice(
                level="info",
                text=f"{why}. Building the patched server in the background at idle "
                "priority; Warmslot switches to it at the next quiet moment.",
                hint='server.build = "off" stops this; "now" builds before starting',
            )
        )
        try:
            await self.provision.build(PATCHED_PURPOSE, background=True)
        except asyncio.CancelledError:
            raise
        except WarmslotError as e:
            self.emit(
                Notice(
                    level="warning",
                    text=f"The patched llama-server could not be built: {e}",
                    hint=e.hint or "serving goes on with the stock server, without the disk tier",
                )
            )
            self._upgrade_failed = True
            return
        found = await self.provision.discover(s)
        if found.found is None or not found.found.patched:
            return
        await self._wait_quiet(s.switch_idle_s)
        self.emit(Notice(level="info", text="Switching to the patched llama-server (disk tier)."))
        await sup.restart("switching to the patched llama-server for the disk tier")

    async def _wait_quiet(self, idle_s: float) -> None:
        """Until no request is in flight and none ended in the last `idle_s` seconds."""
        while True:
            idle = self.proxy.idle_for() if self.proxy is not None else idle_s
            if idle is not None and idle >= idle_s:
                return
            wait = 0.5 if idle is None else max(0.1, idle_s - idle)
            await asyncio.sleep(wait)

    def _server_state_words(self) -> str:
        """The server's state for a 503, with what is happening or went wrong."""
        sup = self.supervisor
        if sup is None:
            return "stopped"
        build = self.provision.status()
        if build is not None and not build.get("background"):
            return f"{sup.state.value} — {build.get('text') or 'building llama-server'}"
        if sup.state is ServerState.FAILED and sup.state_reason:
            return f"failed — {sup.state_reason}; see `warmslot doctor`"
        return sup.state.value

    def _record_build(self, row: dict[str, object]) -> None:
        if self.telemetry is None or not row.get("build_id"):
            return
        self.telemetry.upsert(
            "builds",
            {
                "build_id": row["build_id"],
                "ts": time.time(),
                "outcome": row.get("outcome"),
                "duration_s": row.get("duration_s"),
                "log_path": row.get("log_path"),
                "inputs": json.dumps(row, default=str),
            },
            "build_id",
        )

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
                return self.submit(self._update_settings(changes, persist=persist))
        out: concurrent.futures.Future[SettingsUpdate] = concurrent.futures.Future()
        try:
            edit, new, update = self._plan_settings(changes, persist=persist)
            if edit is not None:
                edit.write()
            if new is not None:
                self.settings = new
            out.set_result(update)
        except Exception as e:
            out.set_exception(e)
        return out

    def _plan_settings(
        self, changes: Mapping[str, object], *, persist: bool
    ) -> tuple[config_mod.Edit | None, Settings | None, SettingsUpdate]:
        """The file edit to write (with `persist`), the settings to use (None when the
        file still has a problem) and the answer."""
        keys = keys_file(self.paths.config_file)
        if not persist:
            new = self.settings.with_changes(changes, keys_path=keys)
            return None, new, SettingsUpdate.between(self.settings, new)
        edit = config_mod.edit_file(self.paths.config_file, changes)
        if edit.after.settings is None:
            return edit, None, SettingsUpdate(problems=edit.after.problems)
        after = edit.after.settings
        return edit, after, SettingsUpdate.between(self.settings, after)

    async def _update_settings(
        self, changes: Mapping[str, object], *, persist: bool
    ) -> SettingsUpdate:
        old = self.settings
        edit, new, update = self._plan_settings(changes, persist=persist)
        moved = {"proxy.host", "proxy.port"} & set(update.changed)
        if new is not None and moved and self.proxy is not None and self.proxy.port:
            # Live: the new address first (a taken port changes nothing, the file keeps
            # its value), then the runtime file, so `warmslot status` and the tray find it.
            await self.proxy.rebind(new.proxy.host, new.proxy.port)
            self._write_runtime()
        if edit is not None:
            edit.write()
        if new is None:
            return update
        self.settings = new
        if update.changed:
            self.emit(
                SettingsChanged(changes=config_mod.settings_changes(old, new, update.changed))
            )
        return update

    # ------------------------------------------------------------ status
    async def _status_async(self, *, history: bool = True) -> Status:
        assert self.supervisor is not None and self.proxy is not None
        tel = self.telemetry if history else None
        hour_ago = time.time() - 3600
        out: Status = {
            "warmslot": {
                "pid": os.getpid(),
                "started": self.started_at,
                "proxy": f"http://{self.proxy.host}:{self.proxy.port}",
                "config": str(self.paths.config_file),
            },
            "build": self.provision.status(),
            "server": {
                **self.supervisor.snapshot(),
                "fit": None
                if self.fit_plan is None
                else {"plan": self.fit_plan.to_dict(), "text": format_plan(self.fit_plan)},
            },
            "workers": self.workers.snapshot() if self.workers.configured else None,
            "totals": tel.totals() if tel else None,
            "last_hour": tel.totals(hour_ago) if tel else None,
            "clients": tel.per_client() if tel else [],
            "users": tel.per_user() if tel else [],
            "sessions": tel.sessions(hour_ago, limit=20) if tel else [],
            "recent_requests": tel.recent_requests(10) if tel else [],
            "models": self.pool.status()
            if self.pool is not None
            else [
                {
                    "name": profiles.PRIMARY_NAME,
                    "role": "text",
                    "primary": True,
                    "state": self.supervisor.state.value,
                }
            ],
        }
        if self.backends is not None:  # only with [[backends]]: the default stays as it was
            out["backends"] = self.backends.status()
        if self.pool is not None:
            out["model_calls"] = {
                "routed_to_side": self.pool.routed_side,
                "by_model": {e["name"]: e["calls"] for e in out["models"]},
            }
        if self.policy is not None:
            try:
                out["cache"] = await self.policy.status()
            except Exception as e:
                log.exception("cache status failed")
                out["cache"] = {"error": repr(e)}
        return out

    def _write_runtime(self, state: str = "running") -> None:
        """The runtime file (read by `core.local_api`): where this instance listens, and
        whether it runs or is stopping."""
        assert self.proxy is not None
        data = {
            "pid": os.getpid(),
            "proxy_host": self.proxy.host,
            "proxy_port": self.proxy.port,
            "started": self.started_at,
            "state": state,
        }
        path: Path = self.paths.runtime_file
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        self._runtime_written = True

    def _mark_stopping(self) -> None:
        """Say in the runtime file that this instance is stopping: a `warmslot serve`
        started now waits for it to exit instead of failing on its port."""
        if self._runtime_written:
            with contextlib.suppress(OSError):
                self._write_runtime("stopping")
