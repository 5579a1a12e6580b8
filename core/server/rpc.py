"""llama.cpp RPC workers: finding ``ggml-rpc-server``, checking workers, naming the lost one.

A worker is a machine running ``ggml-rpc-server`` (`warmslot worker`); the main host's
llama-server reaches it with ``--rpc host:port,…`` and places model layers on its
devices. llama.cpp's RPC protocol has **no authentication**: anyone who can reach the
port can run computations and read what is in the worker's buffers (docs/scale.md).

A worker is checked before every launch (`check_workers`): a TCP connect first (fast,
and it tells "unreachable" apart from everything else), then
``llama-server --rpc host:port --list-devices``, which runs the protocol's own
handshake (so a version mismatch shows here, not at load time) and prints each
device with its total and free memory. One llama-server per worker, so an answer
names the worker it came from.

What llama-server does when a worker goes away (measured, docs/scale.md): every
RPC call that fails aborts the process (``GGML_ABORT``, SIGABRT) with "Remote RPC
server crashed or returned malformed response" — a message that does not say which
worker. So the launch after such a crash checks the workers again and names the ones
that no longer answer (`core.server.rpc_fit.launch_plan`), and `watch_in_use` finds a
lost worker of an idle server before a request does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.config import WorkerSettings
from core.errors import WarmslotError
from core.status.server import WorkerCheckRow, WorkerRow, WorkersStatus

__all__ = [
    "RPC_SERVER_NAME",
    "RemoteDevice",
    "WorkerCheck",
    "WorkerSet",
    "WorkerUnavailable",
    "check_worker",
    "check_workers",
    "find_rpc_server",
    "parse_devices",
    "rpc_failure",
    "tcp_problem",
    "watch_in_use",
    "worker_lines",
]

log = logging.getLogger("warmslot.rpc")

RPC_SERVER_NAME = "ggml-rpc-server" + (".exe" if os.name == "nt" else "")
MIB = 1 << 20
# "  RPC0: 127.0.0.1:50052 (15934 MiB, 12044 MiB free)" (ggml-rpc.cpp and common's
# device list print the same shape).
_DEVICE_LINE = re.compile(
    r"^\s*(?P<name>[^\s:]+):\s*(?P<desc>.*?)\s*\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)
# What llama-server prints when an RPC connection fails (ggml/src/ggml-rpc/ggml-rpc.cpp).
_RPC_FAILURES = (
    "Remote RPC server crashed or returned malformed response",
    "Failed to connect to",
    "RPC handshake failed",
    "RPC server version mismatch",
)


class WorkerUnavailable(WarmslotError):
    """A worker the model needs does not answer; the launch waits for it."""

    def __init__(self, message: str, *, workers: Sequence[str], hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.workers = tuple(workers)


@dataclass(frozen=True)
class RemoteDevice:
    """One device a worker offers, numbered as llama-server numbers them (``RPC0`` …)."""

    name: str
    endpoint: str
    worker: str  # the worker's label
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class WorkerCheck:
    """One worker's answer: its devices, or why there is none."""

    worker: WorkerSettings
    ok: bool
    problem: str = ""
    devices: tuple[RemoteDevice, ...] = ()
    elapsed_ms: float = 0.0
    checked_at: float = field(default_factory=time.time)

    def to_dict(self) -> WorkerCheckRow:
        """JSON-able form for status and doctor."""
        return {
            "name": self.worker.name,
            "endpoint": self.worker.endpoint,
            "label": self.worker.label,
            "ok": self.ok,
            "problem": self.problem,
            "devices": [
                {
                    "name": d.name,
                    "endpoint": d.endpoint,
                    "worker": d.worker,
                    "total_bytes": d.total_bytes,
                    "free_bytes": d.free_bytes,
                }
                for d in self.devices
            ],
            "elapsed_ms": round(self.elapsed_ms, 1),
            "checked_at": self.checked_at,
        }

    def summary(self) -> str:
        """One line: the worker and its devices, or its problem."""
        if not self.ok:
            return f"{self.worker.label}: ✘ {self.problem}"
        devs = ", ".join(
            f"{d.name} {d.free_bytes / (1 << 30):.1f} GiB free of {d.total_bytes / (1 << 30):.1f}"
            for d in self.devices
        )
        return f"{self.worker.label}: ✔ {devs} ({self.elapsed_ms:.0f} ms)"


