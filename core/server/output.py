"""Reading one llama-server's output: the tail kept in memory, the log file, the events.

Its output is always read, whatever it holds, in chunks cut into bounded lines
(`logparse.LineSplitter`), never with ``readline``, whose 64 KiB limit one long line
overruns; a line that cannot be handled (a full disk under the log file, a failing
subscriber) is counted and skipped, never the rest: output nobody reads blocks
llama-server in its logger (docs/llama-server-facts.md#a-long-log-line-wedged-the-server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path

from core.events import Event, LogLine
from core.server import logparse
from core.server.logfile import ServerLogFile

__all__ = ["LOG_TAIL_LINES", "PUMP_CHUNK_BYTES", "ServerOutput"]

log = logging.getLogger("warmslot.server")

LOG_TAIL_LINES = 2000
PUMP_CHUNK_BYTES = 64 * 1024  # llama-server's output is read this much at a time at most


class ServerOutput:
    """The output of one supervisor's runs, one after another. Runs on the core's loop."""

    def __init__(self, log_path: Path, emit: Callable[[Event], None]) -> None:
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._emit = emit
        self._logfile = ServerLogFile(log_path)
        self._lines_total = 0  # output lines read, over all runs
        self._run_first_line = 0  # `_lines_total` when the current run was launched
        self._line_failures = 0  # output lines that could not be logged or emitted

    def run_started(self, note: str) -> None:
        """A new run begins: `note` goes into the log file (a log that cannot be written,
        a full disk, does not stop the launch), and `run_lines` counts from here."""
        with contextlib.suppress(OSError, ValueError):
            self._logfile.write([note])
        self._run_first_line = self._lines_total

    def run_lines(self) -> list[str]:
        """The current run's output (as much of it as the tail holds): an abort's backtrace
        can push its one telling line far up, and an older run's must not count."""
        n = min(self._lines_total - self._run_first_line, len(self.tail))
        return list(self.tail)[-n:] if n > 0 else []

    async def pump(self, proc: asyncio.subprocess.Process) -> None:
        """Read `proc`'s output until it closes, whatever it holds."""
        assert proc.stdout is not None
        splitter = logparse.LineSplitter()
        while True:
            try:
                chunk = await proc.stdout.read(PUMP_CHUNK_BYTES)
            except (OSError, ValueError):  # the pipe broke: nothing more to read
                chunk = b""
            self._take_lines(splitter.feed(chunk) if chunk else splitter.close())
            if not chunk:
                break

    def close(self) -> None:
        self._logfile.close()

    def _take_lines(self, lines: list[str]) -> None:
        """Output lines into the tail, the log file (one write for all) and a `LogLine`
        event each. A line that cannot be handled is counted and skipped, never the rest."""
        if not lines:
            return
        self.tail.extend(lines)
        self._lines_total += len(lines)
        try:
            self._logfile.write(lines)
        except (OSError, ValueError):  # a full disk under the log: the events still go
            self._line_failed()
        for line in lines:
            try:
                parsed = logparse.parse_line(line)
                self._emit(
                    LogLine(level=parsed.level, area=parsed.area, text=parsed.text, raw=line)
                )
            except Exception:
                self._line_failed()

    def _line_failed(self) -> None:
        self._line_failures += 1
        if self._line_failures == 1:  # once: the next one would be as loud
            log.exception("could not handle a line of llama-server's output; reading on")
