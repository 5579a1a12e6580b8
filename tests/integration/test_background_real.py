"""The background core against a real llama-server and the tiny dense model, on a fake clock.

- An idle session is persisted and its slot released; another session takes the
  slot; when the first one comes back its prefix is restored from disk (verified)
  and its request reuses the whole prefix.
- A one-hour time-compressed soak: the fake clock drives the real sweeps
  (pressure, sessions, keep-alive, retention) while sessions come and go, under
  a small disk cap and with one pinned prefix.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.bench.trace import TraceRequest, make_trace
from core.cache.manager import CacheManager, policy_factory
from core.cache.store import card_name
from core.clock import FakeClock
from core.config import Settings
from core.engine import Core
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration

N_SWEEPS = 4  # pressure, sessions, keepalive, retention: all parked on the clock when idle


@pytest.fixture(scope="module")
def tiny32k() -> Path:
    """The tiny dense model with a 32k trained context (opencode-shaped prompts fit)."""
    return make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)


def _settings(model: Path, **changes: Any) -> Settings:
    # No RAM cache: a prefix that comes back can only come from the disk tier.
    base = {"server__ctx_per_slot": 8192, "server__cache_ram_mib": 0}
    s = settings_for(model, **{**base, "pressure__sample_interval_s": 60.0, **changes})
    # Whatever this machine's memory looks like, pressure stays nominal.
    for name in ("ram", "vram", "disk"):
        setattr(s.pressure, f"{name}_low_pct", 0.0)
        setattr(s.pressure, f"{name}_critical_pct", 0.0)
    return s


def _project(trace: list[TraceRequest], project: str) -> list[TraceRequest]:
    """The trace as sent from another project: a different stable prefix."""
    for r in trace:
        if r.kind == "agent":
            system = r.body["messages"][0]
            system["content"] = f"Project {project}. " + system["content"]
    return trace


def _manager(core: Core) -> CacheManager:
    assert isinstance(core.policy, CacheManager)
    return core.policy


def _events(core: Core, kind: str, limit: int = 5000) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = core.query(
        "recent_events", limit=limit, category="cache", kind=kind
    ).result(10)
    return rows[::-1]  # oldest first


def _live_slots(core: Core) -> dict[int, int]:
    assert core.supervisor is not None and core.supervisor.base_url is not None
    sup = core.supervisor
    req = urllib.request.Request(f"{sup.base_url}/slots", headers=sup.auth_headers())
    with urllib.request.urlopen(req, timeout=30) as resp:
        return {int(s["id"]): int(s.get("n_prompt_tokens", 0)) for s in json.loads(resp.read())}


@pytest.fixture
def started() -> Iterator[Any]:
    """``started(home, settings)`` → a running Core on a FakeClock, its manager settled."""
    made: list[Core] = []

    def start(home: Path, settings: Settings) -> tuple[Core, FakeClock]:
        clock = FakeClock(start=time.time())
        core = Core(Paths.under(home), settings, policy_factory=policy_factory, clock=clock)
        made.append(core)
        core.start(wait_ready=True, timeout=120)
        settle(core, clock, "cache manager ready")
        return core, clock

    yield start
    for core in made:
        core.stop()


def settle(core: Core, clock: FakeClock, what: str) -> None:
    """Wait until the manager's own work (persist, restore) is done and every sweep parks."""
    mgr = _manager(core)

    async def idle() -> bool:
        return mgr.idle() and mgr.state.identity is not None and clock.sleepers == N_SWEEPS

    wait_until(lambda: core.submit(idle()).result(5), 120, message=what)


def on_core(core: Core, fn: Any) -> Any:
    """Call `fn()` on the core's loop thread (the telemetry database lives there)."""

    async def call() -> Any:
        return fn()

    return core.submit(call()).result(30)


def advance(core: Core, clock: FakeClock, seconds: float) -> None:
    core.submit(clock.advance(seconds)).result(300)


