"""A damaged history never stops Warmslot, and never costs it its saved states.

One Warmslot learns an opencode-shaped prefix and saves it to disk (a tiny dense
model, so the disk tier is on with a stock server) and is stopped; each test starts
from a copy of that install. The history database (``telemetry.sqlite3``) is then
deleted or damaged in each way a user meets (tests/db_damage.py: truncated, emptied,
not a database, locked by another process for the whole test, a directory in its
place, the file or its folder read-only, garbage rows), and Warmslot must:

- start, and say in a Notice what it did about the history;
- restore the saved prefix from disk, verified (``restore_ok`` of the boot re-warm),
  and serve a new session's agent turn from it;
- do the same again at the next restart while the damage lasts (a lock, a read-only file
  or folder, garbage rows); damage it moved aside leaves a fresh history, an ordinary
  restart.

The cache index is its own file (core.cache.index), so nothing of the history is
needed for any of it. The same with a real `warmslot serve`: no traceback, and
`warmslot status` answers even with garbage rows in the history.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import config
from core.bench.trace import TraceRequest, iter_agent_turns, make_trace
from core.cache.manager import policy_factory
from core.engine import Core
from core.events import Notice
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.db_damage import WAYS, damaged, garbage_rows
from tests.helpers import (
    EventLog,
    cache_idle,
    free_port,
    post_chat,
    session_headers,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WARMSLOT = Path(sys.executable).parent / "warmslot"
# What the Notice about the history says, per way (part of its sentence).
SAID = {
    "truncated": "damaged or cut short",
    "zero-length": "the file was empty (0 bytes)",
    "not-a-database": "not a SQLite database",
    "locked": "another process holds a lock on it",
    "directory": "a directory is in its place",
    "read-only-file": "cannot be written",
    "read-only-folder": "cannot be written",
}


# Damage that is still there at the next start: only there does a second restart say more.
LASTING = ("locked", "read-only-file", "read-only-folder", "garbage-rows")


@dataclass(frozen=True)
class Learned:
    home: Path  # the pristine install: copy it, never use it
    prefix: str  # the saved prefix's fingerprint
    agent: TraceRequest  # a third session's first agent turn (its prefix is the saved one)


def _config(home: Path, model: Path) -> None:
    """The install's settings, in its config file (read by Core and `warmslot serve` alike)."""
    cfg = Paths.under(home).config_file
    for key, value in (
        ("server.model", str(model)),
        ("server.threads", 2),
        ("server.slots", 2),
        ("server.ctx_per_slot", 24576),
        ("server.cache_ram_mib", 512),
    ):
        config.set_value(cfg, key, value)


def _again(learned: Learned, session: str) -> dict[str, str]:
    """The headers that send the learned agent turn again, as `session`."""
    return {**learned.agent.headers, **session_headers(session)}


def _cache(core: Core) -> dict[str, Any]:
    status: dict[str, Any] = core.status().result(30)["cache"]
    return status


@pytest.fixture(scope="module")
def learned(tmp_path_factory: pytest.TempPathFactory, server_binary: Path) -> Learned:
    """An install whose index holds one saved, verified prefix (~30 s, once per module)."""
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    home = tmp_path_factory.mktemp("learned") / "home"
    _config(home, model)
    paths = Paths.under(home)
    trace = make_trace(sessions=3, turns=1, scale=1.0, restart_before_session=None)
    agents = list(iter_agent_turns(trace))
    core = Core(
        paths,
        config.load(paths.config_file).replace("proxy.port", 0),
        policy_factory=policy_factory,
    )
    core.start(wait_ready=True, timeout=300)
    try:
        assert core.proxy is not None
        for r in trace:
            if r.session != agents[2].session:
                headers = post_chat(core, r.body, headers=r.headers).headers
        prefix = headers["X-Warmslot-Prefix"].split(":")[0]
        wait_until(
            lambda: (
                cache_idle(core)
                and any(s["fingerprint"] == prefix[:16] for s in _cache(core)["saved"])
            ),
            300,
            interval=0.2,
            message=lambda: f"the prefix saved: {_cache(core)['saved']}",
        )
    finally:
        core.stop()
    return Learned(home, prefix, agents[2])


@pytest.fixture
def install(learned: Learned, tmp_path: Path) -> Paths:
    """A copy of the learned install for one test."""
    home = tmp_path / "home"
    shutil.copytree(learned.home, home)
    return Paths.under(home)


