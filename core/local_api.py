"""Reaching the running Warmslot (`warmslot serve` or the tray's core) from the CLI.

Its runtime file names the proxy's address, its pid and whether it runs or is stopping;
the running core writes it (`RuntimeFile`), everything else reads it here.
`local_request` builds a GET of the running instance (`warmslot status`, `explain`): a
wildcard bind is asked on loopback, and the request carries the key the CLI may use
(core.keys: the per-start local key or proxy.api_key) so a Warmslot that requires keys
still answers its own user. `running_instance` and `wait_for_exit` let a new start wait
for an instance that is still stopping (saving sessions, finishing requests) instead of
failing on its port.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from core import config as config_mod
from core.config.keys import client_key
from core.paths import Paths

RUNNING = "running"
STOPPING = "stopping"
# How long a new start waits for an instance that is still stopping: its stages take up
# to about two minutes (requests under way, the cache's saves, llama-server's stop).
STOPPING_WAIT_S = 180.0
# A process whose start lies this much after the runtime file's "started" is not the one
# that wrote it (its pid was reused after a crash); the slack covers clock rounding.
_START_SLACK_S = 2.0


@dataclass(frozen=True)
class Instance:
    """The Warmslot the runtime file names, its process alive."""

    pid: int
    host: str
    port: int
    state: str  # RUNNING or STOPPING
    started: float  # when its core started (epoch seconds)

    @property
    def stopping(self) -> bool:
        return self.state == STOPPING


class RuntimeFile:
    """The runtime file as the running core writes it: where this instance listens,
    and whether it runs or is stopping. Only a file this object wrote is rewritten or
    removed — never another instance's (a start that found its port taken)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data: dict[str, object] = {}

    @property
    def written(self) -> bool:
        return bool(self._data)

    def write(self, host: str, port: int, started: float) -> None:
        """Say that this instance runs, listening on `host`:`port`; raises OSError."""
        data = {"pid": os.getpid(), "proxy_host": host, "proxy_port": port, "started": started}
        self._put({**data, "state": RUNNING})

    def mark_stopping(self) -> None:
        """Say that this instance is stopping: a `warmslot serve` started now waits for
        it to exit instead of failing on its port."""
        if self._data:
            with contextlib.suppress(OSError):
                self._put({**self._data, "state": STOPPING})

    def _put(self, data: dict[str, object]) -> None:
        tmp = self.path.with_suffix(".tmp")  # whole or not at all: a reader never sees half
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)
        self._data = data

    def remove(self) -> None:
        """Remove it at the end of the run, if this object wrote it."""
        if self._data:
            self._data = {}
            with contextlib.suppress(OSError):
                self.path.unlink()


def _read(paths: Paths) -> Instance | None:
    try:
        runtime = json.loads(paths.runtime_file.read_text())
        return Instance(
            pid=int(runtime.get("pid", 0)),
            host=str(runtime.get("proxy_host", "127.0.0.1")),
            port=int(runtime["proxy_port"]),
            state=str(runtime.get("state", RUNNING)),
            started=float(runtime.get("started", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def alive(inst: Instance) -> bool:
    """Whether the process that wrote `inst` still runs (a zombie has exited)."""
    if inst.pid <= 0:
        return False
    try:
        proc = psutil.Process(inst.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not inst.started or proc.create_time() <= inst.started + _START_SLACK_S
    except psutil.Error:
        return False


def running_instance(paths: Paths) -> Instance | None:
    """The instance running (or stopping) on these folders; None when none does: no
    runtime file, an unreadable one, or one whose process is gone (left by a crash)."""
    inst = _read(paths)
    return inst if inst is not None and alive(inst) else None


def wait_for_exit(inst: Instance, timeout: float, *, interval: float = 0.1) -> bool:
    """Wait until the process of `inst` has exited; False when `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while alive(inst):
        if time.monotonic() >= deadline:
            return False
        tick.wait(interval)
    return True


def local_request(paths: Paths, path: str) -> urllib.request.Request | None:
    """A GET of `path` (e.g. ``/warmslot/status``) on the running instance, or None when
    none runs (no readable runtime file)."""
    runtime = _read(paths)
    if runtime is None:
        return None
    host = runtime.host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    req = urllib.request.Request(f"http://{host}:{runtime.port}{path}")
    settings = config_mod.load(paths.config_file)
    if key := client_key(paths.state_dir, settings.proxy.api_key):
        req.add_header("Authorization", f"Bearer {key}")
    return req
