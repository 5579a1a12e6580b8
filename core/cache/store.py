"""The disk tier: saved slot files and their index.

llama-server writes slot files into its ``--slot-save-path``, which Warmslot
sets to a directory per server identity (``state/slots/<identity>``), so a file
can never be offered to a server it does not belong to. Every file we write has
a row in the ``states`` table (in the telemetry database, owned by the core
thread) with its fingerprint, size, sha256, TTL class and the known-answer
probe recorded at save time. A row is only written after the file is complete
and hashed; a file without a row is not ours and is never touched.

The same migrations also create the ``prefixes`` table: the definitions of
learned prefixes (their tokens), kept with or without a disk tier so that a
restart can re-warm them (see `core.cache.definitions`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import sqlite_utils
from sqlite_utils import Migrations
from sqlite_utils.db import NotFoundError, Table

from core.cache.probe import ProbeRecord

migrations = Migrations("warmslot.cache")
_NAME_RE = re.compile(r"^ws-[0-9a-f]{32}\.bin$")


@migrations()
def m001_states(db: sqlite_utils.Database) -> None:
    cast(Table, db["states"]).create(
        {
            "filename": str,
            "identity": str,
            "fingerprint": str,
            "client": str,
            "source": str,
            "prefix_n": int,
            "n_tokens": int,
            "bytes": int,
            "sha256": str,
            "ttl_class": str,
            "pinned": int,
            "created": float,
            "last_used": float,
            "verified_at": float,
            "verify_result": str,
            "probe": str,
            "kind": str,
        },
        pk="filename",
    )
    cast(Table, db["states"]).create_index(["fingerprint"])


@migrations()
def m002_prefixes(db: sqlite_utils.Database) -> None:
    """Learned prefix definitions (core.cache.definitions): what to re-warm after a restart."""
    cast(Table, db["prefixes"]).create(
        {
            "id": str,  # sha256 of model, template and tokens (first 32 hex digits)
            "model": str,  # model file identity
            "template": str,  # sha256 of the chat template the server rendered with
            "shape_key": str,
            "client": str,
            "source": str,
            "tokens": str,  # JSON list of token ids
            "n_tokens": int,
            "fingerprint": str,  # under the server identity it was last written with
            "first_seen": float,
            "last_used": float,
            "meta": str,  # JSON: rendered_tokens, head_n
        },
        pk="id",
    )
    cast(Table, db["prefixes"]).create_index(["model", "template", "last_used"])


@migrations()
def m003_conversations(db: sqlite_utils.Database) -> None:
    """Conversation states (core.cache.conversations): their session and stable prefix."""
    table = cast(Table, db["states"])
    table.add_column("session", str, not_null_default="")
    table.add_column("base", str, not_null_default="")
    table.create_index(["kind", "session"])


@migrations()
def m004_state_stat(db: sqlite_utils.Database) -> None:
    """The file's stat when its sha256 was last known to match: a restore skips
    hashing an unchanged file again (`StateStore.check_file`)."""
    cast(Table, db["states"]).add_column("stat", str)


@migrations()
def m005_state_owner(db: sqlite_utils.Database) -> None:
    """Whose request made each state: its user's API key name ("" without keys), for the
    fair share of the disk cap (core.cache.retention_plan)."""
    cast(Table, db["states"]).add_column("owner", str, not_null_default="")


def safe_name(name: str) -> bool:
    """Only names of the shape Warmslot writes may be read, restored or deleted."""
    return bool(_NAME_RE.match(name))


def file_sha256(path: Path) -> str:
    """The file's sha256 (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class StateRecord:
    filename: str
    identity: str
    fingerprint: str
    client: str
    source: str
    prefix_n: int
    n_tokens: int
    bytes: int
    sha256: str
    ttl_class: str
    pinned: bool
    created: float
    last_used: float
    verified_at: float | None
    verify_result: str
    probe: ProbeRecord  # its known-answer probe (core.cache.probe)
    kind: str = "prefix"  # or "conversation" (core.cache.conversations)
    session: str = ""  # a conversation's session id
    base: str = ""  # a conversation's stable prefix (fingerprint)
    # "size:mtime_ns:ctime_ns:inode:recorded_ns" when the sha256 last matched (see
    # `file_stat`); empty when unknown, so the next check hashes.
    stat: str | None = ""
    owner: str = ""  # the user (API key name) whose request made it; "" without keys

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> StateRecord:
        row = dict(row)
        row["kind"] = row.get("kind") or "prefix"
        row["session"] = row.get("session") or ""
        row["base"] = row.get("base") or ""
        row["pinned"] = bool(row.get("pinned"))
        row["probe"] = json.loads(row["probe"]) if row.get("probe") else {}
        row["stat"] = row.get("stat") or ""
        row["owner"] = row.get("owner") or ""
        return cls(**row)

    def to_row(self) -> dict[str, object]:
        """Its row of the ``states`` table (pinned as 0/1, probe as JSON text)."""
        row: dict[str, object] = dict(self.__dict__)
        row["pinned"] = int(self.pinned)
        row["probe"] = json.dumps(self.probe)
        return row


