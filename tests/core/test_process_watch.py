"""Children started by Warmslot: no Python runs between fork and exec, and none outlives a
killed Warmslot (core.machine.process.spawn and its watch).

Real processes throughout: the owners are Python programs run with the repository on
their path, killed with SIGKILL; their children are small Python programs that ignore
SIGTERM where the test needs them to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from core.build.log import BuildLog, run_step
from core.machine import process
from tests.helpers import REPO, pid_gone, wait_until

posix_only = pytest.mark.skipif(os.name != "posix", reason="process groups and sh are POSIX")

# A leader that ignores SIGTERM and starts a helper in its group that ignores it too;
# each writes its pid to a file once it runs.
CHAIN = """\
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
piddir, role = sys.argv[1], sys.argv[2]
if role == "leader":
    subprocess.Popen([sys.executable, __file__, piddir, "helper"])
tmp = os.path.join(piddir, role + ".tmp")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(piddir, role + ".pid"))
while True:
    signal.pause()
"""

# An owner as `warmslot worker` is one: its loop on a thread, a WorkerRunner supervising
# the chain's leader. It waits on stdin until the test kills it.
OWNER = """\
import asyncio, sys, threading
from core.cli.worker import WorkerRunner
from core.machine import process
process.WATCH_GRACE_S = 1
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
runner = WorkerRunner([sys.executable, sys.argv[1], sys.argv[2], "leader"], out=sys.stderr)
asyncio.run_coroutine_threadsafe(runner.run(), loop)
sys.stdin.readline()
"""


def _read_pids(piddir: Path) -> list[int]:
    files = [piddir / "leader.pid", piddir / "helper.pid"]
    wait_until(lambda: all(f.exists() for f in files), 30, message="the chain did not start")
    return [int(f.read_text()) for f in files]


def _watches() -> list[psutil.Process]:
    """This test process's watches still running."""
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and "warmslot-watch" in p.cmdline():
                out.append(p)
    return out


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    """Pids to kill at the end, whatever the test did."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


@posix_only
@pytest.mark.parametrize("end", ["kill -9", "exit"])
def test_an_owner_that_ends_takes_its_childs_whole_group_even_one_that_ignores_sigterm(
    tmp_path: Path, cleanup: list[int], end: str
) -> None:
    """kill -9 of the Python that started them, or its exit without stopping them: the
    watch sends SIGTERM to the group, then SIGKILL. Before, the parent-death signal
    reached the leader alone, and only as SIGTERM: this leader and its helper ignore it
    and ran on."""
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(script), str(piddir)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    cleanup.append(owner.pid)
    with owner:  # its pipes are closed at the end
        pids = _read_pids(piddir)
        cleanup.extend(pids)
        leader, helper = pids
        assert psutil.Process(leader).ppid() == owner.pid
        assert os.getpgid(helper) == leader  # the helper is in the leader's group
        if end == "exit":
            assert owner.stdin is not None
            owner.stdin.write(b"exit\n")
            owner.stdin.flush()
            assert owner.wait(30) == 0
        else:
            owner.kill()
    wait_until(
        lambda: pid_gone(leader) and pid_gone(helper),
        60,
        message=lambda: f"outlived the killed owner: {[p for p in pids if not pid_gone(p)]}",
    )


@posix_only
async def test_a_child_that_is_stopped_or_has_exited_releases_its_watch() -> None:
    """The watch leaves once its child's group is dealt with (`stop_group`, or
    `kill_leftovers` after an exit), without a signal to anyone: a finished run leaves no
    process behind, and no watch that could later signal a group id used again."""
    before = {p.pid for p in _watches()}
    quick = await process.spawn([sys.executable, "-c", "print('hello')"])
    assert quick.stdout is not None
    assert (await quick.stdout.read()).strip() == b"hello"
    assert await process.wait_exit(quick) == 0
    slow = await process.spawn([sys.executable, "-c", "import time; time.sleep(300)"])
    mine = {p.pid for p in _watches()} - before
    assert len(mine) == 2  # one per child, each in a session of its own
    assert all(os.getsid(pid) == pid for pid in mine)
    process.kill_leftovers(quick.pid)
    assert await process.stop_group(slow, grace_s=10) is False
    assert slow.returncode == -signal.SIGTERM  # the stop's own signal, not the watch's
    wait_until(lambda: not mine & {p.pid for p in _watches()}, 30, message="a watch stayed")


@posix_only
async def test_spawning_under_busy_threads_runs_no_python_in_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many build steps started while other threads allocate and log: every one runs and
    exits, and none is given a ``preexec_fn`` (Python in the forked child of a threaded
    process, which CPython documents can deadlock; the old parent-death signal was one)."""
    seen: list[Any] = []
    real_popen = subprocess.Popen

    class Recording(real_popen):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs.get("preexec_fn"))
            super().__init__(*args, **kwargs)

    # asyncio's subprocess transport looks Popen up on the module when it starts one.
    monkeypatch.setattr(subprocess, "Popen", Recording)
    stop = threading.Event()
    noise = logging.getLogger("warmslot.test.noise")

    def churn() -> None:
        while not stop.is_set():
            junk = [bytearray(4096) for _ in range(200)]
            noise.debug("churn %d", len(junk))

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    blog = BuildLog()
    blog.open(tmp_path / "build.log")
    try:

        async def one(i: int) -> int:
            return await run_step(
                [sys.executable, "-c", f"print({i})"],
                cwd=tmp_path,
                env=os.environ,
                blog=blog,
                cancel=None,
            )

        codes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), 240)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        blog.close()
    assert codes == [0] * 24
    assert seen and all(fn is None for fn in seen), seen
    printed = (tmp_path / "build.log").read_text()
    assert {int(n) for n in re.findall(r"^(\d+)$", printed, re.M)} == set(range(24))


def test_no_module_of_the_core_hands_python_to_a_forked_child() -> None:
    """The rule at its source: no ``preexec_fn`` anywhere in core/ (a smoke start's core
    limit is set by the shell that execs the binary, the parent-death watch is a shell)."""
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "core").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "preexec_fn=" in line
    ]
    assert found == []
