"""Disk faults on the save path, against a real llama-server: a failed save
backs off per prefix and leaves no partial file.

- **Disk full during a real save**: the slot directory is a small tmpfs (mounted by the
  test: it needs root), filled so that the next slot file does not fit. llama-server's
  save fails with ENOSPC; Warmslot must delete the partial file at once, record one
  ``save_failed`` event per backoff step (30 s doubling; shortened here), try no save while
  backing off however many requests come, keep serving requests, and save again once
  there is room (which ends the backoff). The pressure monitor must read the slot
  directory's filesystem, not only the state directory's.
- **An undeletable corrupt file** (``chattr +i`` as root, a read-only directory
  otherwise): the rejected restore must not raise, must record one ``undeletable`` event,
  and must drop the file's index row so it is never offered again.
- **kill -9 of ``warmslot serve`` while a save is in flight** (a real subprocess, killed
  the moment the save journal has a row): no orphan llama-server, SQLite
  ``integrity_check`` ok, and after a restart every indexed file matches its row — a
  partial file is never adopted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from core import config
from core.bench.trace import make_trace
from core.cache import prefix as pfx
from core.cache.fingerprint import fingerprint, state_filename
from core.cache.manager import CacheManager, policy_factory
from core.cache.store import StateRecord, file_sha256
from core.engine import Core
from core.errors import CacheError, VerificationFailed
from core.events import CacheEvent, CacheEventKind
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import EventLog, chat_body, free_port, pid_gone, post_chat, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WARMSLOT = Path(sys.executable).parent / "warmslot"
_VOCAB = (
    "the a system worker node cache window token prompt model server slot memory layer river "
    "mountain quiet bright engine signal record table paper letter city market garden winter"
)
_WORDS = _VOCAB.split()


def _text(seed: int, n_words: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[None]:
    """Mount a tmpfs of `size` at `path` for the block (a real filesystem that fills up)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a real ENOSPC needs a small filesystem: mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@dataclass
class Rig:
    core: Core
    mgr: CacheManager
    events: EventLog

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return self.core.submit(coro).result(timeout)

    def prefix(self, seed: int, n_words: int) -> pfx.PrefixInfo:
        async def tokens() -> list[int]:
            client = self.mgr.state.client
            assert client is not None
            return await client.tokenize(_text(seed, n_words))

        toks: list[int] = self.run(tokens())
        assert self.mgr.state.identity is not None
        return pfx.PrefixInfo(
            key=f"disk-{seed}",
            tokens=toks,
            text="",
            source="test",
            client="test",
            fingerprint=fingerprint(self.mgr.state.identity, toks),
        )

    def persist(self, info: pfx.PrefixInfo, times: int = 1) -> list[bool]:
        """What `times` requests with this prefix do after they complete: ask for a save."""

        async def go() -> list[bool]:
            self.mgr.state.by_fp[info.fingerprint] = info
            return [self.mgr.ops.persist_soon(info) for _ in range(times)]

        out: list[bool] = self.run(go())
        return out

    def idle(self) -> None:
        async def idle() -> bool:
            return self.mgr.idle() and not self.mgr.ops.persisting

        wait_until(lambda: self.run(idle()), 180, message="cache work done")

    def record(self, info: pfx.PrefixInfo) -> StateRecord | None:
        rec: StateRecord | None = self.core.call(
            lambda: self.mgr.state.store.for_fingerprint(info.fingerprint)
        ).result(10)
        return rec

    def cache_events(self, kind: CacheEventKind, fp: str = "") -> list[CacheEvent]:
        return [
            e
            for e in self.events.of(CacheEvent)
            if e.kind is kind and (not fp or e.fingerprint == fp[:16])
        ]

    def chat(self, text: str) -> int:
        body = chat_body(text, max_tokens=2)
        r = post_chat(self.core, body, headers={"User-Agent": "disk-faults/1.0"}, timeout=300)
        r.json()  # a whole JSON answer
        return r.status_code


