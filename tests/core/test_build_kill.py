"""A signal to `warmslot build` stops everything the build started.

Before, SIGTERM ended Python at once: cmake and ninja kept compiling under PID 1 and the
temp folder stayed. And even a cancelled build left ninja's commands running once ninja
itself was killed, since ninja puts each command in a process group of its own.

The build here is the real CLI in its own process, with real cmake and ninja (or make)
on the stand-in tree tests/fixtures/fake_llama_src, whose FAKE_SLOW step runs a 300 s
``cmake -E sleep`` under ninja: the same process tree a llama.cpp build has, without
its ten minutes of compiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from core.machine import process
from tests.helpers import pid_gone, wait_until

REPO = Path(__file__).resolve().parents[2]
FAKE_SRC = REPO / "tests" / "fixtures" / "fake_llama_src"

posix_only = pytest.mark.skipif(os.name != "posix", reason="signals and sessions are POSIX")
needs_cmake = pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("cc")), reason="needs cmake and a C compiler"
)


def _is_slow_step(p: psutil.Process) -> bool:
    try:
        cmd = p.cmdline()
        return "sleep" in cmd and "300" in cmd and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if not pid_gone(p.pid)]


@posix_only
@needs_cmake
@pytest.mark.parametrize(
    ("sig", "exit_code"),
    [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)],
    ids=["SIGTERM", "SIGHUP", "SIGINT"],
)
def test_a_signal_to_warmslot_build_leaves_no_process_and_no_temp_dir(
    tmp_path: Path, sig: signal.Signals, exit_code: int
) -> None:
    src = tmp_path / "llama-src"
    shutil.copytree(FAKE_SRC, src)
    home = tmp_path / "home"
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "core.cli.main",
            "build",
            "--source",
            str(src),
            "--no-patches",
            "--backend",
            "cpu",
            "--no-native",
            "--cmake-arg=-DFAKE_SLOW=ON",
            "--dev-dir",
            str(home),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree: list[psutil.Process] = []
    try:

        def slow_step_runs() -> list[psutil.Process]:
            kids = psutil.Process(cli.pid).children(recursive=True)
            return kids if any(_is_slow_step(p) for p in kids) else []

        tree = wait_until(slow_step_runs, 120, interval=0.05, message="no slow step")
        names = {p.name() for p in tree}
        assert "cmake" in names  # the build's tree: cmake, ninja or make, sh, the step
        builds = home / "cache" / "builds"
        assert [d.name for d in builds.iterdir() if d.name.startswith(".tmp-")]

        cli.send_signal(sig)
        _, err = cli.communicate(timeout=60)
        wait_until(
            lambda: not _alive(tree),
            30,
            message=lambda: f"still running: {[p.cmdline() for p in _alive(tree)]}",
        )
        assert sorted(d.name for d in builds.iterdir()) == [".toolchain.json"]
        assert cli.returncode == exit_code, err
        assert "nothing was left in the build cache" in err
    finally:
        cli.kill()
        for p in _alive(tree):  # leftovers of a failed run must not outlive the test
            with contextlib.suppress(psutil.Error):
                p.kill()


# A leader whose child moves into a process group of its own, as ninja does with every
# command it runs; both ignore SIGTERM, so only the kill after the grace ends them.
_NINJA_LIKE = """\
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(
    [sys.executable, "-c",
     "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pause()"],
    process_group=0,
)
print(child.pid, flush=True)
signal.pause()
"""


@posix_only
async def test_stopping_a_group_also_kills_the_groups_its_members_made(tmp_path: Path) -> None:
    script = tmp_path / "ninja_like.py"
    script.write_text(_NINJA_LIKE)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        stdout=asyncio.subprocess.PIPE,
        **process.new_group_kwargs(),
    )
    assert proc.stdout is not None
    child = int((await asyncio.wait_for(proc.stdout.readline(), 30)).decode())
    try:
        assert os.getpgid(child) == child != proc.pid  # a group of its own
        assert os.getsid(child) == proc.pid  # in the leader's session
        forced = await process.stop_group(proc, grace_s=0.5)
        assert forced
        wait_until(lambda: pid_gone(child), 10, message="the child's own group survived")
    finally:
        if not pid_gone(child):
            os.kill(child, signal.SIGKILL)


# An owner of a build (as Core is: its loop on a thread) that exits on a line from stdin
# without cancelling the build first.
_OWNER = """\
import asyncio, sys, threading
from pathlib import Path
from core.build import BuildRequest, build
from core.paths import Paths

req = BuildRequest(source=sys.argv[1], patches=False, backend="cpu", native=False,
                   extra_cmake_args=("-DFAKE_SLOW=ON",))
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
asyncio.run_coroutine_threadsafe(build(req, Paths.under(Path(sys.argv[2]))), loop)
sys.stdin.readline()
sys.exit(3)
"""


@posix_only
@needs_cmake
def test_an_owner_that_exits_mid_build_leaves_no_compiler_running(tmp_path: Path) -> None:
    """Found when a script's Core timed out while it built: cmake and the compilers went
    on under PID 1. Python's exit now kills the live steps' sessions."""
    src = tmp_path / "llama-src"
    shutil.copytree(FAKE_SRC, src)
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(src), str(tmp_path / "home")],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree: list[psutil.Process] = []
    try:

        def slow_step_runs() -> list[psutil.Process]:
            kids = psutil.Process(owner.pid).children(recursive=True)
            return kids if any(_is_slow_step(p) for p in kids) else []

        tree = wait_until(slow_step_runs, 120, interval=0.05, message="no slow step")
        _, err = owner.communicate("exit\n", timeout=60)
        assert owner.returncode == 3, err
        wait_until(
            lambda: not _alive(tree),
            30,
            message=lambda: f"still running: {[p.cmdline() for p in _alive(tree)]}",
        )
    finally:
        owner.kill()
        for p in _alive(tree):
            with contextlib.suppress(psutil.Error):
                p.kill()


@posix_only
@needs_cmake
def test_a_killed_warmslot_build_leaves_no_compiler_running(tmp_path: Path) -> None:
    """kill -9 of `warmslot build` runs no handler and no atexit hook: each step's watch
    (core.machine.process.spawn) sends its group SIGTERM, and ninja stops the command it
    runs in a group of its own. Before, the parent-death signal reached cmake alone and
    the 300 s step ran on under PID 1."""
    src = tmp_path / "llama-src"
    shutil.copytree(FAKE_SRC, src)
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "core.cli.main",
            "build",
            "--source",
            str(src),
            "--no-patches",
            "--backend",
            "cpu",
            "--no-native",
            "--cmake-arg=-DFAKE_SLOW=ON",
            "--dev-dir",
            str(tmp_path / "home"),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tree: list[psutil.Process] = []
    try:

        def slow_step_runs() -> list[psutil.Process]:
            kids = psutil.Process(cli.pid).children(recursive=True)
            return kids if any(_is_slow_step(p) for p in kids) else []

        tree = wait_until(slow_step_runs, 120, interval=0.05, message="no slow step")
        cli.kill()
        assert cli.wait(30) == -signal.SIGKILL
        wait_until(
            lambda: not _alive(tree),
            60,
            message=lambda: f"still running: {[p.cmdline() for p in _alive(tree)]}",
        )
    finally:
        cli.kill()
        for p in _alive(tree):
            with contextlib.suppress(psutil.Error):
                p.kill()
