"""`warmslot worker`: run and supervise llama.cpp's ``ggml-rpc-server`` on a worker machine.

The main host's ``[[workers]]`` settings name this machine; its llama-server then
places model layers on this machine's devices over llama.cpp's RPC protocol. That
protocol has **no authentication and no encryption**: whoever reaches the port can
allocate memory, run graphs and read buffers. So the worker binds to 127.0.0.1
unless told otherwise, and says so loudly when it is (docs/scale.md#security).

``ggml-rpc-server`` is taken from beside the llama-server Warmslot would use (a build
with ``-DGGML_RPC=ON`` has both; both ends must speak the same protocol version), else
from PATH. A crash restarts it after 0.5 s, doubling to 30 s (reset after a minute of
running); SIGINT/SIGTERM stop it and its group, and it dies with this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from core import config as config_mod
from core.config.checks import is_loopback
from core.errors import BinaryNotFound
from core.machine import process
from core.paths import Paths
from core.server.rpc import RPC_SERVER_NAME, find_rpc_server

__all__ = ["WorkerRunner", "cmd_worker", "register", "worker_argv"]

log = logging.getLogger("warmslot.worker")

DEFAULT_PORT = 50052  # ggml-rpc-server's own default
HEALTHY_RESET_S = 60.0
BACKOFF_MAX_S = 30.0
STOP_GRACE_S = 5.0
SECURITY_WARNING = (
    "warning: ggml-rpc-server is reachable from the network on {host}:{port}. llama.cpp's "
    "RPC protocol has NO authentication and NO encryption: anyone who can reach this port "
    "can run computations on this machine and read the model and prompts in its memory. "
    "Use it only on a network you trust (a LAN you control, a VPN such as WireGuard or "
    "Tailscale), never on the internet (docs/scale.md#security)."
)


def worker_argv(
    binary: Path,
    host: str,
    port: int,
    *,
    cache: bool = False,
    threads: int = 0,
    devices: str = "",
) -> list[str]:
    """The ggml-rpc-server command line."""
    argv = [str(binary), "-H", host, "-p", str(port)]
    if cache:
        argv.append("-c")  # keeps large tensors on local disk: a restart reloads faster
    if threads > 0:
        argv += ["-t", str(threads)]
    if devices:
        argv += ["-d", devices]
    return argv


class WorkerRunner:
    """Runs `argv` until `stop()`; restarts it with backoff when it exits on its own."""

    def __init__(self, argv: list[str], *, out: TextIO | None = None) -> None:
        self.argv = argv
        self.restarts = 0
        self.pid: int | None = None
        self._stop = asyncio.Event()
        self._out: TextIO = out if out is not None else sys.stderr

    def stop(self) -> None:
        """Ask the runner to stop its server and return (safe from a signal handler)."""
        self._stop.set()

    def _say(self, text: str) -> None:
        print(f"warmslot worker: {text}", file=self._out, flush=True)

    async def run(self) -> int:
        """Run until stopped; 0 on a requested stop."""
        delay = 0.5
        while not self._stop.is_set():
            started = time.monotonic()
            proc = await process.spawn(self.argv)
            self.pid = proc.pid
            self._say(f"started {' '.join(self.argv)} (pid {proc.pid})")
            pump = asyncio.create_task(self._pump(proc))
            exited = asyncio.create_task(process.wait_exit(proc))
            stopping = asyncio.create_task(self._stop.wait())
            await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if self._stop.is_set() and not exited.done():
                exited.cancel()
                await process.stop_group(proc, STOP_GRACE_S)
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
                self._say("stopped")
                return 0
            stopping.cancel()
            process.kill_leftovers(proc.pid)
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            code = proc.returncode
            self.pid = None
            if self._stop.is_set():
                return 0
            if time.monotonic() - started >= HEALTHY_RESET_S:
                delay = 0.5
            self.restarts += 1
            self._say(
                f"ggml-rpc-server exited (code {code}); restart {self.restarts} in {delay:.1f} s"
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
        return 0

    async def _pump(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while raw := await proc.stdout.readline():
            line = raw.decode("utf-8", errors="replace").rstrip()
            print(f"  | {line}", file=self._out, flush=True)


def _rpc_binary(args: argparse.Namespace, paths: Paths) -> Path:
    if args.binary:
        return Path(args.binary).expanduser()
    from core.server import discover

    settings = config_mod.load(paths.config_file)
    found = discover.discover(paths, settings.server.binary).found
    binary = find_rpc_server(found.path if found else None)
    if binary is None:
        raise BinaryNotFound(
            f"no {RPC_SERVER_NAME} found"
            + (f" beside {found.path}" if found else "")
            + " or on PATH",
            hint="build llama.cpp with -DGGML_RPC=ON (Warmslot's own build does), or pass "
            "--binary PATH",
        )
    return binary


def _check_help(binary: Path) -> None:
    """Fail early, with the binary named, when it does not run here."""
    try:
        subprocess.run([str(binary), "--help"], capture_output=True, timeout=20, check=False)
    except OSError as e:
        raise BinaryNotFound(f"{binary} does not run here: {e.strerror or e!r}") from e


def cmd_worker(args: argparse.Namespace) -> int:
    """Run ggml-rpc-server in the foreground until Ctrl-C or SIGTERM."""
    paths = Paths.default(getattr(args, "dev_dir", None))
    host = args.host
    if host != "localhost":
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            print(f"warmslot worker: --host {host!r}: expected an IPv4 address", file=sys.stderr)
            return 2
    if not 1 <= args.port <= 65535:
        print(f"warmslot worker: --port {args.port}: expected 1-65535", file=sys.stderr)
        return 2
    binary = _rpc_binary(args, paths)
    _check_help(binary)
    if not is_loopback(host):
        print(SECURITY_WARNING.format(host=host, port=args.port), file=sys.stderr, flush=True)
    argv = worker_argv(
        binary, host, args.port, cache=args.cache, threads=args.threads, devices=args.device
    )
    print(
        f"warmslot worker: on the main host, add to its settings:\n"
        f'  [[workers]]\n  address = "{"THIS-MACHINE" if is_loopback(host) else host}"\n'
        f"  port = {args.port}",
        file=sys.stderr,
        flush=True,
    )

    async def main() -> int:
        runner = WorkerRunner(argv)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # Windows: Ctrl-C raises instead
                loop.add_signal_handler(sig, runner.stop)
        return await runner.run()

    return asyncio.run(main())


def register(subparsers: Any) -> None:
    """Add the `worker` subcommand to the main CLI."""
    p = subparsers.add_parser(
        "worker",
        help="run llama.cpp's ggml-rpc-server here, so a main host can place model layers "
        "on this machine (no authentication: trusted networks only)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; another one exposes the worker to the "
        "network: trusted networks only)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 50052)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: its own)")
    p.add_argument("--device", default="", help="devices to offer, comma-separated (-d)")
    p.add_argument("--cache", action="store_true", help="keep large tensors in a local cache (-c)")
    p.add_argument("--binary", help="the ggml-rpc-server to run (default: beside llama-server)")
    p.set_defaults(func=cmd_worker)