@contextlib.contextmanager
def rig_at(home: Path, model: Path, **changes: Any) -> Iterator[Rig]:
    events = EventLog()
    core = Core(Paths.under(home), settings_for(model, **changes), policy_factory=policy_factory)
    core.subscribe(events.append, (CacheEvent,))
    core.start(wait_ready=True, timeout=300)
    try:
        mgr = core.policy
        assert isinstance(mgr, CacheManager)
        wait_until(lambda: mgr.state.identity is not None, 120, message="server identity")
        rig = Rig(core, mgr, events)
        rig.idle()  # the warm-up after the start (it sets the disk tier) is done
        assert mgr.state.disk.usable, mgr.state.disk.reason
        yield rig
    finally:
        core.stop()


def _slot_files(root: Path) -> list[Path]:
    return sorted(root.rglob("ws-*.bin"))


def _fill(directory: Path, leave: int) -> Path:
    """Write a filler file so that about `leave` bytes stay free on `directory`'s filesystem."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    filler = directory / "filler.dat"  # not a name Warmslot writes: never touched by it
    want = max(0, free - leave) // 4096 * 4096
    with filler.open("wb") as f:
        block = b"\0" * (1 << 16)
        while want > 0:
            f.write(block[: min(len(block), want)])
            want -= min(len(block), want)
    return filler


def test_a_full_disk_during_a_real_save(tmp_path: Path, tiny_model: Path) -> None:
    home = tmp_path / "home"
    slots = Paths.under(home).slot_dir
    # Pressure thresholds at 0: the saves must be attempted to meet the full disk (with the
    # defaults, the pressure monitor — which now watches this filesystem — would pause them).
    # A cap above the disk's size: the disk fills, not the cap (the default, 10 % of the
    # 2 MB free at start, refuses every save: docs/cache.md#disk-cap).
    with (
        small_tmpfs(slots, "2m"),
        rig_at(
            home,
            tiny_model,
            pressure__disk_low_pct=0.0,
            pressure__disk_critical_pct=0.0,
            cache__disk_cap_mb=64,
        ) as rig,
    ):
        mgr = rig.mgr
        first = rig.prefix(1, 300)
        assert rig.persist(first) == [True]
        rig.idle()
        rec = rig.record(first)
        assert rec is not None, [e.reason for e in rig.events.of(CacheEvent)]
        size = rec.bytes
        assert size > 16384, size  # big enough that half a file is several pages

        # The pressure monitor reads the filesystem of the slot files (the tmpfs: the
        # server's own --slot-save-path below it) as well as the state directory's (the
        # test machine's disk, with plenty of room): the fuller one counts.
        assert mgr.state.pressure.sampler is not None
        filler = _fill(slots, leave=size // 2)
        reading = mgr.state.pressure.sampler.read()
        sup = rig.core.supervisor
        assert sup is not None and sup.resolved is not None
        assert Path(reading.disk_path) == sup.resolved.slot_dir, reading
        assert reading.disk_free < size, reading

        # A save that meets the full disk: one event, no partial file, a 2 s backoff.
        mgr.retention.save_backoff.first = 2.0  # 30 s in production; shortened for the test
        second = rig.prefix(2, 300)
        name = state_filename(second.fingerprint)
        assert rig.persist(second) == [True]
        rig.idle()
        failed = rig.cache_events(CacheEventKind.SAVE_FAILED, second.fingerprint)
        assert len(failed) == 1, [e.reason for e in failed]
        ev = failed[0]
        assert "No space left on device" in ev.reason, ev.reason
        assert ev.details["failures"] == 1 and ev.details["retry_in_s"] == 2.0, ev.details
        assert ev.details["partial_deleted_bytes"] > 0, ev.details  # the server left a part
        assert _slot_files(slots) == [mgr.state.store.path(rec)], _slot_files(slots)
        pending = rig.core.call(mgr.retention.journal.pending).result(10)
        assert [r["filename"] for r in pending] == []
        assert rig.record(second) is None

        # While backing off, requests with this prefix try no save (no attempt, no event),
        # and requests are served.
        assert rig.persist(second, times=5) == [False] * 5
        assert rig.chat("a request while the disk is full") == 200
        rig.idle()
        assert len(rig.cache_events(CacheEventKind.SAVE_FAILED, second.fingerprint)) == 1
        assert name not in {p.name for p in _slot_files(slots)}

        # The next step: still full — one more event, the backoff doubles.
        wait_until(lambda: mgr.retention.save_backoff.allows(second.fingerprint), 30)
        assert rig.persist(second) == [True]
        rig.idle()
        failed = rig.cache_events(CacheEventKind.SAVE_FAILED, second.fingerprint)
        assert [(e.details["failures"], e.details["retry_in_s"]) for e in failed] == [
            (1, 2.0),
            (2, 4.0),
        ]
        assert name not in {p.name for p in _slot_files(slots)}

        # Room again: the next try saves, and the backoff is over.
        filler.unlink()
        wait_until(lambda: mgr.retention.save_backoff.allows(second.fingerprint), 30)
        assert rig.persist(second) == [True]
        rig.idle()
        saved = rig.record(second)
        assert saved is not None, [e.reason for e in rig.events.of(CacheEvent)][-5:]
        assert file_sha256(mgr.state.store.path(saved)) == saved.sha256
        assert mgr.retention.save_backoff.status() == []
        assert len(rig.cache_events(CacheEventKind.SAVE_FAILED, second.fingerprint)) == 2


@contextlib.contextmanager
def undeletable(path: Path) -> Iterator[None]:
    """Make `path` impossible to delete: immutable as root, a read-only folder otherwise."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=False)
    else:
        mode = path.parent.stat().st_mode
        path.parent.chmod(0o555)
        try:
            yield
        finally:
            path.parent.chmod(mode)


