"""Build output: running cmake steps, the build log, progress and the tail for errors.

Pure functions and small stateful helpers, tested against recorded output of a real
llama.cpp build (``tests/fixtures/build_output.txt``). Two line shapes carry progress:

* the Makefile generator: ``[ 42%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o``
* Ninja: ``[12/345] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o``

Everything else (compiler warnings, cmake's ``--`` status lines) is kept in the log but
does not move the bar.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from core.errors import BuildError
from core.machine import process

__all__ = [
    "BuildCancelled",
    "BuildLog",
    "LogTail",
    "ProgressLine",
    "ProgressTracker",
    "describe_step",
    "estimate_eta",
    "parse_progress_line",
    "run_step",
    "terminate_group",
]

# Ninja's default status is "[%f/%t] " (finished/total edges); users may set NINJA_STATUS,
# but cmake's own invocation keeps the default.
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*\S)\s*$")
# make prints a right-aligned percentage: "[  3%]", "[ 42%]", "[100%]".
_MAKE = re.compile(r"^\[\s*(\d{1,3})%\]\s+(.*\S)\s*$")
# "…/CMakeFiles/<target>.dir/<path>" → "<target>: <path>" reads better in a one-line bar.
_OBJ = re.compile(r"(?:\S+/)?CMakeFiles/([^/\s]+)\.dir/(\S+?)(?:\.o|\.obj)?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_KILL_GRACE_S = 5.0


class BuildCancelled(BuildError):
    """The build was cancelled; nothing was left in the build cache."""


@dataclass(frozen=True)
class ProgressLine:
    """A build-output line that reports progress: 0..100 and what is being done."""

    percent: float
    step: str
    done: int = 0  # build steps finished (ninja's [done/total]; 0 when unknown)
    total: int = 0


def parse_progress_line(line: str) -> ProgressLine | None:
    """Parse one line of make or ninja output; None when it carries no progress."""
    text = _ANSI.sub("", line).strip()
    m = _NINJA.match(text)
    if m:
        done, total = int(m.group(1)), int(m.group(2))
        if total <= 0:
            return None
        return ProgressLine(min(100.0, 100.0 * done / total), m.group(3), done, total)
    m = _MAKE.match(text)
    if m:
        return ProgressLine(float(min(100, int(m.group(1)))), m.group(2))
    return None


def estimate_eta(elapsed_s: float, percent: float, previous_s: float | None) -> float | None:
    """Seconds left in a build: from the last build's duration until a quarter is done
    (the first steps are quick configure and small files), then from this build's own
    pace. None when neither is known yet."""
    if percent >= 25.0 or (previous_s is None and percent >= 3.0):
        return max(0.0, elapsed_s * (100.0 - percent) / percent)
    if previous_s is not None:
        return max(0.0, previous_s - elapsed_s)
    return None


def describe_step(step: str) -> str:
    """Shorten a build step for display: drop cmake's ``CMakeFiles/x.dir`` noise.

    ``Building CXX object src/CMakeFiles/llama.dir/llama-model.cpp.o`` becomes
    ``Building CXX object llama: llama-model.cpp``.
    """
    words = step.split(" ")
    if words:
        m = _OBJ.search(words[-1])
        if m:
            words[-1] = f"{m.group(1)}: {m.group(2)}"
    return " ".join(words)


class ProgressTracker:
    """Turns a stream of output lines into monotonic (percent, step) updates.

    Make's percentages are per target and can step back when cmake moves to the next
    target; a bar that jumps backwards looks broken, so the percentage never decreases.
    """

    def __init__(self) -> None:
        self.percent = 0.0
        self.step = ""

    def feed(self, line: str) -> ProgressLine | None:
        """Take one output line; return the new state when it moved the bar."""
        parsed = parse_progress_line(line)
        if parsed is None:
            return None
        self.percent = max(self.percent, parsed.percent)
        self.step = describe_step(parsed.step)
        return ProgressLine(self.percent, self.step, parsed.done, parsed.total)


class LogTail:
    """The last `size` lines of a build, and the first compiler/cmake error seen.

    Used for the message of a failed build: the first error is usually the cause,
    the tail shows where the build stopped.
    """

    # A compiler's or cmake's own error line names the cause; make/ninja's "FAILED:" and
    # "***" lines only say which step failed, so they are the fallback.
    _ERROR = re.compile(r"(\berror\b|CMake Error)", re.IGNORECASE)
    _STEP_FAILED = re.compile(r"(^FAILED:|\*\*\*)")

    def __init__(self, size: int = 40) -> None:
        self.lines: deque[str] = deque(maxlen=size)
        self._error: str | None = None
        self._failed_step: str | None = None

    @property
    def first_error(self) -> str | None:
        """The first error line seen (compiler/cmake errors before make/ninja's)."""
        return self._error or self._failed_step

    def add(self, line: str) -> None:
        """Remember one line (without its newline)."""
        line = _ANSI.sub("", line.rstrip("\r\n"))
        self.lines.append(line)
        if "warning" in line.lower():
            return
        if self._error is None and self._ERROR.search(line):
            self._error = line.strip()
        elif self._failed_step is None and self._STEP_FAILED.search(line):
            self._failed_step = line.strip()

    def extend(self, lines: Iterable[str]) -> None:
        """Remember several lines."""
        for line in lines:
            self.add(line)

    def text(self, n: int | None = None) -> str:
        """The last `n` (default: all kept) lines joined with newlines."""
        lines = list(self.lines)
        if n is not None:
            lines = lines[-n:]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- the log file


class BuildLog:
    """The build's log file; lines written before the file exists are kept until then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._file: TextIO | None = None
        self.path: Path | None = None
        self.tail = LogTail()

    def open(self, path: Path) -> None:
        """Start writing to `path`, beginning with the lines kept so far."""
        with self._lock:
            self._file = path.open("w", encoding="utf-8", errors="replace")
            self.path = path
            self._file.writelines(self._pending)
            self._file.flush()
            self._pending.clear()

    def note(self, msg: str) -> None:
        """Write one of Warmslot's own lines (timestamped, ``==`` marks it apart)."""
        self.write(f"== {time.strftime('%H:%M:%S')} {msg}")

    def write(self, line: str) -> None:
        """Write one line of tool output."""
        line = line.rstrip("\r\n")
        self.tail.add(line)
        with self._lock:
            if self._file is None:
                self._pending.append(line + "\n")
            else:
                self._file.write(line + "\n")

    def close(self) -> None:
        """Close the file; later lines are kept in memory until `open` or `keep_at`."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def keep_at(self, dest: Path) -> Path | None:
        """Move the log to `dest` (out of a temp dir about to be deleted); later lines are
        appended there. Returns `dest`, or None if it cannot be written."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                if self.path is not None and self.path != dest and self.path.exists():
                    shutil.move(self.path, dest)
                self.path = dest
                self._file = dest.open("a", encoding="utf-8", errors="replace")
                self._file.writelines(self._pending)
                self._file.flush()
                self._pending.clear()
            except OSError:
                return None
            return dest


# ---------------------------------------------------------------------------- running steps


async def terminate_group(proc: asyncio.subprocess.Process) -> None:
    """Kill cmake and everything it started (its own process group or tree)."""
    # Compilers may outlive make/ninja for a moment; stop_group finishes them off.
    await process.stop_group(proc, _KILL_GRACE_S)
    with contextlib.suppress(TimeoutError):
        # Collect the pipes too; a grandchild out of reach may still hold them.
        await asyncio.wait_for(proc.wait(), _KILL_GRACE_S)


# Build steps running now (their group/session leaders). A Python that exits without
# cancelling its build (an exception in the owner, sys.exit) must not leave cmake and
# ninja compiling: the atexit hook kills what is left. A SIGKILLed Python runs no hook;
# then the step's watch (`process.spawn`) stops its group and the next build sweeps
# the folder.
_LIVE_STEPS: set[int] = set()


@atexit.register
def _kill_live_steps() -> None:
    for pid in list(_LIVE_STEPS):
        process.kill_group(pid)
    _LIVE_STEPS.clear()


async def run_step(
    cmd: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    blog: BuildLog,
    cancel: asyncio.Event | None,
    on_line: Callable[[str], None] | None = None,
) -> int:
    """Run one command in its own process group, streaming its output to the log."""
    blog.note("$ " + " ".join(cmd))
    try:
        proc = await process.spawn(cmd, cwd=cwd, env=env, limit=1 << 20)
    except FileNotFoundError as e:
        raise BuildError(
            f"{cmd[0]} is not installed", hint="Install CMake (3.14 or newer) and a C/C++ compiler."
        ) from e
    assert proc.stdout is not None
    stdout = proc.stdout
    _LIVE_STEPS.add(proc.pid)

    async def pump() -> None:
        while True:
            try:
                raw = await stdout.readline()
            except ValueError:  # a line longer than the limit: take what is there
                raw = await stdout.read(1 << 20)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            blog.write(line)
            if on_line is not None:
                on_line(line)

    reader = asyncio.create_task(pump())
    waiter = asyncio.create_task(proc.wait())
    stopper = asyncio.create_task(cancel.wait()) if cancel is not None else None
    try:
        waits: set[asyncio.Future[Any]] = {waiter}
        if stopper is not None:
            waits.add(stopper)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            raise BuildCancelled("Build cancelled")  # its group is killed just below
        with contextlib.suppress(TimeoutError):
            # Grandchildren may hold the pipe open; the exit code is what counts.
            await asyncio.wait_for(asyncio.shield(reader), 10)
        return waiter.result()
    except BaseException:
        # Cancelled (by the event, the task, or a signal to `warmslot build`), or failed
        # while it runs: nothing the step started may outlive it. Shielded, so that a
        # second cancel cannot cut the kill short.
        await asyncio.shield(terminate_group(proc))
        raise
    finally:
        # Whatever is left of its group goes too (none of it may outlive the step), and
        # its watch leaves.
        process.kill_leftovers(proc.pid)
        _LIVE_STEPS.discard(proc.pid)
        for t in (reader, waiter, stopper):
            if t is not None and not t.done():
                t.cancel()
