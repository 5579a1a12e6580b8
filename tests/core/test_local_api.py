"""The runtime file names the instance running (or stopping) on a set of folders;
a file left by a crash, or one whose pid now belongs to a later process, names none."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from core.local_api import RUNNING, STOPPING, running_instance, wait_for_exit
from core.paths import Paths


def write_runtime(paths: Paths, pid: int, started: float, state: str | None) -> None:
    paths.ensure()
    data: dict[str, object] = {
        "pid": pid,
        "proxy_host": "127.0.0.1",
        "proxy_port": 8089,
        "started": started,
    }
    if state is not None:
        data["state"] = state
    paths.runtime_file.write_text(json.dumps(data))


def test_a_live_instance_and_its_state(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    assert running_instance(paths) is None  # no file
    write_runtime(paths, psutil.Process().pid, time.time(), STOPPING)
    inst = running_instance(paths)
    assert inst is not None and inst.stopping and inst.port == 8089
    write_runtime(paths, psutil.Process().pid, time.time(), None)  # a file from before states
    inst = running_instance(paths)
    assert inst is not None and inst.state == RUNNING and not inst.stopping


def test_a_file_left_by_a_crash_names_no_instance(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    write_runtime(paths, int(gone.stdout), time.time(), RUNNING)
    assert running_instance(paths) is None
    # A pid that now belongs to a process started after the file was written: not it.
    me = psutil.Process()
    write_runtime(paths, me.pid, me.create_time() - 60, RUNNING)
    assert running_instance(paths) is None
    paths.runtime_file.write_text("{not json")
    assert running_instance(paths) is None


def test_wait_for_exit(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        write_runtime(paths, child.pid, time.time(), STOPPING)
        inst = running_instance(paths)
        assert inst is not None
        assert not wait_for_exit(inst, 0.3)  # still running
        assert child.stdin is not None
        child.stdin.close()  # now it exits (a zombie until reaped counts as exited)
        assert wait_for_exit(inst, 30)
    finally:
        child.kill()
        child.wait(10)
