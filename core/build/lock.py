"""One build of the same inputs at a time, across processes.

Two Warmslot processes (a tray and a `warmslot serve`, a user's build and a test
session, several test runs) that need the same build id would otherwise compile the
same tree side by side — on a small machine each one then takes several times as long.
The first takes an exclusive lock on ``<builds_dir>/.<build id>.lock``; the others wait
for it (saying so in their progress) and then find its result in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here; builds of one id may overlap
    fcntl = None  # type: ignore[assignment]

POLL_S = 1.0  # how often a waiting build looks again (it waits for minutes, not ms)


def lock_path(builds_dir: Path, build_id: str) -> Path:
    return builds_dir / f".{build_id}.lock"


@contextlib.asynccontextmanager
async def build_lock(
    builds_dir: Path, build_id: str, waiting: Callable[[str], None]
) -> AsyncIterator[None]:
    """Hold the lock of `build_id` for the body; `waiting(text)` is called once when
    another process holds it. Cancelling the task while it waits stops the wait. The
    lock file is removed when the lock is let go."""
    if fcntl is None:
        yield
        return
    builds_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(builds_dir, build_id)
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not told:
                told = True
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                waiting(
                    "waiting for another build of the same inputs"
                    + (f" (process {holder})" if holder else "")
                )
            os.close(fd)
            await asyncio.sleep(POLL_S)
            continue
        # The holder before us removes the file as it lets go: a lock on a file that is
        # no longer at `path` locks nothing another process can see.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)  # lets go of the lock
