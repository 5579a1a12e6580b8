"""core.machine.process: own group, polite stop, then kill the whole group or tree.

The POSIX branch runs for real: process trees of small Python programs that ignore
SIGTERM where a test needs them to. The Windows branch runs here too, with the
module's branch switched: its psutil tree kill for real on a live tree, and the parts
that need Windows itself (``CTRL_BREAK_EVENT``, ``CREATE_NEW_PROCESS_GROUP``) with
``os.kill`` and psutil replaced by fakes that record what was asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest

from core.machine import process
from tests.helpers import pid_gone, wait_until

posix_only = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")

# Each level ignores SIGTERM when told to, starts the next level (which always ignores
# it), writes its pid once that is done, and sleeps. The pid files say: all started.
CHAIN = """\
import os, signal, subprocess, sys
depth, piddir, ignore = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if depth > 0:
    subprocess.Popen([sys.executable, __file__, str(depth - 1), piddir, "1"])
tmp = os.path.join(piddir, f"{depth}.tmp")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(piddir, f"{depth}.pid"))
while True:
    signal.pause()  # idle until the signal under test arrives
"""


class Chain:
    """A process tree: the leader (level `depth`) and its descendants (levels below)."""

    def __init__(self, tmp_path: Path, depth: int, leader_ignores_term: bool) -> None:
        self.script = tmp_path / "chain.py"
        self.script.write_text(CHAIN)
        self.piddir = tmp_path / "pids"
        self.piddir.mkdir()
        self.depth = depth
        self.argv = [
            sys.executable,
            str(self.script),
            str(depth),
            str(self.piddir),
            "1" if leader_ignores_term else "0",
        ]

    def pids(self) -> list[int]:
        """Every level's pid, leader first, once all have started."""
        files = [self.piddir / f"{level}.pid" for level in range(self.depth, -1, -1)]
        wait_until(lambda: all(f.exists() for f in files), 20, message="the tree did not start")
        return [int(f.read_text()) for f in files]


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    """Pids to kill at the end, whatever the test did (a failed test leaves no tree)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


# ------------------------------------------------------------------------------ POSIX


@posix_only
def test_the_child_leads_its_own_group_and_kill_group_takes_all_of_it(
    tmp_path: Path, cleanup: list[int]
) -> None:
    chain = Chain(tmp_path, depth=2, leader_ignores_term=True)
    proc = subprocess.Popen(chain.argv, **process.new_group_kwargs())
    pids = chain.pids()
    cleanup.extend(pids)
    assert pids[0] == proc.pid
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    assert all(os.getpgid(pid) == proc.pid for pid in pids)

    process.kill_group(proc.pid)
    assert proc.wait(10) == -signal.SIGKILL
    for pid in pids[1:]:
        wait_until(lambda pid=pid: pid_gone(pid), 5, message=f"{pid} survived kill_group")
    process.kill_group(proc.pid)  # gone already: no error


@posix_only
async def test_a_polite_stop_then_the_helpers_left_in_its_group(
    tmp_path: Path, cleanup: list[int]
) -> None:
    chain = Chain(tmp_path, depth=1, leader_ignores_term=False)
    proc = await asyncio.create_subprocess_exec(
        *chain.argv, stdin=asyncio.subprocess.DEVNULL, **process.new_group_kwargs()
    )
    leader, helper = chain.pids()
    cleanup.extend([leader, helper])

    started = time.monotonic()
    forced = await process.stop_group(proc, grace_s=30)
    assert forced is False  # the leader left on SIGTERM, long before the grace ran out
    assert time.monotonic() - started < 10
    assert proc.returncode == -signal.SIGTERM
    # The helper ignores SIGTERM: only the kill of what was left of the group ends it.
    wait_until(lambda: pid_gone(helper), 5, message="the helper outlived its group's stop")


@posix_only
async def test_a_leader_that_ignores_the_stop_is_killed_after_the_grace(
    tmp_path: Path, cleanup: list[int]
) -> None:
    chain = Chain(tmp_path, depth=1, leader_ignores_term=True)
    proc = await asyncio.create_subprocess_exec(
        *chain.argv, stdin=asyncio.subprocess.DEVNULL, **process.new_group_kwargs()
    )
    leader, helper = chain.pids()
    cleanup.extend([leader, helper])

    started = time.monotonic()
    forced = await process.stop_group(proc, grace_s=0.5)
    assert forced is True
    assert time.monotonic() - started >= 0.5
    assert proc.returncode == -signal.SIGKILL
    wait_until(lambda: pid_gone(helper), 5, message="the helper survived the kill")
    # Already stopped: nothing to do, and not "forced".
    assert await process.stop_group(proc, grace_s=0.5) is False


# ------------------------------------------------------------------------------ Windows


@pytest.fixture
def windows_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the Windows branch; a POSIX group signal fails the test."""
    monkeypatch.setattr(process, "_WINDOWS", True)

    def no_killpg(pid: int, sig: int) -> None:
        raise AssertionError(f"killpg({pid}, {sig}) on Windows")

    monkeypatch.setattr(os, "killpg", no_killpg)