def find_rpc_server(llama_server: Path | None, *, path_env: str | None = None) -> Path | None:
    """``ggml-rpc-server`` beside `llama_server` (a build with -DGGML_RPC=ON puts both in
    one folder; the RPC protocol must match on both ends, so the neighbour is the right
    one), else on PATH; None when there is none."""
    if llama_server is not None:
        beside = llama_server.parent / RPC_SERVER_NAME
        if beside.is_file() and os.access(beside, os.X_OK):
            return beside
    import shutil

    found = shutil.which(RPC_SERVER_NAME, path=path_env)
    return Path(found) if found else None


def tcp_problem(address: str, port: int, timeout: float) -> str:
    """ "" when a TCP connection to the worker opens; else what went wrong, in words."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer within {timeout:.0f} s (a firewall, or the machine is off)"
    except ConnectionRefusedError:
        return "connection refused: is `warmslot worker` (ggml-rpc-server) running there?"
    except socket.gaierror as e:
        return f"unknown host ({e.strerror})"
    except OSError as e:
        return e.strerror or repr(e)


def parse_devices(text: str, endpoint: str) -> list[tuple[str, int, int]]:
    """``(name, total bytes, free bytes)`` of each device of `endpoint` in the output of
    ``llama-server --rpc … --list-devices`` (local devices are left out)."""
    out = []
    for line in text.splitlines():
        m = _DEVICE_LINE.match(line)
        if m and m.group("desc") == endpoint:
            out.append((m.group("name"), int(m.group("total")) * MIB, int(m.group("free")) * MIB))
    return out


def rpc_failure(lines: Sequence[str]) -> str:
    """The line of llama-server's output that says an RPC connection failed ("" if none)."""
    for line in reversed(lines):
        if any(marker in line for marker in _RPC_FAILURES):
            return line.strip()
    return ""


