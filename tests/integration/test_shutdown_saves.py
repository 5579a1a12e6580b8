"""Live conversations at shutdown, with a real `warmslot serve`: the staged stop
saves them in time and a kill -9 during a save leaves nothing that is adopted.

- **A graceful stop saves every live conversation in time**: three agent sessions, each in
  its own slot and well past the shared stable prefix; SIGINT. `warmslot serve` exits 0
  within the staged stop's time (`Core.stop`, 60 s), the conversation saves within their
  share of it (`core.cache.conversations.SHUTDOWN_SAVE_S`), and it leaves no partial file:
  the write journal is empty, every file in the slot folder is indexed and matches its row.
- **kill -9 during a shutdown save adopts nothing**: the same three conversations, SIGINT,
  and SIGKILL the moment a conversation save has its file on disk but not yet in the
  index. After a restart the half-saved file is in no index row (so nothing restores it),
  its journal row marks it for the retention sweep, every indexed file matches its row,
  and that session's next turn is answered without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from core import config
from core.cache.conversations import SHUTDOWN_SAVE_S
from core.cache.store import file_sha256
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import test_cache as cache_dir
from tests.helpers import free_port, pid_gone, post_chat, session_headers, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

WARMSLOT = Path(sys.executable).parent / "warmslot"
STAGED_STOP_S = 60.0  # Core.stop's timeout: what the staged stop allows
SESSIONS = ("agent-a", "agent-b", "agent-c")
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "buffer", "socket", "thread", "module"]
SYSTEM = "You are a careful coding agent. Rules follow.\n" + " ".join(
    WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(300)
)


def _text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * 7 + i // 3) % len(WORDS)] for i in range(n))


def _home(tmp_path: Path) -> tuple[Path, Paths]:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    home = tmp_path / "home"
    cfg = home / "config" / "warmslot.toml"
    for key, value in (
        ("server.model", str(model)),
        ("server.threads", 2),
        ("server.slots", 4),  # three agent slots and the side slot
        ("server.ctx_per_slot", 12288),
        ("server.cache_ram_mib", 0),
        ("cache.conversation_save_tokens", 0),  # saved at the stop, not after responses
    ):
        config.set_value(cfg, key, value)
    return home, Paths.under(home)


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


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows read as another process would (empty while the table does not exist yet)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as c:
            return list(c.execute(sql))
    except sqlite3.Error:
        return []


def _chat(port: int, messages: list[dict[str, str]], session: str) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "seed": 0}
    return post_chat(port, body, headers=session_headers(session))


def _converse(port: int, turns: int = 2) -> dict[str, list[dict[str, str]]]:
    """Each session `turns` turns, in turn; each session in a slot of its own."""
    messages = {s: [{"role": "system", "content": SYSTEM}] for s in SESSIONS}
    slots: dict[str, set[str]] = {s: set() for s in SESSIONS}
    for turn in range(turns):
        for i, s in enumerate(SESSIONS):
            messages[s].append(
                {"role": "user", "content": f"Output {turn}:\n" + _text(i + turn, 500)}
            )
            r = _chat(port, messages[s], s)
            slots[s].add(r.headers["X-Warmslot-Slot"])
            messages[s].append(
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
            )
    assert all(len(v) == 1 for v in slots.values()), slots
    assert len({next(iter(v)) for v in slots.values()}) == len(SESSIONS), slots
    return messages


def _settled(db: Path) -> bool:
    """The background saves after the responses are done: the stable prefix is on disk and
    nothing is being written."""
    prefixes = _rows(db, "SELECT count(*) FROM states WHERE kind = 'prefix'")
    return bool(prefixes) and prefixes[0][0] >= 1 and not _rows(db, "SELECT * FROM state_writes")


def _assert_inventory_matches_the_disk(paths: Paths, db: Path) -> list[str]:
    """Every indexed file is on disk with its size and sha256; returns the indexed names."""
    rows = _rows(db, "SELECT filename, identity, bytes, sha256 FROM states")
    for filename, identity, nbytes, sha in rows:
        path = paths.slot_dir / identity / filename
        assert path.is_file() and path.stat().st_size == nbytes, filename
        assert file_sha256(path) == sha, filename
    return [r[0] for r in rows]


def _llama_servers_of(home: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            ours = str(home) in " ".join(p.info["cmdline"] or [])
            server = "llama-server" in (p.info["name"] or "")
            if server and ours and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _conversation_saves(db: Path) -> list[dict[str, Any]]:
    rows = _rows(db, "SELECT ts, details FROM events WHERE kind = 'save' ORDER BY ts")
    saves = [{"ts": ts, **json.loads(d or "{}")} for ts, d in rows]
    return [s for s in saves if s.get("state") == "conversation"]


def test_a_graceful_stop_saves_every_live_conversation_in_time(tmp_path: Path) -> None:
    home, paths = _home(tmp_path)
    db, index = paths.telemetry_db, paths.cache_index_db  # the history; the states
    port, err = free_port(), tmp_path / "serve.stderr"
    proc = _serve(home, port, err)
    try:
        wait_until(lambda: _ready(port), 180, interval=0.2, message=lambda: err.read_text()[-2000:])
        _converse(port)
        wait_until(lambda: _settled(index), 300, interval=0.1, message="background saves done")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(STAGED_STOP_S + 30) == 0, err.read_text()[-2000:]
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    saves = [s for s in _conversation_saves(db) if s.get("why") == "shutdown"]
    print(f"\nstop took {stopped:.1f} s; shutdown saves: {[(s['session'], s) for s in saves]}")
    assert sorted(s["session"] for s in saves) == sorted(SESSIONS), saves
    span = saves[-1]["ts"] - saves[0]["ts"]
    assert span <= SHUTDOWN_SAVE_S, (span, saves)
    assert stopped <= STAGED_STOP_S, stopped
    # No partial file: nothing left journaled, every file in the slot folder indexed.
    assert _rows(index, "SELECT filename FROM state_writes") == []
    indexed = set(_assert_inventory_matches_the_disk(paths, index))
    on_disk = {p.name for p in paths.slot_dir.glob("*/*.bin")}
    assert on_disk == indexed, (on_disk - indexed, indexed - on_disk)
    for f in (db, index):
        with contextlib.closing(sqlite3.connect(f)) as c:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_kill_9_during_a_shutdown_save_adopts_nothing(tmp_path: Path) -> None:
    home, paths = _home(tmp_path)
    db, index = paths.telemetry_db, paths.cache_index_db  # the history; the states
    port, err = free_port(), tmp_path / "serve.stderr"
    proc = _serve(home, port, err)
    try:
        wait_until(lambda: _ready(port), 180, interval=0.2, message=lambda: err.read_text()[-2000:])
        messages = _converse(port)
        wait_until(lambda: _settled(index), 300, interval=0.1, message="background saves done")
        server_pids = [p.pid for p in _llama_servers_of(home)]
        assert server_pids, "no llama-server was running"
        before = {r[0] for r in _rows(index, "SELECT filename FROM states")}

        def written_not_indexed() -> list[str]:
            # A shutdown save whose file the server has written but that is not indexed.
            names = [r[0] for r in _rows(index, "SELECT filename FROM state_writes")]
            return [n for n in names if any(paths.slot_dir.glob(f"*/{n}"))]

        proc.send_signal(signal.SIGINT)
        in_flight = wait_until(written_not_indexed, 120, interval=0.002, message="a save")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        name = in_flight[0]
        assert name not in before
        size = [p.stat().st_size for p in paths.slot_dir.rglob(name)]
        print(f"\nkilled during the shutdown save of {name} ({size} bytes on disk)")
        wait_until(lambda: all(pid_gone(p) for p in server_pids), 60, message="orphans")
        for f in (db, index):
            with contextlib.closing(sqlite3.connect(f)) as c:
                assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        killed_saves = len(_conversation_saves(db))

        # Started again: the half-saved file is in no index row, so nothing restores it;
        # its journal row leaves it to the retention sweep.
        proc = _serve(home, port, err)
        wait_until(lambda: _ready(port), 180, interval=0.2, message=lambda: err.read_text()[-2000:])
        indexed = _assert_inventory_matches_the_disk(paths, index)
        assert name not in indexed
        journaled = {r[0] for r in _rows(index, "SELECT filename FROM state_writes")}
        assert name in journaled or not any(paths.slot_dir.rglob(name)), journaled
        # Every session's next turn is answered; none restores the half-saved file.
        for i, s in enumerate(SESSIONS):
            more = [*messages[s], {"role": "user", "content": "Next:\n" + _text(9 + i, 50)}]
            r = _chat(port, more, s)
            print(s, r.headers.get("X-Warmslot-Conversation"), r.json()["timings"])
        assert name not in _assert_inventory_matches_the_disk(paths, index)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(STAGED_STOP_S + 30) == 0, err.read_text()[-2000:]
        print(f"conversation saves before the kill: {killed_saves}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert _llama_servers_of(home) == []