@pytest.fixture
def windows(windows_branch: None, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """The Windows branch with os.kill recorded (here it would send real POSIX signals)."""
    calls: list[tuple[str, Any]] = []

    def fake_kill(pid: int, sig: int) -> None:
        calls.append(("os.kill", (pid, sig)))

    monkeypatch.setattr(os, "kill", fake_kill)
    return calls


def test_windows_starts_a_new_process_group(windows: list[tuple[str, Any]]) -> None:
    assert process.new_group_kwargs() == {"creationflags": 0x00000200}


def test_windows_asks_with_ctrl_break_and_says_when_it_cannot(
    windows: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert process.ask_to_stop(4242) is True
    assert windows == [("os.kill", (4242, 1))]  # CTRL_BREAK_EVENT to its console group

    def no_console(pid: int, sig: int) -> None:
        raise OSError(6, "The handle is invalid")  # what Windows says without a console

    monkeypatch.setattr(os, "kill", no_console)
    assert process.ask_to_stop(4242) is False


@posix_only  # the tree is started here with POSIX tools; psutil is the same on Windows
def test_windows_kill_takes_the_whole_tree(
    tmp_path: Path, cleanup: list[int], windows_branch: None
) -> None:
    chain = Chain(tmp_path, depth=2, leader_ignores_term=True)
    proc = subprocess.Popen(chain.argv)  # no group of its own: the tree is what counts
    pids = chain.pids()
    cleanup.extend(pids)

    process.kill_group(proc.pid)
    assert proc.wait(10) == -signal.SIGKILL
    for pid in pids[1:]:
        wait_until(lambda pid=pid: pid_gone(pid), 5, message=f"{pid} survived the tree kill")
    process.kill_group(proc.pid)  # gone: no error


class FakeProcess:
    """psutil.Process stand-in: a leader with three children, one of them not ours to kill."""

    killed: ClassVar[list[int]] = []

    def __init__(self, pid: int) -> None:
        if pid != 100:
            raise psutil.NoSuchProcess(pid)
        self.pid = pid

    def children(self, recursive: bool = False) -> list[Any]:
        assert recursive
        return [FakeChild(101), FakeChild(102, denied=True), FakeChild(103)]

    def kill(self) -> None:
        FakeProcess.killed.append(self.pid)


class FakeChild:
    def __init__(self, pid: int, denied: bool = False) -> None:
        self.pid, self.denied = pid, denied

    def kill(self) -> None:
        if self.denied:
            raise psutil.AccessDenied(self.pid)
        FakeProcess.killed.append(self.pid)


def test_windows_tree_kill_lists_first_then_kills_leader_first_and_goes_on_past_errors(
    windows: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FakeProcess, "killed", [])
    monkeypatch.setattr(psutil, "Process", FakeProcess)
    process.kill_group(100)
    assert FakeProcess.killed == [100, 101, 103]
    process.kill_group(999)  # no such process: no error
    process.kill_leftovers(100)  # after the leader exited, a pid leads nowhere on Windows
    assert FakeProcess.killed == [100, 101, 103]


class FakeAsyncProc:
    """The parts of asyncio.subprocess.Process that stop_group uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


async def test_windows_stop_without_a_console_kills_at_once(
    windows: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = FakeAsyncProc(100)

    def no_console(pid: int, sig: int) -> None:
        raise OSError(6, "The handle is invalid")

    class Tree(FakeProcess):
        def kill(self) -> None:
            super().kill()
            proc.returncode = 1  # TerminateProcess's exit code

    monkeypatch.setattr(os, "kill", no_console)
    monkeypatch.setattr(FakeProcess, "killed", [])
    monkeypatch.setattr(psutil, "Process", Tree)
    # A 60 s grace that must not be waited out: nobody could be asked to stop.
    forced = await asyncio.wait_for(process.stop_group(proc, grace_s=60), 5)  # type: ignore[arg-type]
    assert forced is True
    assert FakeProcess.killed == [100, 101, 103]


async def test_windows_polite_stop_that_works_kills_nothing(
    windows: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = FakeAsyncProc(100)

    def ctrl_break(pid: int, sig: int) -> None:
        windows.append(("os.kill", (pid, sig)))
        proc.returncode = 0xC000013A  # STATUS_CONTROL_C_EXIT: the default handler ran

    monkeypatch.setattr(os, "kill", ctrl_break)
    monkeypatch.setattr(FakeProcess, "killed", [])
    monkeypatch.setattr(psutil, "Process", FakeProcess)
    forced = await asyncio.wait_for(process.stop_group(proc, grace_s=60), 5)  # type: ignore[arg-type]
    assert forced is False
    assert windows == [("os.kill", (100, 1))]
    assert FakeProcess.killed == []
