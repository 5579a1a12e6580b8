"""Opening Warmslot's SQLite files so that an unusable one never stops the core.

A user meets a database file that cannot be used in a handful of ways: cut short
(a full disk, a copy that stopped), emptied, not a database at all, locked by
another process, a directory in its place, read-only (the file or its folder).
`open_or_recover` opens a file with the caller's `open_db`, which must raise when
the file is unusable (see `connect`: it checks that the file can be written).
When it does, the file — with its ``-wal``, ``-shm`` and ``-journal`` companions,
so that the moved copy still opens as it was — is renamed
``<name>.broken-<YYYYmmdd-HHMMSS>`` and a fresh database is made in its place;
where even that fails (a read-only folder, a file that cannot be renamed), an
in-memory database serves this run. What happened comes back as a `Recovery`,
in words a user understands (docs/cache.md#where-state-lives).

SQLite itself notices a truncated file when it opens it (the page count in its
header is past the end of the file) and a file that is not a database (its
header), so no full integrity check is needed for that; callers whose file must
be checked row by row (the cache index) run ``PRAGMA quick_check`` in `open_db`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = [
    "BUSY_TIMEOUT_S",
    "COMPANIONS",
    "Recovery",
    "connect",
    "move_aside",
    "open_or_recover",
    "problem_of",
]

T = TypeVar("T")

# How long a statement waits for another connection's lock. The writer runs on the core
# thread, whose loop serves every request: a lock held by someone else must cost it
# about a second, never the five of sqlite3's default.
BUSY_TIMEOUT_S = 1.0
COMPANIONS = ("-wal", "-shm", "-journal")  # SQLite's files beside a database


def connect(path: Path | str, *, wal: bool = True) -> sqlite3.Connection:
    """A connection to `path` in autocommit mode (WAL, synchronous NORMAL), proven
    writable: raises `sqlite3.Error` (or OSError) when the file is damaged, locked by
    another process, read-only or not a database at all.

    A database in WAL mode lets another process hold a write lock while this one
    opens it and reads; the write check (``BEGIN IMMEDIATE``) finds that at once
    instead of at the first write, and a write rolled back finds a file that SQLite could
    open only for reading."""
    conn = sqlite3.connect(str(path), isolation_level=None, timeout=BUSY_TIMEOUT_S)
    try:
        if wal and str(path) != ":memory:":
            mode = conn.execute("PRAGMA journal_mode=wal").fetchone()
            if mode is None or str(mode[0]).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot use WAL (journal mode {mode!r})")
        conn.execute("PRAGMA synchronous=NORMAL")
        # A real write, rolled back: a file SQLite could open only for reading (read-only,
        # immutable) takes a write lock but refuses the write itself.
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(f"PRAGMA user_version = {version}")
        finally:
            conn.execute("ROLLBACK")
    except BaseException:
        conn.close()
        raise
    return conn


def problem_of(err: BaseException, path: Path) -> str:
    """What is wrong with the database file at `path`, in words, from what opening it raised."""
    text = str(err) or type(err).__name__
    low = text.lower()
    if path.is_dir():
        return "a directory is in its place"
    if "not a database" in low:
        return f"it is not a SQLite database ({text})"
    if "malformed" in low or "corrupt" in low or "integrity" in low:
        return f"it is damaged or cut short ({text})"
    if "locked" in low or "busy" in low:
        return f"another process holds a lock on it ({text})"
    if "readonly" in low or "read-only" in low or isinstance(err, PermissionError):
        return f"it cannot be written ({text})"
    if "unable to open" in low and not os.access(path.parent, os.W_OK):
        return f"its folder cannot be written ({text})"
    return text


def move_aside(path: Path, now: float | None = None) -> Path:
    """Rename `path` (and its companions) to ``<name>.broken-<time>``; returns the new
    path. Raises OSError when the database file itself cannot be renamed."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    target = path.with_name(f"{path.name}.broken-{stamp}")
    n = 1
    while target.exists() or any(Path(f"{target}{c}").exists() for c in COMPANIONS):
        target = path.with_name(f"{path.name}.broken-{stamp}-{n}")
        n += 1
    path.rename(target)
    for suffix in COMPANIONS:
        companion = Path(f"{path}{suffix}")
        # A companion left behind would be read as the fresh database's own.
        with contextlib.suppress(FileNotFoundError):
            try:
                companion.rename(Path(f"{target}{suffix}"))
            except OSError:
                companion.unlink()
    return target


@dataclass(frozen=True)
class Recovery:
    """What `open_or_recover` did about a database file that could not be used."""

    what: str  # "history database", "cache index"
    path: Path
    problem: str  # what was wrong with it, in words
    moved_to: Path | None = None  # where it went (None: left where it was)
    in_memory: bool = False  # this run keeps the database in memory (lost at exit)
    fresh_problem: str = ""  # why no fresh file could be made in its place

    def text(self) -> str:
        """One sentence for a Notice and the log."""
        head = f"the {self.what} {self.path} could not be used: {self.problem}"
        if not self.in_memory:
            if self.moved_to is None:
                return f"{head}; started a fresh one in its place"
            return f"{head}; moved it to {self.moved_to.name} and started a fresh one"
        moved = f"; moved it to {self.moved_to.name}" if self.moved_to is not None else ""
        why = f" (no fresh file: {self.fresh_problem})" if self.fresh_problem else ""
        return f"{head}{moved}; this run keeps the {self.what} in memory{why}, lost when it stops"


def open_or_recover(
    path: Path,
    open_db: Callable[[Path | str], T],
    *,
    what: str,
    clock: Callable[[], float] = time.time,
) -> tuple[T, Recovery | None]:
    """`open_db(path)`, or — when that raises — the same on a fresh file after moving the
    unusable one aside, or on ``":memory:"`` when no file can be made. Returns the opened
    value and what was done (None: the file was fine).

    `open_db` must raise `sqlite3.Error` or OSError for an unusable file and must not
    leave it open when it does. An empty (0-byte) file is a fresh database to SQLite;
    it is used in place and reported, since history or state was expected there."""
    problem = ""
    if path.is_dir():
        problem = "a directory is in its place"
    else:
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0 and not any(
                Path(f"{path}{c}").exists() for c in COMPANIONS
            ):
                problem = "the file was empty (0 bytes)"
        try:
            opened = open_db(path)
        except (sqlite3.Error, OSError) as e:
            problem = problem_of(e, path)
        else:
            if not problem:
                return opened, None
            return opened, Recovery(what, path, problem)
    try:
        moved: Path | None = move_aside(path, clock())
    except OSError as e:
        moved, fresh = None, f"it cannot be moved aside: {e.strerror or e}"
    else:
        try:
            return open_db(path), Recovery(what, path, problem, moved_to=moved)
        except (sqlite3.Error, OSError) as e:
            fresh = problem_of(e, path)
    return open_db(":memory:"), Recovery(
        what, path, problem, moved_to=moved, in_memory=True, fresh_problem=fresh
    )
