"""System libraries the tray's Qt needs on Linux, found without loading Qt.

PySide6's wheels bring Qt but not the X11 libraries its xcb platform plugin links
against. When one is missing, Qt aborts at start with "could not load the Qt
platform plugin xcb" and names the wrong library (found on a fresh Debian 12 without
libxcb-icccm4 and libxcb-keysyms1). So `warmslot doctor` and the tray,
before Qt loads its plugin, ask the dynamic loader (``ldd`` on the plugin) what is
missing and name the package that brings it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# soname → Debian/Ubuntu package. Fedora/RHEL and Arch split the xcb utilities
# differently (xcb-util-wm, xcb-util-keysyms, …), hence FAMILY_PACKAGES below.
DEBIAN_PACKAGES: dict[str, str] = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb.so.1": "libxcb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libX11.so.6": "libx11-6",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0",
}
_XCB_UTIL_RPM = {
    "libxcb-icccm.so.4": "xcb-util-wm",
    "libxcb-keysyms.so.1": "xcb-util-keysyms",
    "libxcb-image.so.0": "xcb-util-image",
    "libxcb-render-util.so.0": "xcb-util-renderutil",
    "libxcb-cursor.so.0": "xcb-util-cursor",
    "libxcb-util.so.1": "xcb-util",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11",
}
# OS family (os-release ID/ID_LIKE) → (install command, soname → package).
FAMILY_PACKAGES: dict[str, tuple[str, Mapping[str, str]]] = {
    "debian": ("sudo apt install", DEBIAN_PACKAGES),
    "fedora": ("sudo dnf install", _XCB_UTIL_RPM),
    "arch": ("sudo pacman -S", _XCB_UTIL_RPM),
}
_FAMILIES = {
    "debian": "debian",
    "ubuntu": "debian",
    "fedora": "fedora",
    "rhel": "fedora",
    "centos": "fedora",
    "arch": "arch",
}


def os_release_ids(os_release: Path = Path("/etc/os-release")) -> set[str]:
    """The distribution's ID and ID_LIKE words (empty when unknown)."""
    ids: set[str] = set()
    with contextlib.suppress(OSError):
        for line in os_release.read_text("utf-8", "replace").splitlines():
            key, _, value = line.partition("=")
            if key in ("ID", "ID_LIKE"):
                ids.update(value.strip().strip('"').lower().split())
    return ids


@dataclass(frozen=True)
class TrayLibraries:
    """What the dynamic loader says about Qt's xcb plugin on this machine."""

    checked: bool  # False: not Linux, no PySide6, or no ldd — nothing is known
    missing: tuple[str, ...] = ()  # sonames the loader cannot find
    hint: str = ""  # the command that installs them, when the OS is known

    @property
    def ok(self) -> bool:
        return not self.missing

    def message(self) -> str:
        """One paragraph for a terminal: what is missing and how to install it."""
        if self.ok:
            return "Qt's X11 plugin finds all its system libraries"
        text = (
            "Qt's X11 (xcb) platform plugin needs system libraries that are missing: "
            + ", ".join(self.missing)
            + "."
        )
        return f"{text} {self.hint}" if self.hint else text


def xcb_plugin_files() -> list[Path]:
    """PySide6's xcb platform plugin and the Qt library behind it, where installed."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or spec.origin is None:
        return []
    qt = Path(spec.origin).parent / "Qt"
    candidates = [
        qt / "plugins" / "platforms" / "libqxcb.so",
        *sorted((qt / "lib").glob("libQt6XcbQpa.so*")),
    ]
    return [p for p in candidates if p.is_file()]


def missing_from_ldd(output: str) -> list[str]:
    """Sonames that `ldd` reports as "not found", in order, once each."""
    missing: list[str] = []
    for line in output.splitlines():
        name, sep, where = line.strip().partition("=>")
        if sep and where.strip() == "not found" and name.strip() not in missing:
            missing.append(name.strip())
    return missing


def install_hint(missing: list[str], ids: set[str]) -> str:
    """The install command for `missing` on the OS with these os-release ids."""
    family = next((_FAMILIES[i] for i in sorted(ids) if i in _FAMILIES), None)
    if family is None:
        return "Install the packages that provide them with your system's package manager."
    command, packages = FAMILY_PACKAGES[family]
    names = [packages.get(so, "") for so in missing]
    if not all(names):
        return f"Install the packages that provide them ({command} …)."
    return f"Install them: {command} {' '.join(dict.fromkeys(names))}"


def check_tray_libraries(
    files: list[Path] | None = None, os_release: Path = Path("/etc/os-release")
) -> TrayLibraries:
    """Which system libraries Qt's xcb plugin lacks here (Linux only; never raises)."""
    if not sys.platform.startswith("linux"):
        return TrayLibraries(checked=False)
    files = xcb_plugin_files() if files is None else files
    ldd = shutil.which("ldd")
    if not files or ldd is None:
        return TrayLibraries(checked=False)
    missing: list[str] = []
    for f in files:
        try:
            out = subprocess.run(
                [ldd, str(f)], capture_output=True, text=True, timeout=20, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return TrayLibraries(checked=False)
        missing += [so for so in missing_from_ldd(out) if so not in missing]
    hint = install_hint(missing, os_release_ids(os_release)) if missing else ""
    return TrayLibraries(checked=True, missing=tuple(missing), hint=hint)


def qt_will_use_xcb(env: Mapping[str, str] | None = None) -> bool:
    """Whether Qt would pick its X11 plugin at start (so its libraries must be there)."""
    env = os.environ if env is None else env
    platform_name = env.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0].strip()
    if platform_name:
        return platform_name == "xcb"
    return (
        sys.platform.startswith("linux")
        and bool(env.get("DISPLAY"))
        and not env.get("WAYLAND_DISPLAY")
    )
