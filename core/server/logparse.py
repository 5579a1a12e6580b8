"""Parsing llama-server's output lines: pure functions, tested on recorded logs.

Current builds print ``0.08.050.345 I slot get_availabl: id  1 | task -1 | ...``:
a timestamp, a level letter, an area and the text. Older builds print bare text.
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
