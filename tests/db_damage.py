"""The ways a user meets a database file Warmslot cannot use, made on demand for tests.

`damaged(path, way)` damages the (closed) SQLite file at `path` one way and undoes
what must be undone afterwards (a lock's holder is stopped, an immutable flag
cleared), so that pytest can remove the folder:

- ``truncated``: cut to half its size (a full disk, a copy that stopped);
- ``zero-length``: emptied;
- ``not-a-database``: text in its place;
- ``locked``: another process holds an exclusive lock on it for the whole block;
- ``directory``: a directory in its place;
- ``read-only-file`` / ``read-only-folder``: the file, or the folder that holds it,
  cannot be written (as root, where permissions do not stop writes, the immutable
  flag does it; where neither works the test is skipped: it cannot be made here);
- ``garbage-rows``: rows no version of Warmslot writes (text where numbers and
  JSON belong) in the history's tables.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

WAYS = (
    "truncated",
    "zero-length",
    "not-a-database",
    "locked",
    "directory",
    "read-only-file",
    "read-only-folder",
    "garbage-rows",
)
COMPANIONS = ("-wal", "-shm", "-journal")

_LOCKER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA locking_mode=EXCLUSIVE")
conn.execute("BEGIN EXCLUSIVE")
conn.execute("CREATE TABLE IF NOT EXISTS _held (x)")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def _companions(path: Path) -> list[Path]:
    return [Path(f"{path}{c}") for c in COMPANIONS]


def _drop_companions(path: Path) -> None:
    for p in _companions(path):
        p.unlink(missing_ok=True)


def garbage_rows(path: Path) -> None:
    """Rows no version writes, in the history's tables: text where numbers belong (times
    too), broken JSON, NULL where text belongs. Times are long past (1970) or text."""
    with contextlib.closing(sqlite3.connect(path)) as c, c:
        events = "INSERT INTO events (ts, category, kind, reason, details) VALUES (?, ?, ?, ?, ?)"
        c.execute(events, [1000.0, "cache", "restore_ok", None, "{not json"])
        c.execute(events, ["yesterday", "cache", "restore_ok", 7, "[]"])
        requests = (
            "INSERT INTO requests (ts, client, session, prompt_n, cache_n, total_ms, endpoint)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)"
        )
        c.execute(requests, [1000.0, None, 42, "many", "some", "slow", "chat"])
        c.execute(requests, ["garbage", "x", "y", 1, 2, 3.0, "chat"])
        runs = "INSERT INTO server_runs (run_id, started, argv, last_lines) VALUES (?, ?, ?, ?)"
        c.execute(runs, ["garbage", 1000.0, "[broken", "{"])
        c.execute(runs, ["text-start", "noon", "[]", "[]"])
        c.execute(
            "INSERT INTO pressure (ts, level, gpus) VALUES (?, ?, ?)", [1000.0, "weird", "nope"]
        )


def _set_immutable(path: Path, on: bool) -> bool:
    try:
        done = subprocess.run(
            ["chattr", "+i" if on else "-i", str(path)], capture_output=True, check=False
        )
    except OSError:
        return False
    return done.returncode == 0


@contextlib.contextmanager
def _read_only(target: Path, probe: Path) -> Iterator[None]:
    """`target` (a file or folder) made read-only; `probe` is a path whose creation or
    writing must fail then. Skips the test where that cannot be made."""
    mode = target.stat().st_mode
    target.chmod(0o555 if target.is_dir() else 0o444)
    immutable = False
    try:
        if _writable(probe):  # root: permissions do not stop a write
            immutable = _set_immutable(target, True)
            if not immutable or _writable(probe):
                pytest.skip(f"cannot make {target} read-only on this machine")
        yield
    finally:
        if immutable:
            _set_immutable(target, False)
        target.chmod(mode & 0o7777)


def _writable(probe: Path) -> bool:
    """Whether `probe` can be opened for writing (made, when it is not there: removed again)."""
    existed = probe.exists()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except OSError:
        return False
    os.close(fd)
    if not existed:
        probe.unlink()
    return True


@contextlib.contextmanager
def damaged(path: Path, way: str) -> Iterator[None]:
    """The closed database at `path`, damaged `way` (one of `WAYS`) for the block."""
    assert way in WAYS, way
    if way == "truncated":
        _drop_companions(path)
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.truncate(size // 2)
        assert path.stat().st_size < size
    elif way == "zero-length":
        _drop_companions(path)
        path.write_bytes(b"")
    elif way == "not-a-database":
        _drop_companions(path)
        path.write_bytes(b"this is not a database, it is a shopping list\n" * 200)
    elif way == "directory":
        _drop_companions(path)
        path.unlink()
        path.mkdir()
        (path / "something.txt").write_text("a folder where the database was\n")
    elif way == "garbage-rows":
        garbage_rows(path)
    if way == "locked":
        with subprocess.Popen(
            [sys.executable, "-c", _LOCKER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as holder:
            assert holder.stdin is not None and holder.stdout is not None
            try:
                assert holder.stdout.readline().strip() == "locked"
                yield
            finally:
                holder.stdin.close()  # it ends when its stdin does
                holder.wait(30)
    elif way == "read-only-file":
        _drop_companions(path)
        with _read_only(path, path):
            yield
    elif way == "read-only-folder":
        _drop_companions(path)
        with _read_only(path.parent, path.parent / ".probe-write"):
            yield
    else:
        yield
