"""llama-server's output file: every line it prints, one run after another, rotated by size.

``llama-server.log``, then ``.1`` … ``.KEEP`` (oldest last), each at most `max_bytes`.
The supervisor writes each chunk of output it reads as one write (`write`), so a
request's half a dozen log lines cost one system call, not a `logging` record, a
formatter and two ``stat`` calls each (`logging.handlers.RotatingFileHandler` checks
the file before every line): that was a quarter of the core thread's busy time at
steady state (docs/benchmarks.md#proxy-overhead-warmslot-bench-overhead).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

__all__ = ["KEEP", "MAX_BYTES", "ServerLogFile"]

MAX_BYTES = 10 << 20
KEEP = 3


class ServerLogFile:
    """Appends lines to `path`, rotating it by size; not thread-safe (the core's loop)."""

    def __init__(self, path: Path, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._file: TextIO | None = None
        self._size = 0

    def write(self, lines: Iterable[str]) -> None:
        """Append `lines` as printed (a byte that is not UTF-8 becomes "?"), rotating
        first where the next line would pass `max_bytes`; then flush once."""
        f = self._open()
        for line in lines:
            data = line.encode("utf-8", "replace") + b"\n"
            if self._size and self._size + len(data) > self.max_bytes:
                f = self._rotate()
            f.write(data.decode("utf-8"))
            self._size += len(data)
        f.flush()

    def close(self) -> None:
        """Close the file (the next `write` opens it again)."""
        if self._file is not None:
            with contextlib.suppress(OSError, ValueError):
                self._file.close()
            self._file = None

    def _open(self) -> TextIO:
        if self._file is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", newline="\n")
            self._size = self._file.tell()
        return self._file

    def _rotate(self) -> TextIO:
        self.close()
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        return self._open()
