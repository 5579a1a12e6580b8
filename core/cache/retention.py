"""TTL classes, the disk retention sweep, and idle sessions.

The rules are planned in `core.cache.retention_plan`, applied here.

**TTL classes** ``short`` / ``long`` / ``extended`` (settings ``cache.ttl_*_s``,
defaults 5 min / 60 min / 24 h). Stable prefixes get ``cache.prefix_class``
(extended), conversations ``cache.conversation_class`` (long), side-call state
``cache.aux_class`` (short). A pinned entry never expires and is never swept.

**Disk retention** (every ``cache.retention_interval_s``, at least 60 s) looks
only at files our index (the ``states`` table of the cache index,
`core.cache.index`) says we wrote; a file's record beside it goes with it:

1. a row whose file is gone is dropped; a file whose size no longer matches
   its row (truncated, replaced) is deleted;
2. pinned files, and files of prefixes a slot holds right now (current), are
   never deleted; neither are the ``cache.keep_recent`` most recently used
   files of the running server;
3. a session keeps at most ``cache.conversations_per_session`` saved conversation
   states, the newest (a newer state of the same conversation supersedes the older
   one when it is saved, core.cache.conversations); pinned ones are kept beyond it;
   a file unused for longer than its class's TTL is deleted; files of another
   server identity (another model, build or flags: their directory is not the
   running server's) are not protected by keep-recent, so they age out;
4. while the total is above the byte cap (``cache.disk_cap_mb``; 0 = 10 % of
   the free disk when Warmslot started), the oldest are deleted, other
   identities' first;
5. a save that never finished (recorded in the write journal before the server
   was asked to write, and never indexed) has its partial file deleted.

**Failed saves** (disk full, the server refused): the partial file is deleted at
once when the server answered with an error (after a timeout it may still be
writing: the journal entry stays and rule 5 deletes it), and the prefix is not
saved again for a while — 30 s, doubling per failure up to 30 min, reset by a
successful save (`SaveBackoff`). Each failure is one ``save_failed`` event that
says when the next try is, so a disk that stays full costs one event per step,
not one per request.

**Undeletable files** (EPERM/EACCES, a read-only directory): a file that had to
go but could not be deleted is quarantined — its index row is dropped, so it is
never offered to a server again — and recorded once as an ``undeletable`` event;
requests keep being served.

**The cap holds at every save**, not only at the sweeps (`make_room`): before a save
is written, the same rules delete what must go for it to fit — its size estimated from
the running server's saved states (bytes per token) — and a save that cannot fit
because everything left is pinned, held by a slot or among the most recent is not
made; once written, its real size is checked again (with every save under way) and a
file that does not fit is deleted at once (``save_failed``, backed off like any failed
save). So the saved states never stay above the cap, shutdown saves included
(docs/cache.md#disk-cap). The size counted is the state file's and its record's.

Files without a row or journal entry are never touched, whatever their name.
Every deletion is a ``CacheEvent`` of kind ``evicted`` with the file, bytes,
age and reason.

**Idle sessions** are released after their class's TTL (`session_limit`) by
`core.cache.idle`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.cache.retention_plan import MIB, Eviction, Plan, human_age, plan_disk_sweep
from core.cache.saving import SaveBackoff, WriteJournal
from core.cache.store import StateRecord, card_name, safe_name
from core.config import TTL_CLASSES, CacheSettings
from core.events import CacheEvent, CacheEventKind
from core.machine.sweeps import Outcome
from core.status import CacheStatus

if TYPE_CHECKING:
    from core.cache.deps import HasRetention
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState

__all__ = [
    "TTL_CLASSES",
    "Eviction",
    "Plan",
    "Retention",
    "class_for",
    "default_cap_bytes",
    "human_age",
    "plan_disk_sweep",
    "ttl_seconds",
]

log = logging.getLogger("warmslot.cache")

DEFAULT_CAP_SHARE = 0.10  # cache.disk_cap_mb = 0: this share of the free disk at start
UNFINISHED_GRACE_S = 600.0  # a journaled save older than this that never got a row failed
SIZE_SLACK = 0
# A state's record (its row as JSON beside it: the token list and the probe's answer) is
# written once the state is indexed; until then it counts as this much (measured: 6.3
# bytes per token and under 1 KiB besides).
RECORD_BYTES_PER_TOKEN = 8
RECORD_BYTES_BASE = 4096


def ttl_seconds(settings: CacheSettings, ttl_class: str) -> float:
    """Seconds of a TTL class (unknown classes count as ``long``)."""
    return float(
        {
            "short": settings.ttl_short_s,
            "long": settings.ttl_long_s,
            "extended": settings.ttl_extended_s,
        }.get(ttl_class, settings.ttl_long_s)
    )


def class_for(settings: CacheSettings, kind: str) -> str:
    """The TTL class of an entry kind: ``prefix``, ``conversation`` or ``aux``."""
    return {
        "prefix": settings.prefix_class,
        "conversation": settings.conversation_class,
        "aux": settings.aux_class,
    }.get(kind, settings.conversation_class)


def default_cap_bytes(directory: Path, share: float = DEFAULT_CAP_SHARE) -> int:
    """`share` of the free space of the disk holding `directory` (or its nearest parent)."""
    path = directory.expanduser().absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return int(shutil.disk_usage(path).free * share)


# ---------------------------------------------------------------------------- the sweeps
class Retention:
    """The disk retention sweep of one cache manager, and the TTLs its sessions and saved
    states live by."""

    def __init__(
        self,
        state: CacheState,
        ops: SlotOps,
        *,
        slot_dir: Path,
        free_disk_cap: int | None = None,
        peers: Callable[[], Sequence[HasRetention]] = lambda: (),
    ) -> None:
        self.state = state
        self.ops = ops
        # Every model's cache manager (this one's too, or not): their states share the
        # index and the cap (`make_room` protects what they hold, as the sweep does).
        self._peers = peers
        self.clock = state.clock
        self._default_cap = (
            free_disk_cap if free_disk_cap is not None else default_cap_bytes(slot_dir)
        )
        self._journal: WriteJournal | None = None
        self.last_plan: Plan | None = None
        self.unknown_files = 0
        self.save_backoff = SaveBackoff(self.clock.time)
        # Files that could not be deleted (name → why): reported once, never retried.
        self.quarantined: dict[str, str] = {}

    @property
    def settings(self) -> CacheSettings:
        return self.state.settings.cache

    @property
    def cap_bytes(self) -> int:
        mb = self.settings.disk_cap_mb
        return mb * MIB if mb > 0 else self._default_cap

    def cap_source(self) -> str:
        """Where the cap comes from, in words."""
        return (
            "cache.disk_cap_mb" if self.settings.disk_cap_mb > 0 else "10 % of free disk at start"
        )

    @property
    def journal(self) -> WriteJournal:
        if self._journal is None:
            self._journal = WriteJournal(self.state.store.db, self.clock.time)
        return self._journal

    def ttl(self, ttl_class: str) -> float:
        return ttl_seconds(self.settings, ttl_class)

    def current_identity(self) -> str | None:
        """The running (or last resolved) server's slot directory name."""
        sup = self.state.server
        if sup is None or sup.resolved is None or sup.resolved.slot_dir is None:
            return None
        return sup.resolved.slot_dir.name

    def in_use(self) -> set[str]:
        held = {s.prefix_fp for s in self.state.slots.slots if s.prefix_fp}
        return held | set(self.ops.persisting)

    def _emit(self, kind: CacheEventKind, reason: str, **kw: Any) -> None:
        details = kw.pop("details", {})
        self.state.publish(
            CacheEvent(kind=kind, reason=reason, details=details, ts=self.clock.time(), **kw)
        )

    def _record_size(self, rec: StateRecord) -> int:
        """Bytes of the state's record beside its file (0 when there is none)."""
        try:
            return self.state.store.path(rec).with_name(card_name(rec.filename)).stat().st_size
        except (OSError, ValueError):
            return 0

    def _file_size(self, rec: StateRecord) -> int | None:
        try:
            path = self.state.store.path(rec)
        except ValueError:
            return None  # an unsafe name in the index: treat the row as stale
        try:
            return path.stat().st_size if path.is_file() else None
        except OSError:
            return None

    # ------------------------------------------------------------------ failures
    def save_failed(
        self,
        fp: str,
        reason: str,
        *,
        filename: str,
        slot: int | None = None,
        server_answered: bool = True,
    ) -> float:
        """A save of prefix `fp` into `filename` failed: delete its partial file now (when
        the server answered, so it no longer writes), back the prefix off, and record one
        ``save_failed`` event saying when the next try is. Returns that delay in seconds."""
        partial = self.discard_partial(filename) if server_answered else 0
        failures, delay = self.save_backoff.failed(fp, reason)
        details: dict[str, object] = {
            "file": filename,
            "failures": failures,
            "retry_in_s": delay,
            "partial_deleted_bytes": partial,
        }
        self._emit(
            CacheEventKind.SAVE_FAILED,
            f"{reason}; not saving this prefix again for {human_age(delay)}",
            fingerprint=fp[:16],
            slot=slot,
            details=details,
        )
        return delay

    def save_succeeded(self, fp: str) -> None:
        """A save of `fp` worked: its backoff (if any) is over."""
        self.save_backoff.succeeded(fp)

    def discard_partial(self, filename: str) -> int:
        """Delete the file a failed save left (journaled, not indexed); returns its bytes.
        The journal entry goes with it; one that cannot be deleted stays journaled."""
        store = self.state.store
        row = next((r for r in self.journal.pending() if str(r["filename"]) == filename), None)
        if row is None or store.get(filename) is not None or not safe_name(filename):
            return 0  # not a save of ours in flight, or an indexed file (never ours to drop)
        try:
            path = store.dir_for(str(row["identity"])) / filename
        except ValueError:
            return 0
        size = 0
        try:
            if path.is_file():
                size = path.stat().st_size
                path.unlink()
        except OSError as e:
            self.undeletable(filename, path, e)
            return 0
        self.journal.end(filename)
        return size

    def discard(self, rec: StateRecord, why: str) -> int:
        """Delete a state that failed its checks (file and row); returns bytes freed.

        A file that cannot be deleted is quarantined: its row is dropped all the same (the
        file is never offered to a server again) and one ``undeletable`` event says so."""
        store = self.state.store
        try:
            return store.delete(rec)
        except OSError as e:
            store.table.delete_where("filename = ?", [rec.filename])
            try:
                path: Path | None = store.path(rec)
            except ValueError:
                path = None
            self.undeletable(rec.filename, path, e, why=why, fingerprint=rec.fingerprint)
            return 0

    def undeletable(
        self,
        filename: str,
        path: Path | None,
        err: OSError,
        *,
        why: str = "",
        fingerprint: str = "",
    ) -> None:
        """Record (once per name) a file that could not be deleted."""
        if filename in self.quarantined:
            return
        cause = errno.errorcode.get(err.errno or 0, "") or type(err).__name__
        text = f"{cause}: {err.strerror or err}"
        self.quarantined[filename] = text
        log.warning("cannot delete %s (%s); quarantined, not used again", path or filename, text)
        self._emit(
            CacheEventKind.UNDELETABLE,
            f"could not delete {filename} ({text}); it is never used again"
            + (f" (it had to go: {why})" if why else ""),
            fingerprint=fingerprint[:16],
            details={"file": filename, "path": str(path) if path else "", "error": text},
        )

    # ------------------------------------------------------------------ disk
    async def sweep_disk(self, peers: Sequence[HasRetention] = ()) -> Outcome:
        """Apply the retention rules to every saved state in the index.

        `peers` are the other models' cache managers: the index and the slot
        directory root are shared, so what any of them holds or recently used is
        protected, and only files of no model's server count as foreign.
        """
        now = self.clock.time()
        plan = self._plan(peers, now=now)
        self.last_plan = plan
        freed = 0
        for ev in plan.evictions:
            freed += self._evict(ev.rec, ev.rule, ev.reason, ev.age_s)
        unfinished, unfinished_bytes = self._sweep_unfinished(now)
        freed += unfinished_bytes
        self.unknown_files = self._count_unknown()
        if plan.total_after > plan.cap_bytes:
            log.warning(
                "saved states use %.1f MiB, above the cap of %.1f MiB, but everything left is "
                "pinned, current or among the most recent",
                plan.total_after / MIB,
                plan.cap_bytes / MIB,
            )
        return Outcome(
            len(plan.evictions) + unfinished,
            {
                "freed_bytes": freed,
                "total_bytes": plan.total_after,
                "cap_bytes": plan.cap_bytes,
                "kept": len(plan.kept),
                "unknown_files_left_alone": self.unknown_files,
                "rules": sorted({e.rule for e in plan.evictions}),
            },
        )

    def _plan(self, peers: Sequence[HasRetention], *, now: float, room: int = 0) -> Plan:
        """The retention rules over every saved state (`room`: bytes that must fit too)."""
        everyone = [self, *(p.retention for p in peers if p.retention is not self)]
        identities = {i for r in everyone if (i := r.current_identity()) is not None}
        return plan_disk_sweep(
            self.state.store.all(),
            now=now,
            ttl=self.ttl,
            keep_recent=self.settings.keep_recent,
            cap_bytes=self.cap_bytes,
            current_identities=identities,
            in_use=set().union(*(r.in_use() for r in everyone)),
            file_size=self._file_size,
            record_size=self._record_size,
            per_session=self.settings.conversations_per_session,
            room=room,
        )

    # ------------------------------------------------------------------ the cap at saves
    def estimate_bytes(self, n_tokens: int) -> int:
        """About what a saved state of `n_tokens` tokens takes on the running server's
        disk with its record: its saved states' bytes per token (before its first one
        only the record: the state's real size is checked once it is written)."""
        recs = [r for r in self.state.store.all(self.state.launch_id) if r.n_tokens > 0]
        tokens = sum(r.n_tokens for r in recs)
        state = int(sum(r.bytes for r in recs) * n_tokens / tokens) if tokens else 0
        return state + self.record_bytes(n_tokens)

    @staticmethod
    def record_bytes(n_tokens: int) -> int:
        """What the record of a state of `n_tokens` tokens will take (at most)."""
        return RECORD_BYTES_BASE + RECORD_BYTES_PER_TOKEN * n_tokens

    def _under_way(self, exclude: str = "") -> int:
        """Bytes of the saves under way (journaled, not indexed yet) on disk now."""
        store = self.state.store
        total = 0
        for row in self.journal.pending():
            name = str(row["filename"])
            if name == exclude or not safe_name(name) or store.get(name) is not None:
                continue
            with contextlib.suppress(OSError, ValueError):
                path = store.dir_for(str(row["identity"])) / name
                if path.is_file():
                    total += path.stat().st_size
        return total

    def make_room(self, nbytes: int, what: str, *, written: str = "") -> str | None:
        """Make the disk cap hold with a save of `nbytes` more: delete what the retention
        rules say must go for the saved states, the other saves under way and it to fit
        under the cap. Call before the save (with its estimate) and once its file
        `written` is on disk (with its size). None when it fits; else why not, in words —
        and then nothing was deleted."""
        need = nbytes + self._under_way(exclude=written)
        plan = self._plan(self._peers(), now=self.clock.time(), room=need)
        if plan.total_after + need > plan.cap_bytes:
            cap = f"the disk cap of {plan.cap_bytes / MIB:.1f} MiB ({self.cap_source()})"
            if nbytes > plan.cap_bytes:
                return f"not saved: {what} ({nbytes / MIB:.1f} MiB) is larger than {cap}"
            return (
                f"not saved: {what} ({nbytes / MIB:.1f} MiB) would put saved states over "
                f"{cap}: the {plan.total_after / MIB:.1f} MiB left are pinned, held by a "
                "slot or among the most recent"
                + (
                    f", and {(need - nbytes) / MIB:.1f} MiB are being saved"
                    if need > nbytes
                    else ""
                )
            )
        for ev in plan.evictions:
            self._evict(ev.rec, ev.rule, ev.reason, ev.age_s, by="save")
        return None

    def evict_now(self, rec: StateRecord, rule: str, reason: str) -> int:
        """Delete one indexed file now (e.g. a superseded conversation state) and record
        the eviction, as a sweep would; returns bytes freed."""
        return self._evict(rec, rule, reason, self.clock.time() - rec.last_used, by="now")

    def _evict(
        self, rec: StateRecord, rule: str, reason: str, age_s: float, *, by: str = "sweep"
    ) -> int:
        """Delete one indexed file (or only its row) and record the eviction; `by`: the
        retention sweep, a save making room under the cap ("save"), or on the spot ("now")."""
        try:
            freed = self.state.store.delete(rec)
        except ValueError:  # unsafe name: drop the row, never touch a path
            self.state.store.table.delete_where("filename = ?", [rec.filename])
            freed = 0
        except OSError:  # cannot be deleted: quarantined (one event), the sweep goes on
            return self.discard(rec, reason)
        self._emit(
            CacheEventKind.EVICTED,
            reason,
            fingerprint=rec.fingerprint[:16],
            tokens=rec.n_tokens,
            bytes=freed,
            details={
                "file": rec.filename,
                "identity": rec.identity,
                "rule": rule,
                "age_s": round(age_s, 1),
                "ttl_class": rec.ttl_class,
                "kind": rec.kind,
                "by": by,
            },
        )
        return freed

    def _sweep_unfinished(self, now: float) -> tuple[int, int]:
        """Delete partial files of saves that never finished (journaled, never indexed)."""
        count = freed = 0
        store = self.state.store
        for row in self.journal.pending():
            name, identity = str(row["filename"]), str(row["identity"])
            if store.get(name) is not None:
                self.journal.end(name)  # finished after all (or saved again since)
                continue
            if now - float(row["started"]) < UNFINISHED_GRACE_S:
                continue  # may still be writing
            size = 0
            if safe_name(name):
                try:
                    path = store.dir_for(identity) / name
                except ValueError:
                    path = None
                try:
                    if path is not None and path.is_file():
                        size = path.stat().st_size
                        path.unlink()
                except OSError as e:
                    self.undeletable(name, path, e, why="a save that never finished")
                    self.journal.end(name)  # quarantined: not retried every sweep
                    continue
            self.journal.end(name)
            count += 1
            freed += size
            self._emit(
                CacheEventKind.EVICTED,
                "a save that never finished (Warmslot or the server stopped mid-write)",
                bytes=size,
                details={
                    "file": name,
                    "identity": identity,
                    "rule": "unfinished",
                    "age_s": round(now - float(row["started"]), 1),
                },
            )
        return count, freed

    def _count_unknown(self) -> int:
        """Files in our slot directories that no index row claims (left alone)."""
        root = self.state.store.root
        if not root.is_dir():
            return 0
        records = self.state.store.all()
        known = {(r.identity, r.filename) for r in records}
        known |= {(r.identity, card_name(r.filename)) for r in records}  # their records
        n = 0
        with contextlib.suppress(OSError):
            for d in root.iterdir():
                if d.is_dir():
                    n += sum(1 for f in d.iterdir() if (d.name, f.name) not in known)
        return n

    # ------------------------------------------------------------------ idle sessions
    def session_class(self, slot_id: int, kind: str) -> str:
        aux = slot_id == self.state.slots.aux_slot or kind == "aux"
        return class_for(self.settings, "aux" if aux else "conversation")

    def session_limit(self, ttl_class: str) -> float:
        """Idle seconds after which a session is released (short TTL under critical)."""
        limit = self.ttl(ttl_class)
        if self.state.pressure.release_idle_first:
            limit = min(limit, self.ttl("short"))
        return limit

    # ------------------------------------------------------------------ status
    def expiry(self, rec: StateRecord, now: float) -> float | None:
        """Seconds until a saved file expires (negative: overdue), None when pinned."""
        if rec.pinned:
            return None
        return rec.last_used + self.ttl(rec.ttl_class) - now

    def annotate(self, out: CacheStatus) -> None:
        """Add TTL classes and time to expiry to a `CacheManager.status()` dict."""
        now, mono = self.clock.time(), self.clock.monotonic()
        by_name = {r.filename: r for r in self.state.store.all()}
        for entry in out["saved"]:
            rec = by_name.get(entry["file"])
            if rec is not None:
                exp = self.expiry(rec, now)
                entry["expires_in_s"] = None if exp is None else round(exp, 1)
                entry["age_s"] = round(now - rec.last_used, 1)
        for slot in out["slots"]:
            held = self.state.slots.slots
            st = held[slot["id"]] if slot["id"] < len(held) else None
            if st is None or not st.session:
                continue
            cls = self.session_class(st.id, st.last_kind)
            idle = mono - st.last_used
            slot["ttl_class"] = cls
            slot["idle_s"] = round(idle, 1)
            slot["expires_in_s"] = round(self.session_limit(cls) - idle, 1)
        total = sum(r.bytes for r in by_name.values())
        out["disk"] = {
            "used_bytes": total,
            "cap_bytes": self.cap_bytes,
            "cap_source": self.cap_source(),
            "unknown_files_left_alone": self.unknown_files,
            "save_backoff": self.save_backoff.status(),
            "quarantined": dict(self.quarantined),
        }
        out["ttl"] = {c: self.ttl(c) for c in TTL_CLASSES}
        out["ttl_classes"] = {
            "prefix": self.settings.prefix_class,
            "conversation": self.settings.conversation_class,
            "aux": self.settings.aux_class,
        }
