"""What a save leaves to check and to remember: the write journal (`WriteJournal`, saves in
flight, so a save that never finished is found and its partial file deleted), the check
of a file the server said it saved (`save_problem`), and the backoff after failed saves
(`SaveBackoff`). The retention (core.cache.retention) applies them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

import sqlite_utils
from sqlite_utils.db import Table

from core.cache.store import migrations
from core.status import BackoffRow

SAVE_BACKOFF_FIRST_S = 30.0  # after a failed save, the prefix is not saved again for this long,
SAVE_BACKOFF_MAX_S = 1800.0  # doubling per further failure up to this


# ---------------------------------------------------------------------------- journal
class JournalRow(TypedDict):
    """A save in flight (a row of ``state_writes``)."""

    filename: str
    identity: str  # the server identity whose directory it is written into
    started: float  # when it was begun (the journal's clock)


class WriteJournal:
    """Saves in flight: a row before the server is asked to write, removed when done.

    A row left behind (Warmslot or the server died mid-save) marks a file we
    wrote but never indexed: the retention sweep deletes it. The states index
    itself only ever gets rows for finished, hashed files.
    """

    def __init__(self, db: sqlite_utils.Database, clock: Callable[[], float]) -> None:
        self.db = db
        self.clock = clock
        migrations.apply(db)  # the cache index's (core.cache.store)

    @property
    def table(self) -> Table:
        return cast(Table, self.db["state_writes"])

    def begin(self, identity: str, filename: str) -> None:
        self.table.upsert(
            {"filename": filename, "identity": identity, "started": self.clock()}, pk="filename"
        )

    def end(self, filename: str) -> None:
        self.table.delete_where("filename = ?", [filename])

    @contextlib.contextmanager
    def writing(self, identity: str, filename: str) -> Iterator[None]:
        """Journal a save; the entry stays only if the block raises (or we die in it)."""
        self.begin(identity, filename)
        yield
        self.end(filename)

    def pending(self) -> list[JournalRow]:
        """The saves begun and not ended, oldest first."""
        return [
            JournalRow(
                filename=str(r["filename"]), identity=str(r["identity"]), started=r["started"]
            )
            for r in self.table.rows_where(order_by="started")
        ]


# ---------------------------------------------------------------------------- save checks
def save_problem(saved: Mapping[str, object], expected_tokens: int, path: Path) -> str | None:
    """What is wrong with a save the server answered with success, or None.

    `saved` is the server's answer (``n_saved``, and ``n_written`` on servers that report
    it), `path` the file it should have written. A disk that fills up can lose the last
    buffered bytes when the server closes the file, without an error: the size check
    catches that."""
    n_saved = saved.get("n_saved")
    if not isinstance(n_saved, int) or n_saved != expected_tokens:
        return f"the server saved {n_saved} tokens of the {expected_tokens}-token prefix"
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError as e:
        return f"the saved file cannot be read: {e}"
    if size is None:
        return f"the server reported saving {n_saved} tokens but left no file {path.name}"
    written = saved.get("n_written")
    if isinstance(written, int) and written > 0 and size != written:
        return f"the file holds {size} bytes but the server reported writing {written} (disk full?)"
    return None


# ---------------------------------------------------------------------------- save backoff
@dataclass
class _Backoff:
    failures: int
    until: float
    reason: str


class SaveBackoff:
    """Per-prefix backoff after failed saves: `first` seconds, doubling per failure up to
    `cap`, forgotten after a success. Keyed by prefix fingerprint."""

    def __init__(
        self,
        clock: Callable[[], float],
        first: float = SAVE_BACKOFF_FIRST_S,
        cap: float = SAVE_BACKOFF_MAX_S,
    ) -> None:
        self.clock = clock
        self.first = first
        self.cap = cap
        self._state: dict[str, _Backoff] = {}

    def allows(self, fp: str) -> bool:
        """Whether a save of this prefix may be tried now."""
        b = self._state.get(fp)
        return b is None or self.clock() >= b.until

    def failed(self, fp: str, reason: str) -> tuple[int, float]:
        """Record a failure; returns (failures in a row, seconds until the next try)."""
        prev = self._state.get(fp)
        n = (prev.failures if prev else 0) + 1
        delay = min(self.cap, self.first * 2 ** (n - 1))
        self._state[fp] = _Backoff(n, self.clock() + delay, reason)
        return n, delay

    def succeeded(self, fp: str) -> None:
        self._state.pop(fp, None)

    def status(self) -> list[BackoffRow]:
        """Prefixes whose saves are backing off now, for the cache status."""
        now = self.clock()
        return [
            {
                "fingerprint": fp[:16],
                "failures": b.failures,
                "retry_in_s": round(b.until - now, 1),
                "reason": b.reason,
            }
            for fp, b in self._state.items()
            if b.until > now
        ]
