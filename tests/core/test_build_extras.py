"""Build helpers around the first run: ETA, steps, priority, and the compiler hint."""

from __future__ import annotations

from pathlib import Path

import pytest

import core.build as b
from core.build.log import ProgressTracker, estimate_eta, parse_progress_line
from core.events import BuildProgress


def test_ninja_lines_carry_their_step_counts() -> None:
    line = parse_progress_line("[120/208] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o")
    assert line is not None and (line.done, line.total) == (120, 208)
    assert line.percent == pytest.approx(100 * 120 / 208)
    make = parse_progress_line("[ 42%] Building CXX object x.o")
    assert make is not None and (make.done, make.total) == (0, 0)
    tracker = ProgressTracker()
    moved = tracker.feed("[3/10] Linking CXX executable bin/llama-server")
    assert moved is not None and (moved.done, moved.total) == (3, 10)


def test_eta_uses_the_last_build_then_this_builds_pace() -> None:
    assert estimate_eta(10.0, 0.0, None) is None  # nothing known yet
    assert estimate_eta(60.0, 1.0, 500.0) == pytest.approx(440.0)  # the last build's time
    assert estimate_eta(600.0, 5.0, 500.0) == 0.0  # slower than last time: never negative
    assert estimate_eta(100.0, 50.0, 500.0) == pytest.approx(100.0)  # own pace from 25 %
    assert estimate_eta(30.0, 10.0, None) == pytest.approx(270.0)  # no history: own pace


def test_describe_build_reads_like_a_sentence() -> None:
    ev = BuildProgress(
        build_id="x",
        percent=45.2,
        step="s",
        steps_done=94,
        steps_total=208,
        elapsed_s=240.0,
        eta_s=290.0,
        purpose="building the patched server for the disk tier",
        background=True,
    )
    assert ev.describe() == (
        "building the patched server for the disk tier: 45 % (94/208), 4 min so far, "
        "about 5 min left"
    )


def test_background_builds_run_at_idle_priority_with_a_core_left_free() -> None:
    tools = {"nice": "/usr/bin/nice", "ionice": "/usr/bin/ionice"}
    assert b.low_priority_prefix(tools.get) == ["nice", "-n", "19", "ionice", "-c", "3"]
    assert b.low_priority_prefix({"nice": "/usr/bin/nice"}.get) == ["nice", "-n", "19"]
    assert b.low_priority_prefix({}.get) == []
    assert (b.default_jobs(False, 8), b.default_jobs(True, 8)) == (8, 7)
    assert b.default_jobs(True, 1) == 1


@pytest.mark.parametrize(
    ("release", "system", "words"),
    [
        ('ID=debian\nVERSION_ID="12"\n', "Linux", "sudo apt install build-essential"),
        ('ID=pop\nID_LIKE="ubuntu debian"\n', "Linux", "sudo apt install build-essential"),
        ('ID="fedora"\n', "Linux", "sudo dnf install gcc-c++ make"),
        ("ID=arch\n", "Linux", "sudo pacman -S base-devel"),
        ("ID=alpine\n", "Linux", "sudo apk add build-base"),
        ("ID=nixos\n", "Linux", "gcc and g++, or clang"),
        ("", "Darwin", "xcode-select --install"),
        ("", "Windows", "Visual Studio Build Tools"),
    ],
)
def test_the_compiler_hint_names_the_package_for_this_os(
    tmp_path: Path, release: str, system: str, words: str
) -> None:
    f = tmp_path / "os-release"
    f.write_text(release)
    hint = b.compiler_hint(f, system)
    assert words in hint and "server.binary" in hint


def test_toolchain_check_lists_what_is_missing() -> None:
    def which(name: str, path: str | None = None) -> str | None:
        return None if name in ("c++", "cmake") else f"/usr/bin/{name}"

    check = b.check_toolchain({"PATH": "/usr/bin"}, which)
    assert not check.ok
    assert check.problems == ("no C++ compiler (c++)", "no cmake")
    nogit = b.check_toolchain({"PATH": "/usr/bin"}, lambda n, path=None: None if n == "git" else n)
    assert nogit.problems == ("no git",) and "apt install git" in nogit.hint
    assert "pip install cmake ninja" in check.hint
    ok = b.check_toolchain({"PATH": "/usr/bin"}, lambda n, path=None: f"/usr/bin/{n}")
    assert ok.ok and ok.problems == () and ok.hint == ""


def test_tool_path_puts_warmslots_own_environment_first() -> None:
    import sysconfig

    path = b.tool_path({"PATH": "/usr/bin"})
    assert path.split(":")[0] == sysconfig.get_path("scripts")
    assert path.endswith("/usr/bin")
