"""The login entry: written from the installers' template, removed only when ours."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from core.machine import autostart
from core.paths import resources_dir

pytestmark = pytest.mark.skipif(not autostart.supported(), reason="XDG autostart is Linux/BSD")


def env_for(tmp_path: Path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path / "config"), "HOME": str(tmp_path)}


def test_enable_then_disable(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    path = autostart.entry_path(env)
    assert path == tmp_path / "config" / "autostart" / "warmslot.desktop"
    assert not autostart.is_enabled(env)
    assert autostart.enable(env, command="/opt/ws/bin/warmslot-tray") == path
    text = path.read_text()
    assert "Exec=/opt/ws/bin/warmslot-tray\n" in text
    assert "TryExec=/opt/ws/bin/warmslot-tray\n" in text
    assert autostart.MARK in text
    assert autostart.is_enabled(env)
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    assert autostart.disable(env) is True
    assert not path.exists() and not autostart.is_enabled(env)
    assert autostart.disable(env) is False


def test_an_entry_the_installer_wrote_is_ours(tmp_path: Path) -> None:
    """install.sh --autostart renders the same template with its own Exec/TryExec."""
    env = env_for(tmp_path)
    path = autostart.entry_path(env)
    path.parent.mkdir(parents=True)
    template = (resources_dir() / autostart.TEMPLATE).read_text()
    path.write_text(
        template.replace("Exec=warmslot-tray", "Exec='/home/u/.local/lib/warmslot/warmslot-tray'")
    )
    assert autostart.is_enabled(env)
    assert autostart.disable(env) and not path.exists()


def test_a_users_own_entry_is_hidden_not_deleted(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    path = autostart.entry_path(env)
    path.parent.mkdir(parents=True)
    own = "[Desktop Entry]\nType=Application\nName=My Warmslot\nExec=sh -c 'warmslot-tray -v'\n"
    path.write_text(own)
    assert autostart.is_enabled(env)
    assert autostart.disable(env) is True
    assert path.read_text() == own + "Hidden=true\n"  # the user's lines are kept
    assert not autostart.is_enabled(env)
    assert autostart.disable(env) is False


def test_the_command_is_this_installation(tmp_path: Path) -> None:
    cmd = autostart.tray_command()
    assert "warmslot-tray" in cmd or cmd.endswith("-m app.main")
