"""The file check before a restore: an unchanged file is not hashed
again, and any change a stat can show still sends it through the sha256.

Hashing reads the whole file, as long again as the server's own read of it
(docs/benchmarks.md#restore); `StateStore` records the file's stat when its sha256
matched and compares that instead. A spy on `file_sha256` counts the reads.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlite_utils

from core.cache import store as store_mod
from core.cache.store import RACY_NS, StateRecord, StateStore, file_sha256
from core.telemetry import Telemetry
from tests.helpers import wait_until

IDENT = "0123456789abcdef"


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file `StateStore.check_file` hashes (the real function still runs)."""
    seen: list[Path] = []
    real: Callable[[Path], str] = store_mod.file_sha256

    def spy(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(store_mod, "file_sha256", spy)
    return seen


def _settled(path: Path) -> None:
    """Wait until the file's last change is older than the racy window."""
    wait_until(
        lambda: (
            time.time_ns() - max(path.stat().st_mtime_ns, path.stat().st_ctime_ns) > 2 * RACY_NS
        ),
        5,
    )


def _saved(store: StateStore, content: bytes = b"x" * 4096, *, settle: bool = True) -> StateRecord:
    d = store.dir_for(IDENT)
    d.mkdir(parents=True, exist_ok=True)
    name = f"ws-{uuid.uuid4().hex}.bin"
    path = d / name
    path.write_bytes(content)
    digest = file_sha256(path)
    if settle:
        _settled(path)
    rec = StateRecord(
        filename=name,
        identity=IDENT,
        fingerprint="f",
        client="c",
        source="s",
        prefix_n=1,
        n_tokens=1,
        bytes=len(content),
        sha256=digest,
        ttl_class="extended",
        pinned=False,
        created=0,
        last_used=0,
        verified_at=None,
        verify_result="",
        probe={},
    )
    store.add(rec)
    return rec


def test_an_unchanged_file_is_not_hashed_again(tmp_path: Path, hashes: list[Path]) -> None:
    tel = Telemetry(tmp_path / "t.sqlite3")
    store = StateStore(tel.db, tmp_path / "slots")
    rec = _saved(store)
    assert store.check_file(rec) is None
    # The record as read back from the database (a restart): still no second read.
    again = store.get(rec.filename)
    assert again is not None and again.stat == rec.stat
    assert StateStore(tel.db, tmp_path / "slots").check_file(again) is None
    assert hashes == []


def test_a_rewrite_of_the_same_size_is_hashed_and_caught(
    tmp_path: Path, hashes: list[Path]
) -> None:
    tel = Telemetry(tmp_path / "t.sqlite3")
    store = StateStore(tel.db, tmp_path / "slots")
    rec = _saved(store)
    path = store.path(rec)
    st = path.stat()
    path.write_bytes(b"y" * rec.bytes)
    assert "sha256" in (store.check_file(rec) or "")
    # Setting the old mtime back does not hide it: the ctime moved.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "sha256" in (store.check_file(rec) or "")
    assert len(hashes) == 2


def test_a_file_replaced_by_another_of_the_same_content_is_hashed(
    tmp_path: Path, hashes: list[Path]
) -> None:
    tel = Telemetry(tmp_path / "t.sqlite3")
    store = StateStore(tel.db, tmp_path / "slots")
    rec = _saved(store)
    path = store.path(rec)
    other = path.with_suffix(".new")
    other.write_bytes(path.read_bytes())
    other.replace(path)  # another inode
    assert store.check_file(rec) is None
    assert hashes == [path]
    # Checked once, its new stat is recorded: once that record is clear of the replace
    # (the first may be racy, taken right after it), checks read nothing.
    _settled(path)
    rec2 = store.get(rec.filename)
    assert rec2 is not None and store.check_file(rec2) is None
    n = len(hashes)
    rec3 = store.get(rec.filename)
    assert rec3 is not None and store.check_file(rec3) is None
    assert store.check_file(rec3) is None
    assert len(hashes) == n <= 2


def test_a_stat_taken_right_after_a_write_proves_nothing(
    tmp_path: Path, hashes: list[Path]
) -> None:
    """Within the kernel's timestamp tick a rewrite can keep the mtime: a stat recorded
    then is racy, and the check hashes (and catches the rewrite)."""
    tel = Telemetry(tmp_path / "t.sqlite3")
    store = StateStore(tel.db, tmp_path / "slots")
    rec = _saved(store, settle=False)
    store.path(rec).write_bytes(b"y" * rec.bytes)
    assert "sha256" in (store.check_file(rec) or "")
    assert len(hashes) == 1


def test_rows_from_before_the_stat_column_are_hashed_once(
    tmp_path: Path, hashes: list[Path]
) -> None:
    db_path = tmp_path / "old.sqlite3"
    store = StateStore(sqlite_utils.Database(db_path), tmp_path / "slots")
    rec = _saved(store)
    # A row written before migration m004: no stat recorded.
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE states SET stat = NULL")
    old = store.get(rec.filename)
    assert old is not None and old.stat == ""
    assert store.check_file(old) is None
    assert len(hashes) == 1
    _settled(store.path(rec))
    newer = store.get(rec.filename)
    assert newer is not None and newer.stat
    assert store.check_file(newer) is None
    assert len(hashes) == 1