def test_idle_session_is_saved_released_and_restored_when_it_returns(
    tiny32k: Path, tmp_path: Path, started: Any
) -> None:
    settings = _settings(tiny32k, cache__ttl_long_s=600)
    core, clock = started(tmp_path / "h", settings)
    mgr = _manager(core)
    a = _project(make_trace(sessions=1, turns=2, scale=0.05, restart_before_session=None), "a")
    b = _project(
        make_trace(sessions=1, turns=1, scale=0.05, restart_before_session=None, seed=5), "b"
    )
    assert a[0].session != b[0].session

    # Session A: a title call (side slot), then its first agent turn.
    post_chat(core, a[0].body, headers=a[0].headers)
    headers = post_chat(core, a[1].body, headers=a[1].headers).headers
    slot_a = int(headers["X-Warmslot-Slot"])
    fp_a, n = headers["X-Warmslot-Prefix"].split(":")
    prefix_a = int(n)
    settle(core, clock, "A's prefix saved")
    (saved_a,) = [r for r in on_core(core, mgr.state.store.all) if r.fingerprint.startswith(fp_a)]

    # Idle past the conversation TTL (long, 600 s here): released by the sessions sweep.
    advance(core, clock, 600 + 60)
    settle(core, clock, "sessions sweep")
    released = [e for e in _events(core, "evicted") if e["details"].get("rule") == "idle_session"]
    assert [e["details"]["session"] for e in released] == [a[0].session]
    assert released[0]["slot"] == slot_a and released[0]["details"]["ttl_class"] == "long"
    assert "its prefix is already saved on disk" in released[0]["reason"]
    assert a[0].session not in on_core(core, lambda: dict(mgr.state.slots.sessions))

    # Session B (another project: another prefix) gets A's slot.
    post_chat(core, b[0].body, headers=b[0].headers)
    headers_b = post_chat(core, b[1].body, headers=b[1].headers).headers
    assert int(headers_b["X-Warmslot-Slot"]) == slot_a, "B reuses the released slot"
    assert not headers_b["X-Warmslot-Prefix"].startswith(fp_a)
    settle(core, clock, "B's prefix saved")
    assert _live_slots(core)[slot_a] > 0
    assert not _events(core, "restore_ok")

    # A comes back: its whole conversation (saved at the release, more than its prefix)
    # is restored from disk, verified, and its turn reuses it (docs/cache.md#conversations).
    (conv,) = [r for r in on_core(core, mgr.state.store.all) if r.session == a[0].session]
    assert conv.kind == "conversation" and conv.n_tokens > prefix_a
    assert "conversation" in released[0]["reason"]
    r = post_chat(core, a[2].body, headers=a[2].headers)
    data, headers = r.json(), r.headers
    assert int(headers["X-Warmslot-Slot"]) == slot_a
    assert headers["X-Warmslot-Prefix"] == f"{fp_a}:{prefix_a}"
    assert headers.get("X-Warmslot-Conversation", "").startswith("restored"), (
        headers,
        [e["reason"] for e in _events(core, "restore_rejected") + _events(core, "bypass")],
    )
    (restored,) = _events(core, "restore_ok")
    assert restored["slot"] == slot_a and restored["tokens"] == conv.n_tokens
    assert restored["reason"] == "restored and verified"
    rec = on_core(core, lambda: mgr.state.store.get(conv.filename))
    assert rec is not None and rec.verify_result == "ok"
    cache_n = int(data["timings"]["cache_n"])
    assert cache_n >= conv.n_tokens - 64, (cache_n, conv.n_tokens)
    print(
        f"\nA's {conv.n_tokens}-token conversation ({conv.bytes} bytes on disk; its prefix "
        f"{prefix_a} tokens, {saved_a.bytes} bytes) restored into slot {slot_a} after B used "
        f"it; A's next turn: cache_n {cache_n}, prompt_n {data['timings']['prompt_n']}"
    )