def test_an_undeletable_corrupt_file_is_quarantined_once(tmp_path: Path, tiny_model: Path) -> None:
    with rig_at(tmp_path / "home", tiny_model) as rig:
        mgr = rig.mgr
        info = rig.prefix(3, 300)
        rig.persist(info)
        rig.idle()
        rec = rig.record(info)
        assert rec is not None
        path = mgr.state.store.path(rec)
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        path.write_bytes(bytes(data))  # corrupt: its sha256 no longer matches the row

        async def restore() -> str:
            async with mgr.ops.lock(0):
                with pytest.raises(VerificationFailed) as err:
                    await mgr.ops.restore(rec, 0)
            return str(err.value)

        with undeletable(path):
            with pytest.raises(OSError):
                path.unlink()  # the fault is real
            reason = rig.run(restore())
            assert "sha256" in reason, reason
            gone = rig.cache_events(CacheEventKind.UNDELETABLE)
            assert len(gone) == 1, [e.reason for e in gone]
            assert gone[0].details["file"] == rec.filename
            assert gone[0].details["error"].split(":")[0] in ("EPERM", "EACCES"), gone[0].details
            assert len(rig.cache_events(CacheEventKind.RESTORE_REJECTED, info.fingerprint)) == 1
            # Quarantined: the row is gone, so no request offers the file to a server again.
            assert rig.record(info) is None and path.exists()
            assert rec.filename in mgr.retention.quarantined
            # The retention sweep leaves it alone and says nothing more.
            rig.run(mgr.retention.sweep_disk())
            assert len(rig.cache_events(CacheEventKind.UNDELETABLE)) == 1
            assert rig.chat("served while an undeletable file sits in the slot folder") == 200

        # A user's eviction of an undeletable file is an error that says why (not a traceback).
        other = rig.prefix(4, 300)
        rig.persist(other)
        rig.idle()
        orec = rig.record(other)
        assert orec is not None
        with (
            undeletable(mgr.state.store.path(orec)),
            pytest.raises(CacheError, match="cannot delete"),
        ):
            rig.run(mgr.evict(orec.filename))


# ----------------------------------------------------------------------------- kill -9


