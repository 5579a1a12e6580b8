"""Quitting the tray, many times over: every exit is clean (issue 18 saw "Fatal Python
error: bool_dealloc" in one quit of ten). Real `warmslot-tray` processes, offscreen,
each with its own home; SIGTERM once its core is up (the same path as the menu's Quit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.app.conftest import prepare
from tests.helpers import REPO, wait_until

QUITS = int(os.environ.get("WARMSLOT_QUIT_LOOP", "50"))
AT_ONCE = 4  # tray processes alive together (each is mostly waiting on Qt's import)
TRAY = [sys.executable, "-c", "import sys, app.main; sys.exit(app.main.main())"]


def test_fifty_quits_all_clean(tmp_path: Path) -> None:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONFAULTHANDLER": "1"}
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
                env=env,
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
            _, err = proc.communicate(timeout=120)
            done += 1
            bad = proc.returncode != 0 or any(
                s in err for s in ("Fatal Python error", "Traceback", "Segmentation fault")
            )
            if bad or paths.runtime_file.exists():
                failures.append(f"quit {done}: exit {proc.returncode}\n{err[-2000:]}")
    assert done == QUITS
    assert not failures, f"{len(failures)} of {QUITS} quits were not clean:\n" + "\n".join(
        failures[:3]
    )

