"""The tray's system-library check: the real dynamic loader on a real shared object."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.machine.syslibs import (
    check_tray_libraries,
    install_hint,
    missing_from_ldd,
    os_release_ids,
    qt_will_use_xcb,
)

LDD_OUTPUT = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibxcb-icccm.so.4 => not found
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f)
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
"""


def test_ldd_not_found_lines_are_the_missing_libraries() -> None:
    assert missing_from_ldd(LDD_OUTPUT) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    assert missing_from_ldd("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []


def test_install_hint_names_the_package_per_os(tmp_path: Path) -> None:
    missing = ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    debian = tmp_path / "debian"
    debian.write_text('ID=debian\nVERSION_ID="12"\n')
    ubuntu = tmp_path / "ubuntu"
    ubuntu.write_text("ID=ubuntu\nID_LIKE=debian\n")
    assert os_release_ids(ubuntu) == {"ubuntu", "debian"}
    want = "Install them: sudo apt install libxcb-icccm4 libxcb-keysyms1"
    assert install_hint(missing, os_release_ids(debian)) == want
    assert install_hint(missing, os_release_ids(ubuntu)) == want
    assert install_hint(missing, {"fedora"}) == (
        "Install them: sudo dnf install xcb-util-wm xcb-util-keysyms"
    )
    assert "package manager" in install_hint(missing, set())
    # a library without a known package name never yields a wrong command
    assert install_hint(["libfoo.so.9"], {"debian"}).startswith("Install the packages")


def test_qt_platform_choice() -> None:
    assert qt_will_use_xcb({"QT_QPA_PLATFORM": "xcb"})
    assert not qt_will_use_xcb({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"})
    assert not qt_will_use_xcb({"QT_QPA_PLATFORM": "wayland;xcb", "DISPLAY": ":0"})
    if sys.platform.startswith("linux"):
        assert qt_will_use_xcb({"DISPLAY": ":1"})
        assert not qt_will_use_xcb({"DISPLAY": ":1", "WAYLAND_DISPLAY": "wayland-0"})
    assert not qt_will_use_xcb({})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ldd and ELF are Linux-only")
def test_a_library_deleted_after_linking_is_reported(tmp_path: Path) -> None:
    """A plugin linked against a library that is then removed: ldd names it missing."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to link the test plugin (scripts/test installs one)")
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "plug.c").write_text("int dep(void); int plug(void) { return dep(); }\n")
    run = {"check": True, "cwd": tmp_path, "capture_output": True}
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", "libwsdep.so.1", "-Wl,-soname,libwsdep.so.1", "dep.c"], **run
    )  # type: ignore[call-overload]
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-o",
            "libplug.so",
            "plug.c",
            "-L.",
            "-l:libwsdep.so.1",
            "-Wl,-rpath,$ORIGIN",
        ],
        **run,
    )  # type: ignore[call-overload]
    plugin = tmp_path / "libplug.so"
    debian = tmp_path / "os-release"
    debian.write_text("ID=debian\n")
    assert check_tray_libraries([plugin], debian).ok  # found next to the plugin
    (tmp_path / "libwsdep.so.1").unlink()
    found = check_tray_libraries([plugin], debian)
    assert found.checked and found.missing == ("libwsdep.so.1",)
    assert "libwsdep.so.1" in found.message()
    assert not check_tray_libraries([], debian).checked
