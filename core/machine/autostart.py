"""Start the tray at login: the XDG autostart entry (Linux), on or off.

The entry is the installers' own template (resources/linux/warmslot-autostart.desktop,
also written by ``installers/linux/install.sh --autostart``) with ``Exec`` pointing at
the `warmslot-tray` that is running now, so a pip install and the bundle both work.
Only a file Warmslot wrote is ever removed: one the user made stays.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from core.paths import resources_dir

TEMPLATE = Path("linux") / "warmslot-autostart.desktop"
FILE_NAME = "warmslot.desktop"
MARK = "X-Warmslot-Autostart=true"  # what tells our entry from one the user wrote


def supported() -> bool:
    """XDG autostart: Linux and other freedesktop systems."""
    return sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd"))


def entry_path(env: Mapping[str, str] | None = None) -> Path:
    """$XDG_CONFIG_HOME/autostart/warmslot.desktop (~/.config by default)."""
    env = os.environ if env is None else env
    config = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(config) / "autostart" / FILE_NAME


def tray_command() -> str:
    """The command line that starts this installation's tray."""
    if getattr(sys, "frozen", False):  # the bundle: the executable is the tray (or next to it)
        exe = Path(sys.executable)
        tray = exe.with_name("warmslot-tray")
        return shlex.quote(str(tray if tray.exists() else exe))
    beside = Path(sys.executable).with_name("warmslot-tray")  # a venv's bin/
    if beside.exists():
        return shlex.quote(str(beside))
    found = shutil.which("warmslot-tray")
    if found:
        return shlex.quote(found)
    return f"{shlex.quote(sys.executable)} -m app.main"


def is_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether an autostart entry for Warmslot exists and is not hidden/disabled."""
    try:
        text = entry_path(env).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    lines = {line.strip() for line in text.splitlines()}
    return "Hidden=true" not in lines and "X-GNOME-Autostart-enabled=false" not in lines


def enable(env: Mapping[str, str] | None = None, command: str | None = None) -> Path:
    """Write the autostart entry (atomically); returns its path."""
    if not supported():
        raise OSError("starting at login is set up by the installer on this system")
    path = entry_path(env)
    cmd = command or tray_command()
    out = []
    for line in (resources_dir() / TEMPLATE).read_text(encoding="utf-8").splitlines():
        if line.startswith("Exec="):
            line = f"Exec={cmd}"
        elif line.startswith("TryExec="):
            line = f"TryExec={shlex.split(cmd)[0]}"
        out.append(line)
    out.append(MARK)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE_NAME}.tmp")
    tmp.write_text("\n".join(out) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def disable(env: Mapping[str, str] | None = None) -> bool:
    """Remove Warmslot's autostart entry. An entry the user wrote is not removed: it is
    hidden instead (``Hidden=true``, the XDG way to switch an entry off). True if changed."""
    path = entry_path(env)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return False
    if MARK in text.splitlines() or _is_installers(text):
        path.unlink()
        return True
    if "Hidden=true" in text.splitlines():
        return False
    path.write_text(text.rstrip("\n") + "\nHidden=true\n", encoding="utf-8")
    return True


def _is_installers(text: str) -> bool:
    """The entry install.sh --autostart wrote: the template with only Exec/TryExec changed."""
    template = (resources_dir() / TEMPLATE).read_text(encoding="utf-8").splitlines()
    fixed = [ln for ln in template if not ln.startswith(("Exec=", "TryExec="))]
    mine = [ln for ln in text.splitlines() if not ln.startswith(("Exec=", "TryExec="))]
    return fixed == mine
