"""Quitting the tray many times over, and launching it again right after Quit.

Real `warmslot-tray` processes, offscreen, quit with SIGTERM once their core is up (the
same path as the menu's Quit), with ``PYTHONFAULTHANDLER=1`` so a crash leaves its trace:

- `test_quits_all_clean`: many trays, each in its own home; every exit is clean (code 0,
  no fatal error or traceback, runtime file removed). 10 by default, 50 with
  ``WARMSLOT_SLOW_TESTS=1``. A Qt binding that releases references it does not own
  (PySide6 6.12.0 on Python 3.11) dies here with "Fatal Python error: bool_dealloc".
- `test_relaunch_right_after_quit_ends_with_a_running_tray`: one home, the tiny model.
  Each cycle warms a session (so the quit has a conversation to save), holds a request
  under way, quits, and launches the tray again within 0.5 s of the stop beginning. The
  new launch must wait for the old process, never hand over to it; the request under
  way gets its answer (200, or 503 with Retry-After, never a reset); the cycle ends
  with the new tray running. 3 cycles by default, 10 with ``WARMSLOT_SLOW_TESTS=1``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from core.local_api import Instance, running_instance
from core.paths import Paths
from tests.app.conftest import prepare
from tests.helpers import REPO, HeldRequest, chat_body, slow_tests, wait_until

SLOW = slow_tests()
QUITS = int(os.environ.get("WARMSLOT_QUIT_LOOP", "50" if SLOW else "10"))
RELAUNCHES = 10 if SLOW else 3
AT_ONCE = 4  # tray processes alive together (each is mostly waiting on Qt's import)
TRAY = [sys.executable, "-c", "import sys, app.main; sys.exit(app.main.main())"]
FATAL = ("Fatal Python error", "Traceback", "Segmentation fault")


def tray_env() -> dict[str, str]:
    """Read when a tray starts: the session's server fixture may have changed PATH."""
    return {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONFAULTHANDLER": "1"}


def test_quits_all_clean(tmp_path: Path) -> None:
    failures: list[str] = []
    done = 0
    while done < QUITS:
        batch = []
        for i in range(done, min(done + AT_ONCE, QUITS)):
            home = tmp_path / str(i)
            paths = prepare(home)
            proc = subprocess.Popen(
                [*TRAY, "--dev-dir", str(home)],
                cwd=REPO,
                env=tray_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            batch.append((proc, paths))
        for proc, paths in batch:
            wait_until(
                lambda p=proc, f=paths.runtime_file: f.exists() or p.poll() is not None,
                120,
                interval=0.05,
                message="the tray's core did not come up in 120 s",
            )
            assert proc.poll() is None, f"the tray exited early: {proc.communicate()[1][-2000:]}"
            proc.send_signal(signal.SIGTERM)
        for proc, paths in batch:
            _, err = proc.communicate(timeout=180)
            done += 1
            bad = proc.returncode != 0 or any(s in err for s in FATAL)
            if bad or paths.runtime_file.exists():
                failures.append(f"quit {done}: exit {proc.returncode}\n{err[-2000:]}")
    assert done == QUITS
    assert not failures, f"{len(failures)} of {QUITS} quits were not clean:\n" + "\n".join(
        failures[:3]
    )


class Tray:
    """One `warmslot-tray` process; its stderr goes to a file that can be read while it runs."""

    def __init__(self, home: Path, name: str) -> None:
        self.err_path = home.parent / f"{name}.stderr"
        self._err: IO[str] = self.err_path.open("w")
        self.proc = subprocess.Popen(
            [*TRAY, "--dev-dir", str(home)],
            cwd=REPO,
            env=tray_env(),
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            text=True,
        )

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._err.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._err.close()


def instance_of(paths: Paths, tray: Tray, state: str) -> Instance | None:
    inst = running_instance(paths)
    ok = inst is not None and inst.pid == tray.proc.pid and inst.state == state
    return inst if ok else None


def test_relaunch_right_after_quit_ends_with_a_running_tray(
    tmp_path: Path, server_binary: Path, tiny_model: Path
) -> None:
    home = tmp_path / "home"
    paths = prepare(
        home,
        **{
            "server.binary": str(server_binary),
            "server.build": "off",  # never a build from here, whatever the machine
            "server.model": str(tiny_model),
            "server.slots": 2,
            "server.ctx_per_slot": 4096,
            "server.threads": 2,
            "server.cache_ram_mib": 256,
        },
    )
    trays = [Tray(home, "tray0")]
    answers: list[int] = []
    try:
        for cycle in range(RELAUNCHES):
            old = trays[-1]
            inst = wait_until(
                lambda t=old: instance_of(paths, t, "running") or t.proc.poll() is not None,
                120,
                interval=0.05,
                message=lambda t=old, c=cycle: f"cycle {c}: no running tray\n{t.err()[-3000:]}",
            )
            assert isinstance(inst, Instance), f"cycle {cycle}: the tray exited\n{old.err()}"
            url = f"http://127.0.0.1:{inst.port}/v1/chat/completions"
            # A session (llama-server starts for it): the quit has a conversation to save.
            warm = httpx.post(
                url,
                json=chat_body(f"cycle {cycle}: a session saved at Quit", max_tokens=2),
                headers={"x-session-id": f"quit-loop-{cycle}"},
                timeout=180,
            )
            assert warm.status_code == 200, warm.text
            held = HeldRequest(inst.port, "/v1/chat/completions", chat_body(f"cycle {cycle}"))
            assert held.continued
            old.proc.send_signal(signal.SIGTERM)
            wait_until(
                lambda t=old: instance_of(paths, t, "stopping"),
                60,
                interval=0.01,
                message=lambda t=old, c=cycle: f"cycle {c}: no stop began\n{t.err()[-3000:]}",
            )
            began = time.monotonic()
            new = Tray(home, f"tray{cycle + 1}")
            trays.append(new)
            assert time.monotonic() - began < 0.5
            # The new launch found the old one stopping, and waits for it.
            wait_until(
                lambda t=new: "is still stopping" in t.err() or t.proc.poll() is not None,
                120,
                interval=0.05,
            )
            assert new.proc.poll() is None, f"cycle {cycle}: the relaunch exited\n{new.err()}"
            status, headers, body = held.finish()
            answers.append(status)
            assert status == 200 or (status == 503 and "retry-after" in headers), body[:500]
            assert old.wait(180) == 0, old.err()[-3000:]
            assert "conversations at shutdown" in old.err()  # the save stage ran
            assert not any(s in old.err() for s in FATAL), old.err()[-3000:]
        last = trays[-1]
        wait_until(
            lambda: instance_of(paths, last, "running") or last.proc.poll() is not None,
            120,
            interval=0.05,
        )
        assert instance_of(paths, last, "running"), last.err()[-3000:]
        last.proc.send_signal(signal.SIGTERM)
        assert last.wait(180) == 0, last.err()[-3000:]
        for tray in trays:
            assert not any(s in tray.err() for s in FATAL), tray.err()[-3000:]
            assert "asked it to open-dashboard" not in tray.err()
    finally:
        for tray in trays:
            tray.kill()
    print(f"\nrequests under way at Quit, answered: {answers}")