def check_worker(
    binary: Path,
    worker: WorkerSettings,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> WorkerCheck:
    """Whether `worker` answers, and its devices (named ``RPC0`` …, renumbered by the
    caller when there are several workers)."""
    started = time.monotonic()

    def done(ok: bool, problem: str = "", devices: Sequence[RemoteDevice] = ()) -> WorkerCheck:
        ms = (time.monotonic() - started) * 1000
        return WorkerCheck(worker, ok, problem, tuple(devices), ms)

    problem = tcp_problem(worker.address, worker.port, min(timeout, 5.0))
    if problem:
        return done(False, problem)
    try:
        # --rpc first: llama-server acts on --list-devices as soon as it parses it.
        proc = subprocess.run(
            [str(binary), "--rpc", worker.endpoint, "--list-devices"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return done(False, f"the RPC handshake did not finish within {timeout:.0f} s")
    except OSError as e:
        return done(False, f"cannot run {binary.name}: {e.strerror or e!r}")
    text = proc.stdout + proc.stderr
    found = parse_devices(text, worker.endpoint)
    if proc.returncode != 0 or not found:
        why = rpc_failure(text.splitlines()) or (text.strip().splitlines() or ["no output"])[-1]
        if "--rpc" in text and "invalid argument" in text:
            why = f"{binary.name} was built without RPC support (-DGGML_RPC=ON)"
        return done(False, why)
    devices = [RemoteDevice(n, worker.endpoint, worker.label, t, f) for n, t, f in found]
    return done(True, devices=devices)


def check_workers(
    binary: Path,
    workers: Sequence[WorkerSettings],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> list[WorkerCheck]:
    """Check every worker at once; devices are renumbered ``RPC0`` … in the order of
    `workers` (llama-server numbers them in ``--rpc`` order, all before local GPUs)."""
    if not workers:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(workers))) as pool:
        checks = list(
            pool.map(lambda w: check_worker(binary, w, env=env, timeout=timeout), workers)
        )
    out, n = [], 0
    for c in checks:
        devices = []
        for d in c.devices:
            devices.append(
                RemoteDevice(f"RPC{n}", d.endpoint, d.worker, d.total_bytes, d.free_bytes)
            )
            n += 1
        out.append(
            WorkerCheck(c.worker, c.ok, c.problem, tuple(devices), c.elapsed_ms, c.checked_at)
        )
    return out


class WorkerSet:
    """The configured workers, their last checks, and which ones a launch left out.

    Thread-safe: checks run off the core's loop, status reads them from anywhere.
    """

    def __init__(
        self,
        workers: Callable[[], Sequence[WorkerSettings]],
        *,
        check: Callable[..., list[WorkerCheck]] = check_workers,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self._workers = workers
        self._check = check
        self._notify = notify  # a warning for the user: a worker lost or back
        self._lock = threading.Lock()
        self._checks: list[WorkerCheck] = []
        self._lost: dict[str, str] = {}  # endpoint → why it was left out / waited for
        self.waiting_for: tuple[str, ...] = ()  # labels the launch is waiting for
        self.in_use: tuple[str, ...] = ()  # endpoints of the running launch's --rpc

    @property
    def configured(self) -> bool:
        """Whether any worker is configured."""
        return bool(self._workers())

    def check(self, binary: Path, env: Mapping[str, str] | None = None) -> list[WorkerCheck]:
        """Check every configured worker now (blocking: call off the loop)."""
        checks = self._check(binary, list(self._workers()), env=env)
        with self._lock:
            self._checks = list(checks)
        for c in checks:
            log.log(logging.INFO if c.ok else logging.WARNING, "worker %s", c.summary())
        return checks

    def mark(
        self, *, in_use: Sequence[str], lost: Mapping[str, str], waiting: Sequence[str]
    ) -> None:
        """Record what a launch decided: the endpoints it uses, the ones it left out
        (with why) and the workers it waits for."""
        with self._lock:
            before, checks = set(self.in_use), {c.worker.endpoint: c for c in self._checks}
            self.in_use = tuple(in_use)
            self._lost = dict(lost)
            self.waiting_for = tuple(waiting)
        for endpoint in sorted(before - set(in_use)):
            c = checks.get(endpoint)
            label = c.worker.label if c is not None else endpoint
            if waiting:
                text = f"worker {label} stopped answering: waiting for it"
            else:
                why = lost.get(endpoint, "")
                text = f"worker {label} left out of the launch ({why}): running without it"
            log.warning(text)
            if self._notify is not None:
                self._notify(text)

    def unreachable_in_use(self, timeout: float = 2.0) -> list[str]:
        """The in-use workers a TCP connection no longer reaches, with why (blocking)."""
        with self._lock:
            used = set(self.in_use)
        out = []
        for w in self._workers():
            if w.endpoint in used and (problem := tcp_problem(w.address, w.port, timeout)):
                out.append(f"{w.label}: {problem}")
        return out

    def snapshot(self) -> WorkersStatus:
        """State for status displays and the tray: each worker's last check and role."""
        with self._lock:
            checks = {c.worker.endpoint: c for c in self._checks}
            lost, in_use, waiting = dict(self._lost), set(self.in_use), self.waiting_for
        rows: list[WorkerRow] = []
        for w in self._workers():
            c = checks.get(w.endpoint)
            if w.endpoint in in_use:
                state = "in use"
            elif w.label in waiting:
                state = "waiting"
            elif w.endpoint in lost:
                # Left out because it is not needed (the model fits without it) is no loss.
                state = "not needed" if lost[w.endpoint].startswith("not needed") else "left out"
            elif c is not None and c.ok:
                state = "available"
            else:
                state = "unchecked" if c is None else "unreachable"
            note = lost.get(w.endpoint, "")
            row: WorkerRow = {
                "label": w.label,
                "endpoint": w.endpoint,
                "state": state,
                "note": note,
            }
            if c is not None:
                row = {**c.to_dict(), "state": state, "note": note}
            rows.append(row)
        return {"workers": rows, "waiting_for": list(waiting)}


WATCH_INTERVAL_S = 5.0


async def watch_in_use(
    workers: WorkerSet,
    ready: Callable[[], bool],
    restart: Callable[[str], Awaitable[None]],
    *,
    interval: float = WATCH_INTERVAL_S,
) -> None:
    """Every `interval` seconds while the server is ready, try a TCP connection to each
    worker it uses; when one fails, `restart` it (the launch then leaves the worker out
    or waits for it). An idle llama-server does not notice a lost worker (measured:
    /health stays 200) and aborts only at the next request, which then fails; this
    finds most losses before a request does."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        if not ready() or not workers.in_use:
            continue
        gone = await loop.run_in_executor(None, workers.unreachable_in_use)
        if gone and ready():
            await restart("worker " + "; ".join(gone))


def worker_lines(snapshot: WorkersStatus) -> list[str]:
    """Status lines for the workers (`warmslot status`)."""
    rows = snapshot["workers"]
    if not rows:
        return []
    lines = ["workers (llama.cpp RPC):"]
    for r in rows:
        devs = ", ".join(
            f"{d['name']} {d['free_bytes'] / (1 << 30):.1f} GiB free"
            for d in r.get("devices") or []
        )
        extra = r["note"] or r.get("problem") or devs
        lines.append(f"  {r['label']:<32} {r['state']:<12} {extra}")
    if snapshot["waiting_for"]:
        lines.append("  waiting for: " + ", ".join(snapshot["waiting_for"]))
    return lines