def _restores_and_serves(
    make_core: MakeCore, paths: Paths, learned: Learned, session: str, *, in_memory: bool
) -> tuple[list[str], dict[str, str]]:
    """Start Warmslot on `paths`; it restores the saved prefix from disk (verified) and
    serves `session`'s agent turn from it. Returns its warnings and that answer's headers.
    `in_memory`: the state folder cannot be written, so the index is rebuilt in memory."""
    core = make_core(
        config.load(paths.config_file),
        home=paths.config_dir.parent,
        policy_factory=policy_factory,
        proxy__port=0,
    )
    notices = EventLog()
    core.subscribe(notices.append, (Notice,))
    core.start(wait_ready=True, timeout=300)
    try:
        boot = wait_until(
            lambda: (b := _cache(core)["boot_rewarm"])["state"] == "done" and b,
            300,
            interval=0.2,
            message=lambda: f"boot re-warm: {_cache(core)['boot_rewarm']}",
        )
        restored = core.query(
            "recent_events", category="cache", kind="restore_ok", since=core.started_at
        ).result(30)
        assert [e["fingerprint"] for e in restored] == [learned.prefix[:16]], boot
        assert boot["warmed"] == 1, boot
        assert core.proxy is not None
        r = post_chat(core, learned.agent.body, headers=_again(learned, session))
        data, headers = r.json(), r.headers
        if not in_memory:
            assert headers["X-Warmslot-Prefix"].startswith(learned.prefix), headers
        # else the prefix definitions, which only the index file keeps, are not known this
        # run: the request takes its prefix anew (its system text and tools) and is
        # served from a saved state all the same.
        cached, read = data["timings"]["cache_n"], data["timings"]["prompt_n"]
        assert cached >= 0.9 * (cached + read), data["timings"]
        core.status().result(30)  # the history's queries answer, whatever is in it
        events = core.query("recent_events", limit=100_000).result(30)
        assert all(isinstance(e["details"], dict) for e in events)
    finally:
        core.stop()
    return [n.text for n in notices.of(Notice) if n.level == "warning"], headers


@pytest.mark.parametrize("way", ["deleted", *WAYS])
def test_a_damaged_history_costs_no_saved_state(
    make_core: MakeCore,
    learned: Learned,
    install: Paths,
    way: str,
) -> None:
    db = install.telemetry_db
    if way == "deleted":
        for p in db.parent.glob(db.name + "*"):
            p.unlink()
    with damaged(db, way) if way != "deleted" else contextlib.nullcontext():
        ro = way == "read-only-folder"
        said, _ = _restores_and_serves(make_core, install, learned, f"after-{way}", in_memory=ro)
        history = [t for t in said if "history database" in t]
        if way in SAID:
            assert len(history) == 1 and SAID[way] in history[0], said
            assert str(db) in history[0]
        else:  # deleted: a fresh history is nothing to warn about; garbage rows are read past
            assert history == [], said
        if way not in LASTING:
            # Moved aside, a fresh history in its place: the next start is an ordinary
            # restart (tests/integration/test_restart_warm.py), so it is not run again here.
            aside = sorted(p.name for p in db.parent.glob(db.name + ".broken-*"))
            # An empty file is an empty database: used as it is (and said), not moved.
            assert (aside != []) == (way in ("truncated", "not-a-database", "directory")), aside
            assert db.is_file() and db.stat().st_size > 0
            return
        # The damage lasts (a lock, a read-only file or folder): the next restart restores
        # the verified state again under it.
        again, _ = _restores_and_serves(make_core, install, learned, f"again-{way}", in_memory=ro)
    print(f"\n{way}: {said} / then: {again}")
    if way == "read-only-folder":  # the index's folder too: rebuilt in memory, each time
        assert any("the cache index" in t and "in memory" in t for t in again), again
    else:
        assert not [t for t in again if "cache index" in t], again  # never touched


# ------------------------------------------------------------------ warmslot serve
def _serve(home: Path, port: int, err: Path) -> subprocess.Popen[bytes]:
    with err.open("ab") as errf:
        return subprocess.Popen(
            [str(WARMSLOT), "serve", "--port", str(port)],
            env={**os.environ, "WARMSLOT_HOME": str(home)},
            stdout=errf,
            stderr=errf,
        )


def _ready(port: int) -> bool:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/warmslot/status", timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and (r.json().get("server") or {}).get("state") == "ready"


def test_warmslot_serve_with_a_broken_history_says_so_and_serves(
    install: Paths, learned: Learned, tmp_path: Path
) -> None:
    """`warmslot serve` on the copied install whose history is not a database: it says
    so, serves from the restored prefix, `warmslot status` answers with garbage rows in
    the history, it stops cleanly, and no traceback is shown anywhere."""
    out, port, home = tmp_path / "serve.out", free_port(), install.config_dir.parent
    env = {**os.environ, "WARMSLOT_HOME": str(home)}
    with damaged(install.telemetry_db, "not-a-database"):
        proc = _serve(home, port, out)
        try:
            wait_until(lambda: _ready(port), 300, interval=0.2, message=lambda: out.read_text())
            headers = post_chat(port, learned.agent.body, headers=_again(learned, "served")).headers
            assert headers["X-Warmslot-Prefix"].startswith(learned.prefix), headers
            garbage_rows(install.telemetry_db)  # into the fresh history, while it runs
            status = subprocess.run(
                [str(WARMSLOT), "status"], env=env, capture_output=True, text=True, timeout=120
            )
            proc.send_signal(signal.SIGINT)
            assert proc.wait(90) == 0, out.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "Traceback" not in status.stdout + status.stderr, status.stderr
    text = out.read_text()
    print(text[-3000:])
    assert "warmslot: the history database" in text and "not a SQLite database" in text, text
    assert "moved it to telemetry.sqlite3.broken-" in text, text
    assert "Traceback" not in text, text
