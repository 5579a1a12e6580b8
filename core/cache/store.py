"""The disk tier: saved slot files and their index.

llama-server writes slot files into its ``--slot-save-path``, which Warmslot
sets to a directory per server identity (``state/slots/<identity>``), so a file
can never be offered to a server it does not belong to. Every file we write has
a row in the ``states`` table of the cache index (its own database,
`core.cache.index`, owned by the core thread) with its fingerprint, size,
sha256, TTL class and the known-answer probe recorded at save time. A row is
only written after the file is complete and hashed; a file without a row is not
ours and is never touched.

Beside each indexed file lies its *record* (``ws-<hex>.json``, `card_name`): the
same row as JSON, written after the row. The index is the authority; the records
are what it is rebuilt from when it is lost or damaged (`StateStore.reconcile`):
a record is adopted only when it parses, names its own file and directory, and
the file has the recorded size, and an adopted row's sha256 is checked again
before its first restore, the probe after it — nothing on disk is trusted on its
word alone. A file without a record (a save that never finished) is never adopted.

The same migrations also create the ``prefixes`` table — the definitions of
learned prefixes (their tokens), kept with or without a disk tier so that a
restart can re-warm them (see `core.cache.definitions`) — and the write journal
``state_writes`` (`core.cache.saving.WriteJournal`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import sqlite_utils
from sqlite_utils import Migrations
from sqlite_utils.db import NotFoundError, Table

from core.cache.probe import ProbeRecord

log = logging.getLogger("warmslot.cache")

migrations = Migrations("warmslot.cache")
_NAME_RE = re.compile(r"^ws-[0-9a-f]{32}\.bin$")
_IDENTITY_RE = re.compile(r"^[0-9a-f]{16}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
CARD_FORMAT = 1  # the version of a state's record file (`card_name`)


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


@migrations()
def m006_state_writes(db: sqlite_utils.Database) -> None:
    """The write journal (core.cache.saving.WriteJournal): saves in flight. Made by
    the migration set "warmslot.retention" while the index lived in the history."""
    cast(Table, db["state_writes"]).create(
        {"filename": str, "identity": str, "started": float}, pk="filename"
    )


def safe_name(name: str) -> bool:
    """Only names of the shape Warmslot writes may be read, restored or deleted."""
    return bool(_NAME_RE.match(name))


def card_name(filename: str) -> str:
    """The name of a state file's record beside it: ``ws-<hex>.bin`` → ``ws-<hex>.json``."""
    return filename.removesuffix(".bin") + ".json"