# A file changed within this long after its stat was recorded may keep the same mtime (the
# kernel stamps files from a coarse clock, a tick of 1-10 ms): such a stat proves nothing,
# and the next check hashes (git's "racily clean" entries). Filesystems that keep whole
# seconds get two.
RACY_NS = 50_000_000
RACY_COARSE_NS = 2_000_000_000


def file_stat(path: Path, recorded_ns: int | None = None) -> str:
    """What `check_file` compares instead of hashing again: size, mtime, ctime (which no
    one can set back), inode, and when this was recorded."""
    st = path.stat()
    now = time.time_ns() if recorded_ns is None else recorded_ns
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{now}"


def _unchanged(recorded: str | None, path: Path) -> bool:
    """Whether the file is the one whose sha256 matched when `recorded` was taken: the
    same size, mtime, ctime and inode, recorded clearly after its last change."""
    if not recorded:
        return False
    try:
        size, mtime, ctime, ino, at = (int(x) for x in recorded.split(":"))
    except ValueError:
        return False
    st = path.stat()
    if (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) != (size, mtime, ctime, ino):
        return False
    changed = max(mtime, ctime)
    coarse = changed % 1_000_000_000 == 0
    return at - changed >= (RACY_COARSE_NS if coarse else RACY_NS)


class StateStore:
    """Index of saved states plus the files, for one state root."""

    def __init__(
        self, db: sqlite_utils.Database, root: Path, clock: Callable[[], float] = time.time
    ) -> None:
        self.db = db
        self.root = root
        self.clock = clock
        migrations.apply(db)

    @property
    def table(self) -> Table:
        return cast(Table, self.db["states"])

    def dir_for(self, identity_short: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{16}", identity_short):
            raise ValueError(f"bad identity {identity_short!r}")
        return self.root / identity_short

    def path(self, rec: StateRecord) -> Path:
        if not safe_name(rec.filename):
            raise ValueError(f"refusing unsafe state file name {rec.filename!r}")
        return self.dir_for(rec.identity) / rec.filename

    def get(self, filename: str) -> StateRecord | None:
        try:
            return StateRecord.from_row(self.table.get(filename))
        except NotFoundError:
            return None

    def for_fingerprint(self, fp: str) -> StateRecord | None:
        rows = list(self.table.rows_where("fingerprint = ?", [fp], limit=1))
        return StateRecord.from_row(rows[0]) if rows else None

    def all(self, identity: str | None = None) -> list[StateRecord]:
        if identity is None:
            rows = self.table.rows_where(order_by="last_used desc")
        else:
            rows = self.table.rows_where("identity = ?", [identity], order_by="last_used desc")
        return [StateRecord.from_row(r) for r in rows]

    def add(self, rec: StateRecord) -> None:
        """Index a finished file (call only after the save returned and the file is hashed).

        The file's stat is recorded with it, so that a restore of the unchanged file need
        not read it a second time to hash it (`check_file`).
        """
        if not rec.stat:
            path = self.path(rec)
            if path.is_file():
                rec.stat = file_stat(path)
        self.table.upsert(rec.to_row(), pk="filename")

    def touch(self, filename: str) -> None:
        self.table.update(filename, {"last_used": self.clock()})

    def mark_verified(self, filename: str, result: str) -> None:
        self.table.update(filename, {"verified_at": self.clock(), "verify_result": result})

    def set_pinned(self, filename: str, pinned: bool) -> None:
        self.table.update(filename, {"pinned": int(pinned)})

    def check_file(self, rec: StateRecord) -> str | None:
        """Why the file cannot be trusted (missing, truncated, changed), or None.

        The sha256 is computed again only when the file's stat differs from the one
        recorded when it last matched (or that record is too close to the file's last
        change to prove anything): hashing reads the whole file, as long again as the
        server's own read of it (measured: docs/benchmarks.md#restore). The known-answer
        probe after the restore still checks the state itself.
        """
        path = self.path(rec)
        if not path.is_file():
            return "file is missing"
        size = path.stat().st_size
        if size != rec.bytes:
            return f"size changed ({size} bytes, expected {rec.bytes}): truncated or replaced"
        if _unchanged(rec.stat, path):
            return None
        before = time.time_ns()
        if file_sha256(path) != rec.sha256:
            return "contents changed (sha256 mismatch): corrupted"
        # Recorded as of before the hash: a change while it read makes the stat racy.
        rec.stat = file_stat(path, recorded_ns=before)
        with contextlib.suppress(NotFoundError):  # a record not (or no longer) indexed
            self.table.update(rec.filename, {"stat": rec.stat})
        return None

    def delete(self, rec: StateRecord) -> int:
        """Delete the file and its row; returns bytes freed. Only our own files."""
        path = self.path(rec)
        freed = 0
        if path.is_file():
            freed = path.stat().st_size
            path.unlink()
        self.table.delete_where("filename = ?", [rec.filename])
        return freed

    def total_bytes(self) -> int:
        row = self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM states").fetchone()
        return int(row[0])
