"""Supervising one llama-server process.

States: ``stopped → starting → ready → stopping → stopped``, and ``failed`` when
it cannot be (re)started. ``ready`` means ``GET /health`` answered 200. The
process runs in its own process group (so stop kills helpers too), watched so that
it never outlives Warmslot, even a killed one (`core.machine.process.spawn`). A crash restarts it
with capped exponential backoff; after ``server.max_restarts`` of them in a row it is
``failed`` and tried again after a longer wait (`FAILED_RETRY_S`, doubling), so no
crash loop ends in a permanent 503. A crash during warm-up on a build that repacks
weights for AMX is retried once with ``--no-repack`` and remembered for that
binary (docs/llama-server-facts.md#amx-repack-crash).

While it runs, its output is always read, and every `PROGRESS_EVERY_S` it
must answer ``GET /metrics``, which its main loop serves — ``/health`` is answered by
the HTTP thread alone, also while the loop is stuck. No answer within
`PROGRESS_TIMEOUT_S` and it is killed and restarted like a crash. Each crash (or stuck
kill) tells the server's `CrashQuarantine` (`core.server.quarantine`), which refuses
the request that was in flight when it happened.

Each launch gets a new random API key that only Warmslot knows (`core.server.access`);
`auth_headers` and the `Upstream`'s middleware send it. Its output is read by
`core.server.output`, the liveness checks are `core.server.health`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import aiohttp

from core.config import ServerSettings
from core.errors import ServerStartFailed, WarmslotError
from core.events import (
    Event,
    Notice,
    ServerLaunched,
    ServerStateChanged,
)
from core.machine import process
from core.paths import Paths
from core.server import health, logparse, rpc
from core.server.access import (
    CORS_ENV,
    KEY_FLAGS,
    check_port_free,
    free_port,
    remove,
    write_key_file,
)
from core.server.argv import LaunchInputs, build_argv
from core.server.discover import ServerBinary
from core.server.exits import CRASH_SIGNALS, ExitLog, wait_exited
from core.server.model import ModelFile
from core.server.output import ServerOutput
from core.server.quarantine import CrashQuarantine
from core.server.quirks import BinaryQuirks
from core.status.server import ServerSnapshot

log = logging.getLogger("warmslot.server")

HEALTHY_RESET_S = 300.0  # a run this long resets the restart counter
STOP_GRACE_S = 10.0
# How often a ready server must prove that its main loop runs, and how long it may take.
# The loop answers between two batches, and one batch of a large prompt on a slow CPU,
# or a slot file of gigabytes written to disk, takes a while: well under this.
PROGRESS_EVERY_S = 15.0
PROGRESS_TIMEOUT_S = 120.0
# After the restarts ran out: the first wait before trying again, and the longest.
FAILED_RETRY_S = 60.0
FAILED_RETRY_MAX_S = 900.0


class ServerState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


@dataclass(frozen=True)
class Resolved:
    """What to launch: the binary, the model, and flags from the fit planner."""

    binary: ServerBinary
    model: ModelFile
    plan_args: tuple[str, ...] = ()
    slot_dir: Path | None = None  # --slot-save-path; default: paths.slot_dir


Resolver = Callable[[], Awaitable[Resolved]]


class Supervisor:
    """Starts, watches, restarts and stops llama-server. Runs on the core's loop."""

    def __init__(
        self,
        *,
        paths: Paths,
        settings: Callable[[], ServerSettings],
        resolve: Resolver,
        emit: Callable[[Event], None],
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
        log_path: Path | None = None,
        progress_every_s: float | None = None,
        progress_timeout_s: float | None = None,
    ) -> None:
        self.name = name  # the model profile it serves; "" for the primary server
        self._log_path = log_path if log_path is not None else paths.server_log
        self._paths = paths
        self._settings = settings
        self._resolve = resolve
        self._emit = emit
        self._clock = clock
        self.state = ServerState.STOPPED
        self.state_reason = ""
        self.port: int | None = None
        self.pid: int | None = None
        self.argv: list[str] = []
        self.run_id = ""
        self.resolved: Resolved | None = None
        self.output = ServerOutput(self._log_path, emit)
        self._quirks = BinaryQuirks(paths.state_dir)
        self.restarts = 0
        self.exits = ExitLog()
        self._ready_at = 0.0  # `_clock()` when it last became ready
        self.no_repack_active = False
        self._proc: asyncio.subprocess.Process | None = None
        self._stop_requested = False
        self._watch_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._ready = asyncio.Event()
        self._started_at = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._api_key: str | None = None
        self._worker_waits = 0  # checks in a row that found a needed RPC worker gone
        self._progress_every_s = progress_every_s or PROGRESS_EVERY_S
        self._progress_timeout_s = progress_timeout_s or PROGRESS_TIMEOUT_S
        self._progress_task: asyncio.Task[None] | None = None
        self._stuck = ""  # why the current run was killed as stuck ("" when it was not)
        self._failed_retries = 0  # give-ups in a row (the wait before the next try doubles)
        # The request bodies in flight (told by the proxy) and those that crashed it.
        self.quarantine = CrashQuarantine(clock=clock)

    # ----------------------------------------------------------------- public API
    @property
    def base_url(self) -> str | None:
        if self.state is not ServerState.READY or self.port is None:
            return None
        return f"http://{self._settings().host}:{self.port}"

    @property
    def api_key(self) -> str | None:
        """The running launch's API key (None while no server runs). Secret: never log it."""
        return self._api_key

    @property
    def model_name(self) -> str:
        """The file name of the model this server runs (or last ran); "" before it was
        resolved. What accounting keys a model's numbers by: a switch to another model
        under the same profile starts another model's rates."""
        r = self.resolved
        return r.model.path.name if r is not None else ""

    def recent_restarts(self) -> int:
        """The crash restarts in a row that still make llama-server unsteady: all of them
        until it has been ready for ``server.degraded_clear_s`` since the last, then 0
        (`restarts` itself counts on, for `max_restarts`)."""
        steady = self._clock() - self._ready_at >= self._settings().degraded_clear_s
        return 0 if self.state is ServerState.READY and steady else self.restarts

    def auth_headers(self) -> dict[str, str]:
        """Headers that authenticate a request to the running server (empty when none runs)."""
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    async def start(self, requested_by: str = "user") -> None:
        """Start llama-server and return once it is ready.

        Raises ServerStartFailed (with the reason from its output) or an
        EnvironmentProblem (binary or model missing, port taken).
        """
        async with self._lock:
            if self.state in (ServerState.READY, ServerState.STARTING):
                return
            self.restarts = 0
            await self._start_locked(requested_by, attempt="start")

    async def stop(self, requested_by: str = "user") -> None:
        """Stop llama-server: ask its group to exit, kill it after a grace period
        (`core.machine.process.stop_group`)."""
        if self._restart_task is not None:
            self._restart_task.cancel()
            self._restart_task = None
        async with self._lock:
            await self._stop_locked(requested_by)

    async def restart(self, requested_by: str = "user") -> None:
        async with self._lock:
            await self._stop_locked(requested_by)
            self.restarts = 0
            await self._start_locked(requested_by, attempt="restart")

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        await self.stop("shutdown")
        self.output.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def snapshot(self) -> ServerSnapshot:
        """State for status displays."""
        r = self.resolved
        return {
            "state": self.state.value,
            "reason": self.state_reason,
            "pid": self.pid,
            "port": self.port,
            "argv": list(self.argv),
            "run_id": self.run_id,
            "restarts": self.restarts,
            "recent_restarts": self.recent_restarts(),
            "no_repack": self.no_repack_active,
            # Whether the port takes only Warmslot's key; the key itself is never shown.
            "api_key_protected": self._api_key is not None,
            "binary": None if r is None else r.binary.info(),
            "model": None if r is None else r.model.info(),
            "exits": self.exits.rows(),
        }

    # ------------------------------------------------------------------ internals
    def _set_state(self, state: ServerState, reason: str = "") -> None:
        previous = self.state
        self.state = state
        self.state_reason = reason
        if state is ServerState.READY:
            self._ready.set()
            if previous is not state:
                self._ready_at = self._clock()
        else:
            self._ready.clear()
        if previous is not state:
            log.info(
                "llama-server %s → %s%s",
                previous.value,
                state.value,
                f" ({reason})" if reason else "",
            )
            self._emit(
                ServerStateChanged(
                    state=state.value,
                    previous=previous.value,
                    reason=reason,
                    pid=self.pid,
                    port=self.port,
                    model=self.name,
                )
            )

    def _failed(self) -> bool:
        return self.state is ServerState.FAILED

    async def _start_locked(self, requested_by: str, attempt: str) -> None:
        self._stop_requested = False
        self._set_state(ServerState.STARTING, f"requested by {requested_by}")
        try:
            resolved = await self._resolve()
            self.resolved = resolved
            no_repack = self._quirks.want_no_repack(self._settings().no_repack, resolved.binary)
            try:
                await self._launch(resolved, no_repack, attempt)
            except ServerStartFailed as e:
                crashed = getattr(e, "crash_signal", None)
                # An RPC worker that went away aborts the server too: not the AMX bug.
                rpc_lost = rpc.rpc_failure(self.output.run_lines())
                if (
                    crashed is not None
                    and not no_repack
                    and not rpc_lost
                    and self._settings().no_repack == "auto"
                ):
                    reason = (
                        f"llama-server crashed during warm-up (signal {crashed}); "
                        "retrying with --no-repack (AMX weight repacking bug)"
                    )
                    log.warning(reason)
                    self._quirks.remember_no_repack(resolved.binary.identity, reason)
                    await self._launch(resolved, True, "no-repack-retry")
                else:
                    raise
        except rpc.WorkerUnavailable as e:
            # Not a failure of the server: wait for the worker, for as long as it takes.
            delay = min(0.5 * (2**self._worker_waits), self._settings().backoff_max_s)
            self._worker_waits += 1
            self._set_state(ServerState.STARTING, f"{e}; checking again in {delay:.0f} s")
            self._restart_task = asyncio.create_task(self._restart_after(delay))
            return
        except WarmslotError as e:
            self._set_state(ServerState.FAILED, str(e))
            raise
        except Exception as e:
            self._set_state(ServerState.FAILED, f"unexpected error: {e!r}")
            raise
        self._worker_waits = 0

    async def _launch(self, resolved: Resolved, no_repack: bool, attempt: str) -> None:
        settings = self._settings()
        if settings.port:
            check_port_free(settings.host, settings.port, "llama-server")
            port = settings.port
        else:
            port = free_port(settings.host)
        slot_dir = resolved.slot_dir or self._paths.slot_dir
        # Slot files hold prompts' token ids: owner-only, the folder and (by the umask
        # llama-server inherits, core.paths.PRIVATE_UMASK) every file it writes there.
        slot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:12]
        key = secrets.token_urlsafe(32)
        key_file = write_key_file(self._paths.state_dir, self.name, self.run_id, key)
        argv = build_argv(
            settings,
            LaunchInputs(
                binary=resolved.binary.path,
                model=resolved.model.path,
                port=port,
                slot_dir=slot_dir,
                no_repack=no_repack,
                plan_args=resolved.plan_args,
                api_key_file=key_file,
            ),
        )
        self.argv = argv
        self.port = port
        self.no_repack_active = no_repack
        env = resolved.binary.launch_env()
        cors = {CORS_ENV[0]: f"http://{settings.host}:{port}", CORS_ENV[1]: "0"}
        for name, value in cors.items():
            env.setdefault(name, value)  # the user's own environment wins
        if any(flag in settings.extra_args for flag in KEY_FLAGS):
            # llama-server adds every key it is given to one list (common/arg.cpp,
            # --api-key and --api-key-file): theirs opens the port too, Warmslot's still
            # works, and the check after the health poll would say if it did not.
            log.warning(
                "server.extra_args hold an API key of your own: it also opens llama-server's port"
            )
        cors_note = " ".join(f"{k}={env[k]}" for k in CORS_ENV)
        # As a shell line: the environment it adds, then the argv.
        self.output.run_started(
            f"==== warmslot: launching run {self.run_id}: {cors_note} {' '.join(argv)}"
        )
        log.info("launching llama-server: %s %s", cors_note, " ".join(argv))
        try:
            proc = await process.spawn(argv, env=env)
        except BaseException:
            remove(key_file)
            raise
        self._api_key = key
        self._proc = proc
        self.pid = proc.pid
        self._started_at = self._clock()
        self._emit(
            ServerLaunched(
                run_id=self.run_id,
                pid=proc.pid,
                port=port,
                argv=tuple(argv),
                binary=str(resolved.binary.path),
                binary_version=resolved.binary.version,
                model=str(resolved.model.path),
                attempt=attempt,
            )
        )
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        base = f"http://{settings.host}:{port}"
        pump = asyncio.create_task(self.output.pump(proc))
        healthy = asyncio.create_task(
            health.poll_health(self._http, f"{base}/health", self.auth_headers())
        )
        exited = asyncio.create_task(wait_exited(proc))
        try:
            done, _ = await asyncio.wait(
                {healthy, exited},
                timeout=settings.start_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            healthy.cancel()
            # Read at startup, before the port opens: healthy or gone, it is no longer needed.
            remove(key_file)
        refused = ""
        if healthy in done and not exited.done():
            refused = await health.key_refused(self._http, f"{base}/props", self.auth_headers())
        if healthy in done and not exited.done() and not refused:
            exited.cancel()
            self._watch_task = asyncio.create_task(self._watch(proc, pump, self.run_id))
            self._stuck = ""
            self._progress_task = asyncio.create_task(self._check_progress(proc, f"{base}/metrics"))
            self._set_state(ServerState.READY, f"healthy on port {port}")
            return
        # It exited, never became healthy, or refused Warmslot's key.
        if refused:
            exited.cancel()
            await self._kill_group(proc)
            reason = refused
        elif not exited.done():
            exited.cancel()
            await self._kill_group(proc)
            reason = f"not healthy after {settings.start_timeout_s:.0f} s"
        else:
            await pump  # its last lines hold the reason: read them all first
            reason = logparse.failure_reason(list(self.output.tail)[-40:])
        await pump
        code = proc.returncode
        sig = -code if code is not None and code < 0 else None
        self._api_key = None
        self._record_exit(proc, "start_failed", "startup", code)
        err = ServerStartFailed(
            f"llama-server failed to start: {reason}"
            + (f" (exit code {code})" if code is not None and sig is None else "")
            + (f" (killed by signal {signal.Signals(sig).name})" if sig else ""),
            hint=f"see the server log: {self._log_path}",
        )
        if sig is not None and sig in CRASH_SIGNALS:
            err.crash_signal = sig  # type: ignore[attr-defined]
        raise err

    async def _check_progress(self, proc: asyncio.subprocess.Process, url: str) -> None:
        """Kill the ready server when its main loop stops answering ``/metrics`` for
        `PROGRESS_TIMEOUT_S` (`health.wait_stalled`); the watch then restarts it."""
        assert self._http is not None

        def current() -> bool:
            return proc.returncode is None and self._proc is proc and not self._stop_requested

        stalled = await health.wait_stalled(
            self._http,
            url,
            self.auth_headers,
            every_s=self._progress_every_s,
            timeout_s=self._progress_timeout_s,
            current=current,
        )
        if not stalled:
            return
        self._stuck = (
            f"no progress: GET /metrics unanswered for {self._progress_timeout_s:.0f} s "
            "while /health answers"
        )
        log.warning("llama-server makes %s; killing it to restart it", self._stuck)
        process.kill_group(proc.pid)

    async def _watch(
        self, proc: asyncio.subprocess.Process, pump: asyncio.Task[None], run_id: str
    ) -> None:
        code = await wait_exited(proc)
        await pump
        if self._progress_task is not None:
            self._progress_task.cancel()
        if self._stop_requested or run_id != self.run_id:
            return
        sig = -code if code < 0 else None
        ran_for = self._clock() - self._started_at
        stuck, self._stuck = self._stuck, ""
        self._record_exit(
            proc, "crashed", "supervisor (no progress)" if stuck else "nobody (crash)", code
        )
        if ran_for >= HEALTHY_RESET_S:
            self.restarts = 0
            self._failed_retries = 0
        settings = self._settings()
        what = stuck or (f"signal {signal.Signals(sig).name}" if sig else f"exit code {code}")
        if lost := rpc.rpc_failure(self.output.run_lines()):
            # llama-server does not say which worker: the restart checks them and names it.
            # The worker's loss is the cause, not the request that ran into it: that one
            # is served again once the server is back without the worker.
            what += f", an RPC worker stopped answering: {lost}"
            self.quarantine.excused()
        else:
            self._quarantine(what)
        if self.restarts >= settings.max_restarts:
            self._give_up(f"crashed ({what}); gave up after {self.restarts} restarts")
            return
        delay = min(0.5 * (2**self.restarts), settings.backoff_max_s)
        self.restarts += 1
        self._set_state(
            ServerState.STARTING, f"crashed ({what}); restart {self.restarts} in {delay:.1f} s"
        )
        self._restart_task = asyncio.create_task(self._restart_after(delay))

    def _quarantine(self, what: str) -> None:
        """Tell the quarantine the server died; say which request it now refuses."""
        for hit in self.quarantine.crashed(what):
            text = hit.text()
            log.warning("%s", text)
            self._emit(
                Notice(
                    level="warning",
                    text=text,
                    hint="the client that sent it gets a 422 saying so; every other request "
                    "is served",
                )
            )

    def _give_up(self, reason: str) -> None:
        """``failed`` after the restarts ran out, with a start scheduled after a longer
        wait (doubling, at most `FAILED_RETRY_MAX_S`): never failed for good."""
        delay = min(FAILED_RETRY_S * (2**self._failed_retries), FAILED_RETRY_MAX_S)
        self._failed_retries += 1
        self._set_state(
            ServerState.FAILED, f"{reason}; trying again in {delay:.0f} s (or restart it now)"
        )
        self._restart_task = asyncio.create_task(self._retry_failed(delay))

    async def _retry_failed(self, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._lock:
            if self._stop_requested or self.state is not ServerState.FAILED:
                return  # stopped, or restarted by the user meanwhile
            self.restarts = 0
            try:
                await self._start_locked("supervisor (retry after failing)", attempt="restart")
            except WarmslotError as e:
                self._give_up(f"the retry failed too: {e}")

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._lock:
            if self._stop_requested or self.state is not ServerState.STARTING:
                return
            with contextlib.suppress(WarmslotError):
                await self._start_locked("supervisor (crash restart)", attempt="restart")
            if not self._failed():
                return
            if self.restarts < self._settings().max_restarts:
                # A failed restart counts as another crash: keep backing off.
                delay = min(0.5 * (2**self.restarts), self._settings().backoff_max_s)
                self.restarts += 1
                self._set_state(ServerState.STARTING, f"restart failed; retry in {delay:.1f} s")
                self._restart_task = asyncio.create_task(self._restart_after(delay))
            else:
                self._give_up(f"{self.state_reason}; gave up after {self.restarts} restarts")

    def _record_exit(
        self, proc: asyncio.subprocess.Process, outcome: str, requested_by: str, code: int | None
    ) -> None:
        last = tuple(list(self.output.tail)[-20:])
        event = self.exits.record(self.run_id, proc.pid, outcome, requested_by, code, last)
        self.pid = None
        self._emit(event)

    async def _kill_group(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        if await process.stop_group(proc, STOP_GRACE_S):
            log.warning(
                "llama-server did not stop within %.0f s of being asked; killed its group",
                STOP_GRACE_S,
            )

    async def _stop_locked(self, requested_by: str) -> None:
        self._stop_requested = True
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None
        proc = self._proc
        if proc is None or proc.returncode is not None:
            if self.state is not ServerState.STOPPED:
                self._set_state(ServerState.STOPPED, f"stopped by {requested_by}")
            return
        self._set_state(ServerState.STOPPING, f"requested by {requested_by}")
        await self._kill_group(proc)
        if self._watch_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None
        self._record_exit(proc, "requested", requested_by, proc.returncode)
        self._proc = None
        self._api_key = None
        self._set_state(ServerState.STOPPED, f"stopped by {requested_by}")
