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

While it runs, its output is always read (`_pump`), and every `PROGRESS_EVERY_S` it
must answer ``GET /metrics``, which its main loop serves — ``/health`` is answered by
the HTTP thread alone, also while the loop is stuck. No answer within
`PROGRESS_TIMEOUT_S` and it is killed and restarted like a crash. Each crash (or stuck
kill) tells the server's `CrashQuarantine` (`core.server.quarantine`), which refuses
the request that was in flight when it happened.

Each launch gets a new random API key that only Warmslot knows, so that nothing else
on the machine (another user's process, a web page that found the port) can use the
server behind Warmslot's back (docs/security.md#llama-servers-port). It travels in an
owner-only file (never on the command line, which ``ps`` shows to everyone) that is
deleted as soon as the server has read it; `auth_headers` and the `Upstream`'s
middleware send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import aiohttp

from core.config import ServerSettings
from core.errors import PortInUse, ServerStartFailed, WarmslotError
from core.events import (
    Event,
    LogLine,
    Notice,
    ServerExited,
    ServerLaunched,
    ServerStateChanged,
)
from core.machine import process
from core.paths import Paths
from core.server import logparse, rpc
from core.server.argv import LaunchInputs, build_argv
from core.server.discover import ServerBinary
from core.server.logfile import ServerLogFile
from core.server.model import ModelFile, short_name
from core.server.quarantine import CrashQuarantine, Quarantined
from core.status import ServerSnapshot

log = logging.getLogger("warmslot.server")

# Signals that mean "the process crashed" rather than "it was asked to stop" (by name:
# Windows has no SIGBUS, and this module must import there).
_CRASH_SIGNALS = {
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGILL", "SIGBUS", "SIGFPE", "SIGABRT")
    if hasattr(signal, name)
}
HEALTHY_RESET_S = 300.0  # a run this long resets the restart counter
LOG_TAIL_LINES = 2000
PUMP_CHUNK_BYTES = 64 * 1024  # llama-server's output is read this much at a time at most
STOP_GRACE_S = 10.0
# How often a ready server must prove that its main loop runs, and how long it may take.
# The loop answers between two batches, and one batch of a large prompt on a slow CPU,
# or a slot file of gigabytes written to disk, takes a while: well under this.
PROGRESS_EVERY_S = 15.0
PROGRESS_TIMEOUT_S = 120.0
# After the restarts ran out: the first wait before trying again, and the longest.
FAILED_RETRY_S = 60.0
FAILED_RETRY_MAX_S = 900.0
# Cross-origin reads of llama-server's answers: none. Set through the environment, which
# a build without these options ignores (an unknown flag would stop it starting); a
# ``--cors-*`` flag in the settings' extra args still wins (docs/security.md#llama-servers-port).
_CORS_ENV = ("LLAMA_ARG_CORS_ORIGINS", "LLAMA_ARG_CORS_CREDENTIALS")
_KEY_FLAGS = ("--api-key", "--api-key-file")


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


def free_port(host: str) -> int:
    """A port that is free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUse(
                f"{what} port {host}:{port} is already in use ({e.strerror})",
                hint="stop the other program or choose another port in settings",
            ) from e


async def _exited(proc: asyncio.subprocess.Process) -> int:
    """Wait for llama-server itself to exit; then kill what is left of its group.

    asyncio's ``wait()`` returns only once the process's pipes are closed, and a
    helper left in its process group can hold stdout open for ever: a crash would
    then go unnoticed and a stop would wait out its grace period. So watch the
    process's own exit status, kill the rest of the group (orphans by now), and
    only then collect the pipes.
    """
    await process.wait_exit(proc)
    process.kill_leftovers(proc.pid)
    return await proc.wait()


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _quarantine_text(hit: Quarantined) -> str:
    return (
        f"llama-server died ({hit.what}) while answering a request; the same request "
        f"(body sha256 {hit.digest[:16]}…) is refused for {(hit.until - hit.at) / 60:.0f} min"
    )


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
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.restarts = 0
        self.exits: deque[ServerExited] = deque(maxlen=50)
        self._ready_at = 0.0  # `_clock()` when it last became ready
        self.no_repack_active = False
        self._proc: asyncio.subprocess.Process | None = None
        self._stop_requested = False
        self._watch_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._ready = asyncio.Event()
        self._logfile = ServerLogFile(self._log_path)
        self._started_at = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._api_key: str | None = None
        self._worker_waits = 0  # checks in a row that found a needed RPC worker gone
        self._lines_total = 0  # output lines read, over all runs
        self._run_first_line = 0  # `_lines_total` when the current run was launched
        self._line_failures = 0  # output lines that could not be logged or emitted
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
        self._logfile.close()
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
            "binary": None
            if r is None
            else {
                "path": str(r.binary.path),
                "source": r.binary.source,
                "version": r.binary.version,
                "commit": r.binary.commit,
                "identity": r.binary.identity,
            },
            "model": None
            if r is None
            else {
                "path": str(r.model.path),
                "source": r.model.source,
                "size": r.model.size,
                "identity": r.model.identity,
                "name": short_name(r.model.path),
            },
            "exits": [
                {
                    "ts": e.ts,
                    "outcome": e.outcome,
                    "returncode": e.returncode,
                    "signal": e.signal,
                    "requested_by": e.requested_by,
                    "last_lines": list(e.last_lines[-5:]),
                }
                for e in self.exits
            ],
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

    def _quirks_file(self) -> Path:
        return self._paths.state_dir / "binary-quirks.json"

    def _quirks(self) -> dict[str, object]:
        try:
            data = json.loads(self._quirks_file().read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _remember_no_repack(self, identity: str, reason: str) -> None:
        quirks = self._quirks()
        quirks[identity] = {"no_repack": True, "reason": reason, "ts": time.time()}
        path = self._quirks_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(quirks, indent=1))
        tmp.replace(path)

    def _want_no_repack(self, binary: ServerBinary) -> bool:
        mode = self._settings().no_repack
        if mode == "on":
            return True
        if mode == "off":
            return False
        if binary.no_repack:  # its smoke start passed only with the flag
            return True
        entry = self._quirks().get(binary.identity)
        return bool(isinstance(entry, dict) and entry.get("no_repack"))

    async def _start_locked(self, requested_by: str, attempt: str) -> None:
        self._stop_requested = False
        self._set_state(ServerState.STARTING, f"requested by {requested_by}")
        try:
            resolved = await self._resolve()
            self.resolved = resolved
            no_repack = self._want_no_repack(resolved.binary)
            try:
                await self._launch(resolved, no_repack, attempt)
            except ServerStartFailed as e:
                crashed = getattr(e, "crash_signal", None)
                # An RPC worker that went away aborts the server too: not the AMX bug.
                rpc_lost = rpc.rpc_failure(self._run_lines())
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
                    self._remember_no_repack(resolved.binary.identity, reason)
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
        key_file = self._write_key(key)
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
        cors = {_CORS_ENV[0]: f"http://{settings.host}:{port}", _CORS_ENV[1]: "0"}
        for name, value in cors.items():
            env.setdefault(name, value)  # the user's own environment wins
        if any(flag in settings.extra_args for flag in _KEY_FLAGS):
            # llama-server adds every key it is given to one list (common/arg.cpp,
            # --api-key and --api-key-file): theirs opens the port too, Warmslot's still
            # works, and the check after the health poll would say if it did not.
            log.warning(
                "server.extra_args hold an API key of your own: it also opens llama-server's port"
            )
        cors_note = " ".join(f"{k}={env[k]}" for k in _CORS_ENV)
        # As a shell line: the environment it adds, then the argv. A log that cannot be
        # written (a full disk) does not stop the launch.
        with contextlib.suppress(OSError, ValueError):
            self._logfile.write(
                [f"==== warmslot: launching run {self.run_id}: {cors_note} {' '.join(argv)}"]
            )
        log.info("launching llama-server: %s %s", cors_note, " ".join(argv))
        try:
            proc = await process.spawn(argv, env=env)
        except BaseException:
            _remove(key_file)
            raise
        self._api_key = key
        self._proc = proc
        self._run_first_line = self._lines_total
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
        pump = asyncio.create_task(self._pump(proc))
        healthy = asyncio.create_task(self._poll_health(settings.host, port))
        exited = asyncio.create_task(_exited(proc))
        try:
            done, _ = await asyncio.wait(
                {healthy, exited},
                timeout=settings.start_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            healthy.cancel()
            # Read at startup, before the port opens: healthy or gone, it is no longer needed.
            _remove(key_file)
        refused = ""
        if healthy in done and not exited.done():
            refused = await self._key_refused(settings.host, port)
        if healthy in done and not exited.done() and not refused:
            exited.cancel()
            self._watch_task = asyncio.create_task(self._watch(proc, pump, self.run_id))
            self._stuck = ""
            self._progress_task = asyncio.create_task(
                self._check_progress(proc, f"http://{settings.host}:{port}/metrics")
            )
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
            reason = logparse.failure_reason(list(self.log_tail)[-40:])
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
        if sig is not None and sig in {int(s) for s in _CRASH_SIGNALS}:
            err.crash_signal = sig  # type: ignore[attr-defined]
        raise err

    def _run_lines(self) -> list[str]:
        """The current run's output (as much of it as the tail holds): an abort's backtrace
        can push its one telling line far up, and an older run's must not count."""
        n = min(self._lines_total - self._run_first_line, len(self.log_tail))
        return list(self.log_tail)[-n:] if n > 0 else []

    def _write_key(self, key: str) -> Path:
        """The key in a new owner-only file in an owner-only folder, for ``--api-key-file``."""
        run_dir = self._paths.state_dir / "run"
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.name != "nt":
            run_dir.chmod(0o700)  # it may predate this code, made with the default mode
        stem = "".join(c if c.isalnum() or c in "_-" else "_" for c in self.name) or "_primary"
        # Left over when Warmslot was killed while a server started: its key is dead.
        for old in run_dir.glob(f"{stem}.*.key"):
            _remove(old)
        path = run_dir / f"{stem}.{self.run_id}.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return path

    async def _key_refused(self, host: str, port: int) -> str:
        """Why the healthy server does not take Warmslot's key ("" when it does). `/health`
        is public, so this is the first request that proves the key works."""
        assert self._http is not None
        try:
            async with self._http.get(
                f"http://{host}:{port}/props", headers=self.auth_headers()
            ) as resp:
                if resp.status != 401:
                    return ""
        except (aiohttp.ClientError, TimeoutError, OSError):
            return ""  # not a refusal: the watch and the clients see a dead server
        return (
            "it refused Warmslot's API key (401); an --api-key option of an unusual kind "
            "in server.extra_args?"
        )

    async def _poll_health(self, host: str, port: int) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        url = f"http://{host}:{port}/health"
        delay = 0.05
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                # /health is public upstream; the key goes along in case a build gates it.
                async with self._http.get(url, headers=self.auth_headers()) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    async def _pump(self, proc: asyncio.subprocess.Process) -> None:
        """Read llama-server's output until it closes, whatever it holds.

        Read in chunks and cut into bounded lines (`logparse.LineSplitter`), never with
        ``readline``, whose 64 KiB limit one long line overruns; and a line that cannot
        be handled (a full disk under the log file, a failing subscriber) is skipped,
        never the rest: output nobody reads blocks llama-server in its logger
        (docs/llama-server-facts.md#a-long-log-line-wedged-the-server).
        """
        assert proc.stdout is not None
        splitter = logparse.LineSplitter()
        while True:
            try:
                chunk = await proc.stdout.read(PUMP_CHUNK_BYTES)
            except (OSError, ValueError):  # the pipe broke: nothing more to read
                chunk = b""
            self._take_lines(splitter.feed(chunk) if chunk else splitter.close())
            if not chunk:
                break

    def _take_lines(self, lines: list[str]) -> None:
        """Output lines into the tail, the log file (one write for all) and a `LogLine`
        event each. A line that cannot be handled is counted and skipped, never the rest."""
        if not lines:
            return
        self.log_tail.extend(lines)
        self._lines_total += len(lines)
        try:
            self._logfile.write(lines)
        except (OSError, ValueError):  # a full disk under the log: the events still go
            self._line_failed()
        for line in lines:
            try:
                parsed = logparse.parse_line(line)
                self._emit(
                    LogLine(level=parsed.level, area=parsed.area, text=parsed.text, raw=line)
                )
            except Exception:
                self._line_failed()

    def _line_failed(self) -> None:
        self._line_failures += 1
        if self._line_failures == 1:  # once: the next one would be as loud
            log.exception("could not handle a line of llama-server's output; reading on")

    async def _check_progress(self, proc: asyncio.subprocess.Process, url: str) -> None:
        """Ask the ready server for ``/metrics`` every `PROGRESS_EVERY_S`; kill it when
        no answer comes within `PROGRESS_TIMEOUT_S` (the watch then restarts it).

        ``/metrics`` is a task for llama-server's main loop, answered between two
        batches, so an answer proves the loop runs; ``/health`` does not (its HTTP
        thread answers it while the loop is stuck, e.g. blocked writing its log). Any
        answer counts, even an error status; a refused connection is a crash, which the
        watch sees. Off the request path: one small request at a time, from here.
        """
        assert self._http is not None
        timeout = aiohttp.ClientTimeout(total=self._progress_timeout_s)
        while True:
            await asyncio.sleep(self._progress_every_s)
            if proc.returncode is not None or self._proc is not proc:
                return
            try:
                async with self._http.get(url, headers=self.auth_headers(), timeout=timeout) as r:
                    await r.read()
                continue
            except TimeoutError:
                pass
            except (aiohttp.ClientError, OSError):
                continue
            if proc.returncode is not None or self._proc is not proc or self._stop_requested:
                return
            self._stuck = (
                f"no progress: GET /metrics unanswered for {self._progress_timeout_s:.0f} s "
                "while /health answers"
            )
            log.warning("llama-server makes %s; killing it to restart it", self._stuck)
            process.kill_group(proc.pid)
            return

    async def _watch(
        self, proc: asyncio.subprocess.Process, pump: asyncio.Task[None], run_id: str
    ) -> None:
        code = await _exited(proc)
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
        if lost := rpc.rpc_failure(self._run_lines()):
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
            text = _quarantine_text(hit)
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
        sig = -code if code is not None and code < 0 else None
        event = ServerExited(
            run_id=self.run_id,
            pid=proc.pid,
            returncode=code,
            signal=sig,
            outcome=outcome,
            requested_by=requested_by,
            last_lines=tuple(list(self.log_tail)[-20:]),
        )
        self.exits.append(event)
        self.pid = None
        log.log(
            logging.INFO if outcome == "requested" else logging.WARNING,
            "llama-server run %s exited: %s (code %s, signal %s, by %s)",
            self.run_id,
            outcome,
            code,
            sig,
            requested_by,
        )
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
