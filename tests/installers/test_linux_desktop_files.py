"""Fast checks of the Linux integration files and install.sh / uninstall.sh.

The templates in resources/linux/ and the files install.sh writes from them
must pass `desktop-file-validate` (desktop-file-utils) and `systemd-analyze
verify` (systemd); those checks skip, saying why, where the tools are missing.
install.sh and uninstall.sh run against a fake bundle (two stub executables and
a copy of resources/) under a temporary HOME, so nothing here needs a build.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINUX = REPO / "installers" / "linux"
TEMPLATES = REPO / "resources" / "linux"
DESKTOP_FILES = ("warmslot.desktop", "warmslot-autostart.desktop")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the Linux installer files are checked on Linux"
)


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        package = {"desktop-file-validate": "desktop-file-utils", "systemd-analyze": "systemd"}
        pytest.skip(f"{tool} is not installed (apt-get install {package.get(tool, tool)})")
    return path


def desktop_validate(path: Path) -> None:
    proc = subprocess.run(
        [need("desktop-file-validate"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Hints are advice; errors and warnings fail.
    problems = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "error:" in line or "warning:" in line
    ]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def unit_verify(path: Path, runtime_dir: Path) -> None:
    """`systemd-analyze --user verify`: exit 0 is not enough, it only warns on bad keys."""
    tool = need("systemd-analyze")
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}
    proc = subprocess.run(
        [tool, "--user", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Failed to initialize manager" in out:
        pytest.skip(f"systemd-analyze cannot run here: {out.strip().splitlines()[-1]}")
    mentions = [line for line in out.splitlines() if path.name in line or str(path) in line]
    assert proc.returncode == 0 and not mentions, out


def desktop_entry(path: Path) -> dict[str, str]:
    entry: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            entry[key] = value
    return entry


# ------------------------------------------------------------------ templates
@pytest.mark.parametrize("name", DESKTOP_FILES)
def test_desktop_templates_validate(name: str) -> None:
    desktop_validate(TEMPLATES / name)


def test_unit_template_is_a_restarting_user_service() -> None:
    text = (TEMPLATES / "warmslot.service").read_text()
    lines = {line.strip() for line in text.splitlines()}
    assert "Restart=on-failure" in lines
    assert "WantedBy=default.target" in lines
    assert any(line.startswith("ExecStart=") and line.endswith(" serve") for line in lines)
    assert not any(line.startswith(("User=", "Group=")) for line in lines)  # a --user unit


def test_unit_template_verifies(tmp_path: Path) -> None:
    # ExecStart must name an executable for `verify`: point it at a stub.
    stub = make_stub(tmp_path / "bin" / "warmslot")
    unit = tmp_path / "warmslot.service"
    unit.write_text(
        (TEMPLATES / "warmslot.service")
        .read_text()
        .replace("ExecStart=/usr/bin/warmslot ", f"ExecStart={stub} ")
    )
    unit_verify(unit, tmp_path / "run")


# ------------------------------------------------------------------ install / uninstall
def make_stub(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_bundle(base: Path) -> Path:
    """A folder shaped like dist/warmslot/ with stub programs."""
    bundle = base / "bundle" / "warmslot"
    make_stub(bundle / "warmslot")
    make_stub(bundle / "warmslot-tray")
    shutil.copytree(
        REPO / "resources",
        bundle / "_internal" / "resources",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (bundle / "VERSION").write_text("0.0.0-test\n")
    for script in ("install.sh", "uninstall.sh"):
        shutil.copy2(LINUX / script, bundle / script)
    return bundle


def user_env(base: Path) -> dict[str, str]:
    """A HOME of its own; XDG_RUNTIME_DIR empty so `systemctl --user` finds no manager."""
    home = base / "home"
    run = base / "run"
    for d in (home, run):
        d.mkdir(parents=True, exist_ok=True)
    run.chmod(0o700)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("XDG_") and k not in ("WARMSLOT_HOME", "DBUS_SESSION_BUS_ADDRESS")
    }
    env.update(HOME=str(home), XDG_RUNTIME_DIR=str(run), LC_ALL="C")
    return env


def run_script(
    script: Path, *args: str, env: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if check:
        assert proc.returncode == 0, f"{script.name} {args}: {proc.stdout}{proc.stderr}"
    return proc


@pytest.mark.parametrize("prefix_name", ["prefix", "my prefix"])
def test_install_then_uninstall(tmp_path: Path, prefix_name: str) -> None:
    bundle = fake_bundle(tmp_path)
    env = user_env(tmp_path)
    home = Path(env["HOME"])
    prefix = tmp_path / prefix_name
    run_script(bundle / "install.sh", "--prefix", str(prefix), "--autostart", "--service", env=env)

    libdir = prefix / "lib" / "warmslot"
    apps = home / ".local" / "share" / "applications" / "warmslot.desktop"
    autostart = home / ".config" / "autostart" / "warmslot.desktop"
    unit = home / ".config" / "systemd" / "user" / "warmslot.service"
    icons = [
        home / ".local/share/icons/hicolor/scalable/apps/warmslot.svg",
        home / ".local/share/icons/hicolor/256x256/apps/warmslot.png",
    ]
    assert (libdir / "warmslot").is_file()
    for exe in ("warmslot", "warmslot-tray"):
        link = prefix / "bin" / exe
        assert link.is_symlink() and link.resolve() == (libdir / exe).resolve()
    for path in (apps, autostart, unit, *icons):
        assert path.is_file(), path

    tray = str(libdir / "warmslot-tray")
    quoted = f'"{tray}"' if " " in tray else tray
    for desktop in (apps, autostart):
        desktop_validate(desktop)
        entry = desktop_entry(desktop)
        assert entry["Exec"] == quoted
        assert entry["TryExec"] == tray
        assert entry["Icon"] == "warmslot"
    assert desktop_entry(autostart).get("NoDisplay") == "true"
    cli = str(libdir / "warmslot")
    exec_start = f'"{cli}"' if " " in cli else cli
    assert f"ExecStart={exec_start} serve\n" in unit.read_text()
    unit_verify(unit, tmp_path / "run")

    # Without --purge: the program goes, the user's folders stay.
    user_dirs = [
        home / ".config" / "warmslot",
        home / ".cache" / "warmslot",
        home / ".local" / "state" / "warmslot",
        home / ".local" / "share" / "warmslot",
    ]
    for d in user_dirs:
        d.mkdir(parents=True)
        (d / "keep").write_text("x")
    run_script(libdir / "uninstall.sh", env=env)
    for path in (libdir, apps, autostart, unit, *icons, prefix / "bin" / "warmslot"):
        assert not path.exists() and not path.is_symlink(), path
    assert all((d / "keep").exists() for d in user_dirs)


def test_purge_asks_and_removes_caches_and_state(tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path)
    env = user_env(tmp_path)
    home = Path(env["HOME"])
    prefix = tmp_path / "prefix"
    run_script(bundle / "install.sh", "--prefix", str(prefix), env=env)
    config = home / ".config" / "warmslot"
    purged = [
        home / ".cache" / "warmslot",
        home / ".local" / "state" / "warmslot",
        home / ".local" / "share" / "warmslot",
    ]
    for d in (config, *purged):
        d.mkdir(parents=True)
        (d / "file").write_text("x")
    uninstall = prefix / "lib" / "warmslot" / "uninstall.sh"

    refused = run_script(uninstall, "--purge", env=env, check=False)  # no terminal, no --yes
    assert refused.returncode == 2
    assert "WARNING" in refused.stdout and str(purged[0]) in refused.stdout
    assert all(d.exists() for d in purged) and uninstall.exists()

    done = run_script(uninstall, "--purge", "--yes", env=env)
    assert "WARNING" in done.stdout
    assert not any(d.exists() for d in purged)
    assert (config / "file").exists()  # settings only go with --purge-config
    assert not (prefix / "lib" / "warmslot").exists()


def test_install_refuses_a_folder_that_is_not_a_bundle(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    (tmp_path / "empty").mkdir()
    proc = run_script(
        LINUX / "install.sh", "--bundle", str(tmp_path / "empty"), env=env, check=False
    )
    assert proc.returncode == 1
    assert "not a Warmslot bundle" in proc.stderr
