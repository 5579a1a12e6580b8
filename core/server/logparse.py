"""Parsing llama-server's output lines: pure functions, tested on recorded logs.

Current builds print ``0.08.050.345 I slot get_availabl: id  1 | task -1 | ...``:
a timestamp, a level letter, an area and the text. Older builds print bare text.

`LineSplitter` cuts the raw output into lines of bounded length. A reader that waits
for whole lines (asyncio's ``readline``, 64 KiB at most) dies on one longer line, and
llama-server prints what a request gave it: a 145 KB invalid grammar is one line. With
its output no longer read, llama-server blocks in its logger once the pipe and its
512-entry log queue are full, and every request hangs
(docs/llama-server-facts.md#a-long-log-line-wedged-the-server).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_RE = re.compile(r"^(?P<t>\d+\.\d+\.\d+\.\d+) (?P<lvl>[IWEDT]) (?P<area>\S+)\s+(?P<text>.*)$")
_LEVELS = {"I": "info", "W": "warning", "E": "error", "D": "debug", "T": "trace"}

_LISTENING_RE = re.compile(r"listening on https?://(?P<host>[^:/\s]+):(?P<port>\d+)")
_SLOTS_RE = re.compile(
    r"n_slots = (?P<n>\d+), n_ctx_slot = (?P<ctx>\d+), kv_unified = '(?P<u>\w+)'"
)
_TIMING_RE = re.compile(
    r"id\s+(?P<slot>\d+) \| task (?P<task>-?\d+) \| prompt eval time =\s*"
    r"(?P<ms>[\d.]+) ms /\s*(?P<n>\d+) tokens"
)
_ERROR_HINTS = (
    ("failed to load model", "the model file could not be loaded"),
    ("address already in use", "the port is taken"),
    ("couldn't bind", "the port is taken"),
    ("error: invalid argument", "an unknown command-line flag"),
    ("out of memory", "out of memory"),
    ("failed to allocate", "out of memory"),
)


# A longer output line keeps its first this many bytes and says how many were cut.
MAX_LINE_BYTES = 16 * 1024


def cut_marker(n: int) -> str:
    """What ends a line that was cut: how many bytes of it were dropped."""
    return f" … [{n} more bytes cut by Warmslot]"


class LineSplitter:
    """Raw output in, whole lines out: `feed` chunks as they come, `close` at the end.

    Holds at most `max_bytes` of the line being read; the rest of a longer line is
    counted and dropped, and the line is handed on with `cut_marker` at its end. Never
    raises, whatever the bytes.
    """

    def __init__(self, max_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._cut = 0  # bytes of the current line dropped so far

    def feed(self, chunk: bytes) -> list[str]:
        """The lines `chunk` completes (without their line ends)."""
        out: list[str] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            room = self.max_bytes - len(self._buf)
            if len(piece) > room:
                self._buf += piece[: max(room, 0)]
                self._cut += len(piece) - max(room, 0)
            else:
                self._buf += piece
            if end < 0:
                return out
            out.append(self._take())
            start = end + 1

    def close(self) -> list[str]:
        """The last line when the output did not end with a line end."""
        return [self._take()] if self._buf or self._cut else []

    def _take(self) -> str:
        line = self._buf.decode("utf-8", errors="replace").rstrip("\r")
        if self._cut:
            line += cut_marker(self._cut)
        self._buf = bytearray()
        self._cut = 0
        return line


@dataclass(frozen=True)
class ParsedLine:
    level: str
    area: str
    text: str
    raw: str


@dataclass(frozen=True)
class Listening:
    host: str
    port: int


@dataclass(frozen=True)
class SlotsInfo:
    n_slots: int
    n_ctx_slot: int
    kv_unified: bool


@dataclass(frozen=True)
class PromptTiming:
    slot: int
    task: int
    prompt_ms: float
    prompt_tokens: int


def parse_line(raw: str) -> ParsedLine:
    """Split one output line into level, area and text."""
    line = raw.rstrip("\r\n")
    m = _LINE_RE.match(line)
    if m is None:
        lower = line.lower()
        level = "error" if lower.startswith("error") or " error" in lower[:40] else "info"
        return ParsedLine(level=level, area="", text=line, raw=line)
    return ParsedLine(level=_LEVELS[m["lvl"]], area=m["area"], text=m["text"].strip(), raw=line)


def listening(text: str) -> Listening | None:
    m = _LISTENING_RE.search(text)
    return Listening(m["host"], int(m["port"])) if m else None


def slots_info(text: str) -> SlotsInfo | None:
    m = _SLOTS_RE.search(text)
    return SlotsInfo(int(m["n"]), int(m["ctx"]), m["u"] == "true") if m else None


def prompt_timing(text: str) -> PromptTiming | None:
    m = _TIMING_RE.search(text)
    if m is None:
        return None
    return PromptTiming(int(m["slot"]), int(m["task"]), float(m["ms"]), int(m["n"]))


def failure_reason(lines: list[str]) -> str:
    """A one-line reason for a failed start, from the last lines of output."""
    for line in reversed(lines):
        lower = line.lower()
        for needle, reason in _ERROR_HINTS:
            if needle in lower:
                return f"{reason}: {parse_line(line).text}"
    for line in reversed(lines):
        parsed = parse_line(line)
        if parsed.level == "error":
            return parsed.text
    # Under load llama-server can exit before its log thread writes the error (seen
    # with a corrupt model): say so rather than pass off its last line as the reason.
    if not lines:
        return "it exited without any output"
    return f"it exited without an error message (last line: {parse_line(lines[-1]).text})"


def crash_cause(lines: list[str]) -> str:
    """Why llama-server stopped, in words, from its last output lines ("" when they do
    not say): the reason only, never a raw log line (the log keeps those)."""
    for line in reversed(lines):
        lower = line.lower()
        for needle, reason in _ERROR_HINTS:
            if needle in lower:
                return reason
        if "ggml_assert" in lower or "assertion" in lower:
            return "an internal check of llama.cpp failed"
    return ""
