"""Reading cmake / make / ninja output: progress, current step, and the tail for errors.

Pure functions and small stateful helpers, tested against recorded output of a real
llama.cpp build (``tests/fixtures/build_output.txt``). Two line shapes carry progress:

* the Makefile generator: ``[ 42%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o``
* Ninja: ``[12/345] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o``

Everything else (compiler warnings, cmake's ``--`` status lines) is kept in the log but
does not move the bar.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "LogTail",
    "ProgressLine",
    "ProgressTracker",
    "describe_step",
    "parse_progress_line",
]

# Ninja's default status is "[%f/%t] " (finished/total edges); users may set NINJA_STATUS,
# but cmake's own invocation keeps the default.
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*\S)\s*$")
# make prints a right-aligned percentage: "[  3%]", "[ 42%]", "[100%]".
_MAKE = re.compile(r"^\[\s*(\d{1,3})%\]\s+(.*\S)\s*$")
# "…/CMakeFiles/<target>.dir/<path>" → "<target>: <path>" reads better in a one-line bar.
_OBJ = re.compile(r"(?:\S+/)?CMakeFiles/([^/\s]+)\.dir/(\S+?)(?:\.o|\.obj)?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class ProgressLine:
    """A build-output line that reports progress: 0..100 and what is being done."""

    percent: float
    step: str


def parse_progress_line(line: str) -> ProgressLine | None:
    """Parse one line of make or ninja output; None when it carries no progress."""
    text = _ANSI.sub("", line).strip()
    m = _NINJA.match(text)
    if m:
        done, total = int(m.group(1)), int(m.group(2))
        if total <= 0:
            return None
        return ProgressLine(min(100.0, 100.0 * done / total), m.group(3))
    m = _MAKE.match(text)
    if m:
        return ProgressLine(float(min(100, int(m.group(1)))), m.group(2))
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
        return ProgressLine(self.percent, self.step)


class LogTail:
    """The last `size` lines of a build, and the first compiler/cmake error seen.

    Used for the message of a failed build: the first error is usually the cause,
    the tail shows where the build stopped.
    """

    _ERROR = re.compile(r"(\berror\b|CMake Error|FAILED:|\*\*\*)", re.IGNORECASE)

    def __init__(self, size: int = 40) -> None:
        self.lines: deque[str] = deque(maxlen=size)
        self.first_error: str | None = None

    def add(self, line: str) -> None:
        """Remember one line (without its newline)."""
        line = _ANSI.sub("", line.rstrip("\r\n"))
        self.lines.append(line)
        if self.first_error is None and self._ERROR.search(line) and "warning" not in line:
            self.first_error = line.strip()

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
