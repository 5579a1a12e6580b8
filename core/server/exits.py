"""How a llama-server run ends: waiting for its exit, and the record of each exit."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import deque

from core.events import ServerExited
from core.machine import process
from core.status.server import ExitInfo

__all__ = ["CRASH_SIGNALS", "ExitLog", "wait_exited"]

log = logging.getLogger("warmslot.server")

# Signals that mean "the process crashed" rather than "it was asked to stop" (by name:
# Windows has no SIGBUS, and this module must import there).
CRASH_SIGNALS = frozenset(
    int(getattr(signal, name))
    for name in ("SIGSEGV", "SIGILL", "SIGBUS", "SIGFPE", "SIGABRT")
    if hasattr(signal, name)
)


async def wait_exited(proc: asyncio.subprocess.Process) -> int:
    """Wait for llama-server itself to exit; then kill what is left of its group.

    asyncio's ``wait()`` returns only once the process's pipes are closed, and a
    helper left in its process group can hold stdout open for ever: a crash would
    then go unnoticed and a stop would wait out its grace period. So watch the
    process's own exit status, kill the rest of the group (orphans by now), and
    only then collect the pipes.
    """
    await process.wait_exit(proc)
    process.kill_leftovers(proc.pid)
    return await proc.wait()


class ExitLog:
    """The last 50 exits of one supervisor's runs (the newest last)."""

    def __init__(self) -> None:
        self.records: deque[ServerExited] = deque(maxlen=50)

    def record(
        self,
        run_id: str,
        pid: int,
        outcome: str,
        requested_by: str,
        code: int | None,
        last_lines: tuple[str, ...],
    ) -> ServerExited:
        """Log and keep one exit (`outcome`: requested | crashed | start_failed); the
        event to emit."""
        sig = -code if code is not None and code < 0 else None
        event = ServerExited(
            run_id=run_id,
            pid=pid,
            returncode=code,
            signal=sig,
            outcome=outcome,
            requested_by=requested_by,
            last_lines=last_lines,
        )
        self.records.append(event)
        log.log(
            logging.INFO if outcome == "requested" else logging.WARNING,
            "llama-server run %s exited: %s (code %s, signal %s, by %s)",
            run_id,
            outcome,
            code,
            sig,
            requested_by,
        )
        return event

    def rows(self) -> list[ExitInfo]:
        """For status displays: each exit with its last 5 lines."""
        return [
            {
                "ts": e.ts,
                "outcome": e.outcome,
                "returncode": e.returncode,
                "signal": e.signal,
                "requested_by": e.requested_by,
                "last_lines": list(e.last_lines[-5:]),
            }
            for e in self.records
        ]