def _serve(home: Path, port: int, err: Path) -> subprocess.Popen[bytes]:
    with err.open("ab") as errf:
        return subprocess.Popen(
            [str(WARMSLOT), "serve", "--port", str(port)],
            env={**os.environ, "WARMSLOT_HOME": str(home)},
            stdout=subprocess.DEVNULL,
            stderr=errf,
        )


def _ready(port: int) -> bool:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/warmslot/status", timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and (r.json().get("server") or {}).get("state") == "ready"


def _journal(db: Path) -> list[str]:
    """Saves in flight (the write journal), read as another process would."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as c:
            return [r[0] for r in c.execute("SELECT filename FROM state_writes")]
    except sqlite3.Error:
        return []  # not created yet, or locked for a moment


def _llama_servers_of(home: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            ours = str(home) in " ".join(p.info["cmdline"] or [])
            server = "llama-server" in (p.info["name"] or "")
            if server and ours and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def test_kill_9_of_serve_during_a_save(tmp_path: Path, tiny_model: Path) -> None:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    home = tmp_path / "home"
    cfg = home / "config" / "warmslot.toml"
    for key, value in (
        ("server.model", str(model)),
        ("server.threads", 2),
        ("server.ctx_per_slot", 24576),
        ("server.cache_ram_mib", 512),
    ):
        config.set_value(cfg, key, value)
    paths = Paths.under(home)
    db = paths.cache_index_db  # the write journal and the states (core.cache.index)
    port = free_port()
    err = tmp_path / "serve.stderr"
    proc = _serve(home, port, err)
    try:
        wait_until(lambda: _ready(port), 180, interval=0.2, message=lambda: err.read_text()[-2000:])
        # Requests that teach Warmslot prefixes, sent from a thread; every learned prefix is
        # saved in the background. Kill -9 the moment a save is journaled (in flight).
        trace = make_trace(sessions=4, turns=2, scale=0.3, restart_before_session=None, seed=19)
        stop = threading.Event()

        def send() -> None:
            with httpx.Client(timeout=300) as http:
                for r in trace:
                    if stop.is_set():
                        return
                    with contextlib.suppress(httpx.HTTPError):
                        http.post(
                            f"http://127.0.0.1:{port}/v1/chat/completions",
                            json=r.body,
                            headers=r.headers,
                        )

        sender = threading.Thread(target=send, daemon=True)
        sender.start()

        def written_not_indexed() -> list[str]:
            # A journaled save whose file the server has written (in part or whole) but that
            # is not indexed yet: the moment a crash must not turn into an adopted file.
            return [n for n in _journal(db) if any(paths.slot_dir.glob(f"*/{n}"))]

        in_flight = wait_until(written_not_indexed, 300, interval=0.002, message="a save")
        server_pids = [p.pid for p in _llama_servers_of(home)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop.set()
        name = in_flight[0]
        sizes = [p.stat().st_size for p in paths.slot_dir.rglob(name)]
        print(f"\nkilled during the save of {name}; its file's size then: {sizes}")

        # No orphan: llama-server goes with the core (its parent-death signal).
        assert server_pids, "no llama-server was running"
        wait_until(lambda: all(pid_gone(p) for p in server_pids), 60, message="orphans")
        assert _llama_servers_of(home) == []
        sender.join(300)
        with contextlib.closing(sqlite3.connect(db)) as c:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

        # A restart never adopts the partial file: every indexed file matches its row.
        proc = _serve(home, port, err)
        wait_until(lambda: _ready(port), 180, interval=0.2, message=lambda: err.read_text()[-2000:])
        httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=trace[-1].body,
            headers=trace[-1].headers,
            timeout=300,
        ).raise_for_status()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, err.read_text()[-2000:]
        with contextlib.closing(sqlite3.connect(db)) as c:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            rows = list(c.execute("SELECT filename, identity, bytes, sha256 FROM states"))
        for filename, identity, nbytes, sha in rows:
            path = paths.slot_dir / identity / filename
            assert path.is_file() and path.stat().st_size == nbytes, filename
            assert file_sha256(path) == sha, filename
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