def file_sha256(path: Path) -> str:
    """The file's sha256 (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# The `verify_result` of a state written before its known-answer reference was taken (a
# save that a request did not wait for): its first quiet moment or first restore takes it
# (docs/cache.md#conversations).
PENDING = "pending"


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
        """Parse and check a row of the ``states`` table (or a record file's JSON);
        ValueError when any field is missing, of the wrong type or out of range."""
        try:
            probe = row.get("probe")
            parsed = json.loads(probe) if isinstance(probe, str) and probe else probe or {}
        except ValueError as e:
            raise ValueError(f"unreadable probe: {e}") from e
        if not isinstance(parsed, dict):
            raise ValueError("the probe is not a JSON object")
        try:
            rec = cls(
                filename=_text(row, "filename"),
                identity=_text(row, "identity"),
                fingerprint=_text(row, "fingerprint"),
                client=_text(row, "client", ""),
                source=_text(row, "source", ""),
                prefix_n=_count(row, "prefix_n"),
                n_tokens=_count(row, "n_tokens"),
                bytes=_count(row, "bytes"),
                sha256=_text(row, "sha256"),
                ttl_class=_text(row, "ttl_class", ""),
                pinned=bool(_count(row, "pinned", 0)),
                created=_time(row, "created"),
                last_used=_time(row, "last_used"),
                verified_at=_time(row, "verified_at")
                if row.get("verified_at") is not None
                else None,
                verify_result=_text(row, "verify_result", ""),
                probe=cast(ProbeRecord, parsed),
                kind=_text(row, "kind", "") or "prefix",
                session=_text(row, "session", ""),
                base=_text(row, "base", ""),
                stat=_text(row, "stat", ""),
                owner=_text(row, "owner", ""),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"a field is missing or of the wrong type: {e}") from e
        if not safe_name(rec.filename):
            raise ValueError(f"not a state file name: {rec.filename!r}")
        if not _IDENTITY_RE.match(rec.identity):
            raise ValueError(f"not a server identity: {rec.identity!r}")
        if not _SHA_RE.match(rec.sha256):
            raise ValueError("not a sha256")
        if not rec.fingerprint:
            raise ValueError("no fingerprint")
        return rec

    def to_row(self) -> dict[str, object]:
        """Its row of the ``states`` table (pinned as 0/1, probe as JSON text)."""
        row: dict[str, object] = dict(self.__dict__)
        row["pinned"] = int(self.pinned)
        row["probe"] = json.dumps(self.probe)
        return row


def _text(row: dict[str, Any], key: str, default: str | None = None) -> str:
    value = row.get(key, default) if default is not None else row[key]
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise TypeError(f"{key} is not text")
    return value


def _count(row: dict[str, Any], key: str, default: int | None = None) -> int:
    value = row.get(key, default) if default is not None else row[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{key} is not a count")
    return value


def _time(row: dict[str, Any], key: str) -> float:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"{key} is not a time")
    return float(value)


@dataclass(frozen=True)
class Reconciled:
    """What `StateStore.reconcile` found: rows it dropped, records it adopted or left."""

    dropped_rows: tuple[str, ...] = ()  # filenames (or row ids) of unreadable rows deleted
    adopted: tuple[str, ...] = ()  # files indexed again from their record
    unusable: tuple[str, ...] = ()  # records that did not verify (their files left alone)

    def text(self) -> str:
        """What was done, in words ("" when nothing)."""
        parts = []
        if self.dropped_rows:
            parts.append(f"skipped and deleted {len(self.dropped_rows)} unreadable row(s)")
        if self.adopted:
            parts.append(
                f"indexed {len(self.adopted)} saved state(s) again from their records "
                "(each is checked against its sha256 and probe before it is used)"
            )
        if self.unusable:
            parts.append(
                f"left {len(self.unusable)} saved state(s) alone whose records do not "
                "match their files"
            )
        return "; ".join(parts)


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
        self._skipped: set[str] = set()  # unreadable rows (and card failures) logged once
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

    def _records(self, rows: Iterable[dict[str, Any]]) -> Iterator[StateRecord]:
        """The rows that parse; an unreadable one is skipped with a warning (once per row):
        its file is never offered to a server on the strength of a damaged row."""
        for row in rows:
            try:
                yield StateRecord.from_row(row)
            except ValueError as e:
                key = repr(row.get("filename"))
                if key not in self._skipped:
                    self._skipped.add(key)
                    log.warning("cache index: skipping an unreadable state row %s: %s", key, e)

    def get(self, filename: str) -> StateRecord | None:
        try:
            row = self.table.get(filename)
        except NotFoundError:
            return None
        return next(self._records([row]), None)

    def for_fingerprint(self, fp: str) -> StateRecord | None:
        return next(self._records(self.table.rows_where("fingerprint = ?", [fp])), None)

    def all(self, identity: str | None = None) -> list[StateRecord]:
        if identity is None:
            rows = self.table.rows_where(order_by="last_used desc")
        else:
            rows = self.table.rows_where("identity = ?", [identity], order_by="last_used desc")
        return list(self._records(rows))

    def add(self, rec: StateRecord) -> None:
        """Index a finished file (call only after the save returned and the file is hashed).

        The file's stat is recorded with it, so that a restore of the unchanged file need
        not read it a second time to hash it (`check_file`). Its record is written beside
        it after the row, for a rebuild of a lost index (`reconcile`).
        """
        path = self.path(rec)
        if not rec.stat and path.is_file():
            rec.stat = file_stat(path)
        self.table.upsert(rec.to_row(), pk="filename")
        self._write_card(rec)

    def touch(self, filename: str) -> None:
        self.table.update(filename, {"last_used": self.clock()})

    def mark_verified(self, filename: str, result: str) -> None:
        self.table.update(filename, {"verified_at": self.clock(), "verify_result": result})

    def set_pinned(self, filename: str, pinned: bool) -> None:
        self.table.update(filename, {"pinned": int(pinned)})
        rec = self.get(filename)
        if rec is not None:
            self._write_card(rec)  # a rebuilt index keeps the user's pin

    # ------------------------------------------------------------ records
    def _write_card(self, rec: StateRecord) -> None:
        """Write the record beside its file (atomically; skipped when the file is not
        there). A record that cannot be written costs only the rebuild: logged once."""
        path = self.path(rec)
        if not path.is_file():
            return
        card = path.with_name(card_name(rec.filename))
        row = rec.to_row()
        row.pop("stat")  # a rebuilt row hashes the file again before its first use
        tmp = card.with_name(f".{card.name}.tmp")
        try:
            tmp.write_text(json.dumps({"format": CARD_FORMAT, **row}), encoding="utf-8")
            os.replace(tmp, card)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if "card" not in self._skipped:
                self._skipped.add("card")
                log.warning("cannot write the record of %s beside it (%s)", rec.filename, e)

    def reconcile(self) -> Reconciled:
        """Check the index against the slot directories (at open, before anything uses it).

        Rows that do not parse are deleted. Each record (``ws-<hex>.json``) whose file has
        no row is adopted when it parses, names that very file in that very directory and
        the file has the recorded size: its row is written with no stat (the next restore
        hashes the file and compares, then the probe checks the state) and its TTL starts
        again now. A record without its file is deleted; one that does not match its file
        is left alone, with the file (never ours to delete on a record's word)."""
        dropped: list[str] = []
        known: set[str] = set()
        for row in list(self.table.rows_where(select="rowid, *")):
            rowid = row.pop("rowid")
            try:
                rec = StateRecord.from_row(row)
                known.add(rec.filename)
                if not self.path(rec).with_name(card_name(rec.filename)).exists():
                    self._write_card(rec)  # indexed before records existed (an upgrade)
            except ValueError as e:
                name = row.get("filename")
                log.warning("cache index: deleting an unreadable state row %r: %s", name, e)
                self.db.execute("DELETE FROM states WHERE rowid = ?", [rowid])
                dropped.append(str(name))
        adopted: list[str] = []
        unusable: list[str] = []
        for directory in self._identity_dirs():
            try:
                cards = sorted(directory.glob("ws-*.json"))
            except OSError:
                continue
            for card in cards:
                name = card.name.removesuffix(".json") + ".bin"
                if name in known:
                    continue
                outcome = self._adopt(directory, card, name)
                if outcome is None:
                    continue  # a stray record of a deleted file, removed
                (adopted if outcome else unusable).append(name)
        return Reconciled(tuple(dropped), tuple(adopted), tuple(unusable))

    def _identity_dirs(self) -> list[Path]:
        try:
            return [d for d in self.root.iterdir() if _IDENTITY_RE.match(d.name) and d.is_dir()]
        except OSError:
            return []

    def _adopt(self, directory: Path, card: Path, name: str) -> bool | None:
        """Index `name` again from its record `card`: True adopted, False left alone,
        None when the file is gone (the stray record is deleted)."""
        path = directory / name
        if not path.is_file():
            with contextlib.suppress(OSError):
                card.unlink()
            return None
        try:
            data = json.loads(card.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != CARD_FORMAT:
                raise ValueError("not a state record of this format")
            rec = StateRecord.from_row(data)
            if rec.filename != name or rec.identity != directory.name:
                raise ValueError(f"it names {rec.identity}/{rec.filename}")
            size = path.stat().st_size
            if size != rec.bytes:
                raise ValueError(f"the file has {size} bytes, the record {rec.bytes}")
        except (OSError, ValueError) as e:
            log.warning("not indexing %s again: its record does not verify (%s)", path, e)
            return False
        rec.stat = ""
        rec.last_used = self.clock()
        self.table.upsert(rec.to_row(), pk="filename")
        log.info("indexed %s again from its record", path)
        return True

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
        """Delete the file, its record and its row; returns bytes freed. Only our own files."""
        path = self.path(rec)
        freed = 0
        # The record first: a file that then cannot be deleted (quarantined by retention)
        # has no record left to be indexed again from.
        with contextlib.suppress(FileNotFoundError):
            path.with_name(card_name(rec.filename)).unlink()
        if path.is_file():
            freed = path.stat().st_size
            path.unlink()
        self.table.delete_where("filename = ?", [rec.filename])
        return freed

    def total_bytes(self) -> int:
        row = self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM states").fetchone()
        return int(row[0])