def _disk_files(core: Core) -> dict[str, int]:
    """Every file under the state directory's slot folders, by relative path → bytes."""
    root = core.paths.slot_dir
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_one_hour_soak_under_a_small_disk_cap_with_a_pinned_prefix(
    tiny32k: Path, tmp_path: Path, started: Any
) -> None:
    """An hour on the fake clock: 5-minute steps, a new session (another project) in most
    steps, some sessions returning, one pinned prefix; then a quiet quarter hour."""
    t0 = time.monotonic()
    cap_mb = 1
    settings = _settings(
        tiny32k,
        server__slots=3,  # two primary slots and the side-call slot
        cache__disk_cap_mb=cap_mb,
        cache__keep_recent=1,
        cache__ttl_long_s=900,  # conversations released after 15 idle minutes
        cache__ttl_extended_s=1800,  # saved prefixes expire after 30 unused minutes
        pressure__sample_interval_s=30.0,
    )
    core, clock = started(tmp_path / "h", settings)
    mgr = _manager(core)
    cap = cap_mb << 20
    step = 300.0

    def session(project: str, seed: int) -> list[TraceRequest]:
        trace = make_trace(sessions=1, turns=2, scale=0.1, restart_before_session=None, seed=seed)
        return _project(trace, project)

    # The pinned prefix: the first session's, saved and pinned by the user.
    pinned_trace = session("pinned", 100)
    post_chat(core, pinned_trace[0].body, headers=pinned_trace[0].headers)
    headers = post_chat(core, pinned_trace[1].body, headers=pinned_trace[1].headers).headers
    fp_pinned, n = headers["X-Warmslot-Prefix"].split(":")
    n_pinned = int(n)
    settle(core, clock, "pinned prefix saved")
    (pin_rec,) = [
        r for r in on_core(core, mgr.state.store.all) if r.fingerprint.startswith(fp_pinned)
    ]
    core.pin(pin_rec.filename, True).result(10)

    # Minutes 0–45: a new session of another project every step (two projects come back
    # with new sessions); every other step an older session comes back for its 2nd turn.
    projects = ["a", "b", "c", "d", "e", "a", "f", "b", "g"]
    live: list[list[TraceRequest]] = [pinned_trace]
    peak = 0
    for i, project in enumerate(projects):
        trace = session(project, 200 + i)
        post_chat(core, trace[0].body, headers=trace[0].headers)
        post_chat(core, trace[1].body, headers=trace[1].headers)
        live.append(trace)
        if i % 2 == 1:
            back = live.pop(0)
            post_chat(core, back[2].body, headers=back[2].headers)
        settle(core, clock, f"step {i}")
        peak = max(peak, sum(_disk_files(core).values()))
        advance(core, clock, step / 2)
        settle(core, clock, f"step {i}, half way")
        peak = max(peak, sum(_disk_files(core).values()))
        advance(core, clock, step / 2)
        settle(core, clock, f"step {i} done")
    # Minutes 45–60: quiet; sessions go idle and are released, the sweeps keep running.
    while clock.monotonic() < 3600:
        advance(core, clock, 60)
        settle(core, clock, "quiet minute")

    # Disk usage under the cap (state files and their records, as the cap counts them);
    # every file on disk is one the index knows, or its record beside it.
    files = _disk_files(core)
    recs = on_core(core, mgr.state.store.all)
    assert sum(files.values()) <= cap, (sum(files.values()), cap)
    states = {f"{r.identity}/{r.filename}" for r in recs}
    assert states | {card_name(s) for s in states} == set(files)
    used = sum(size for name, size in files.items() if name in states)
    assert sum(r.bytes for r in recs) == used

    # The pinned prefix is on disk, in a slot, and the slot really holds it.
    rec = on_core(core, lambda: mgr.state.store.get(pin_rec.filename))
    assert rec is not None and rec.pinned
    slots = on_core(core, lambda: [(s.id, s.prefix_fp) for s in mgr.state.slots.slots])
    holding = [sid for sid, fp in slots if fp.startswith(fp_pinned)]
    assert holding, f"the pinned prefix is cold: {slots}"
    live_tokens = _live_slots(core)
    assert any(live_tokens[sid] >= n_pinned for sid in holding), (holding, live_tokens)
    # It did not just stay put: sessions took its slot, and keep-alive brought it back.
    kept = [e for e in _events(core, "keepalive") if e["fingerprint"] == fp_pinned]
    assert kept, "keep-alive never had to bring the pinned prefix back"

    # The eviction log adds up to the bytes freed.
    saves = _events(core, "save")
    evicted = _events(core, "evicted")
    files_evicted = [e for e in evicted if e["details"].get("rule") != "idle_session"]
    released = [e for e in evicted if e["details"].get("rule") == "idle_session"]
    assert not _events(core, "restore_rejected") and not _events(core, "invalidated")
    written = sum(int(e["bytes"]) for e in saves)
    freed = sum(int(e["bytes"]) for e in files_evicted)
    assert freed == written - used, (written, freed, used)
    assert all(int(e["bytes"]) > 0 for e in files_evicted)
    assert not any(e["details"]["file"] == pin_rec.filename for e in files_evicted)
    rules = sorted({e["details"]["rule"] for e in files_evicted})
    assert "cap" in rules, rules
    runs = core.query("sweep_runs", sweep="retention", limit=100).result(10)
    # States are also deleted on the spot (a superseded conversation) and by a save that
    # makes room under the cap: evictions too, but not the retention sweep's.
    swept = sum(int(e["bytes"]) for e in files_evicted if e["details"].get("by") == "sweep")
    assert sum(int(r["details"].get("freed_bytes", 0)) for r in runs) == swept
    assert len(runs) == 12 and not any(r["error"] for r in runs)
    for name in ("sessions", "keepalive", "pressure"):
        assert not any(
            r["error"] for r in core.query("sweep_runs", sweep=name, limit=500).result(10)
        )
    restores = _events(core, "restore_ok")
    wall = time.monotonic() - t0
    print(
        f"\nsoak: {len(projects) + 1} sessions, {len(saves)} saves ({written} bytes), "
        f"{len(files_evicted)} files evicted ({freed} bytes; rules {rules}), "
        f"{len(released)} idle sessions released, {len(restores)} verified restores; "
        f"disk peak {peak} → end {used} bytes, cap {cap}; "
        f"{len(kept)} keep-alive re-warms of the pinned prefix; wall {wall:.1f} s"
    )
    assert wall < 120
