"""The prefix cache against a real llama-server and a real (tiny, dense) model."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlite_utils

from core.bench import tracebench
from core.bench.trace import make_trace
from core.cache.manager import CacheManager, policy_factory
from core.cache.store import StateStore
from core.engine import Core
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny32k() -> Path:
    """The tiny dense model with a 32k trained context (opencode-sized prompts fit)."""
    return make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)


def _settings(model: Path) -> Any:
    return settings_for(model, server__ctx_per_slot=24576, server__cache_ram_mib=512)


def _manager(core: Core) -> CacheManager:
    assert isinstance(core.policy, CacheManager)
    return core.policy


def _events(core: Core, kind: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = core.query(
        "recent_events", limit=500, category="cache", kind=kind
    ).result(10)
    return rows


def test_opencode_trace_against_bare_server(tiny32k: Path, tmp_path: Path) -> None:
    """3 sessions × 3 turns, title calls, a restart before session 3; bare server beside it."""
    bare, warm = tracebench.run(
        str(tiny32k), scale=1.0, sessions=3, turns=3, slots=2, ctx=24576, workdir=tmp_path
    )
    print("\n" + tracebench.format_table([bare, warm]))
    assert warm["hit_turns_2_plus"] >= 0.95
    assert warm["hit_first_after_restart"] >= 0.90
    assert bare["hit_first_after_restart"] < 0.10  # a restart loses everything upstream
    assert warm["server_prompt_tokens"] < bare["server_prompt_tokens"], (
        warm["cache_events"],
        warm["rejections"],
    )
    # Title calls never reduce the primary's reuse: each agent turn after a title call
    # reuses at least what the previous agent turn of the same session cached.
    rows = warm["requests"]
    for i, r in enumerate(rows):
        if r["kind"] == "agent" and r["turn"] >= 2:
            prev = rows[i - 1]
            assert r["cache_n"] >= prev["cache_n"] + prev["prompt_n"] - 64


@pytest.fixture
def learned_core(tiny32k: Path, tmp_path: Path) -> Iterator[tuple[Core, list[Any]]]:
    """A Core that has learned and saved one opencode prefix, then was stopped."""
    home = tmp_path / "home"
    trace = make_trace(sessions=2, turns=1, scale=0.3, restart_before_session=None)
    core = Core(Paths.under(home), _settings(tiny32k), policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    for r in trace:
        post_chat(core, r.body, headers=r.headers)
    wait_until(lambda: core.submit(_async_idle(core)).result(5), 120, message="persist")
    assert _events(core, "save"), "the learned prefix was saved"
    core.stop()
    again = Core(Paths.under(home), _settings(tiny32k), policy_factory=policy_factory)
    try:
        yield again, trace
    finally:
        again.stop()


async def _async_idle(core: Core) -> bool:
    return _manager(core).idle()


def _saved_file(core: Core) -> tuple[StateStore, Any]:
    mgr = _manager(core)
    recs = mgr.state.store.all()
    assert recs
    return mgr.state.store, recs[0]


def _restart_and_wait(core: Core) -> CacheManager:
    core.start(wait_ready=True, timeout=120)
    mgr = _manager(core)
    wait_until(lambda: core.submit(_async_idle(core)).result(5), 120, message="warm-up")
    return mgr


def test_good_file_is_restored_and_serves_the_next_session(
    learned_core: tuple[Core, list[Any]],
) -> None:
    core, trace = learned_core
    _restart_and_wait(core)
    events = core.query("recent_events", limit=50, category="cache").result(10)
    assert _events(core, "restore_ok"), [(e["kind"], e["reason"]) for e in events]
    agent = trace[-1]
    r = post_chat(core, agent.body, headers={**agent.headers, "x-session-id": "new"})
    data, headers = r.json(), r.headers
    prefix_n = int(headers["X-Warmslot-Prefix"].split(":")[1])
    assert data["timings"]["cache_n"] >= prefix_n - 1


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "probe", "foreign"])
def test_damaged_state_is_never_used(
    learned_core: tuple[Core, list[Any]], damage: str, tmp_path: Path
) -> None:
    core, _ = learned_core
    # Damage the saved state while Warmslot is stopped, through a throwaway store view.
    index = sqlite_utils.Database(core.paths.cache_index_db)
    store = StateStore(index, core.paths.slot_dir)
    # The prefix's state (the conversation saved at the stop is another file). A server
    # without patch 0004 saves no prefix state of its own: the newest conversation that
    # starts with the prefix brings it back (core.cache.prefix_save), so that one is
    # damaged and the others are dropped.
    states = store.all()
    rec = next((r for r in states if r.kind == "prefix"), states[0])
    for other in states:
        if other.kind != "prefix" and other.filename != rec.filename:
            store.delete(other)
    path = store.path(rec)
    probe: dict[str, Any] = {}
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: rec.bytes // 2])
    elif damage == "corrupt":
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "probe":
        # The file is intact, but its recorded answer differs: as if the restored
        # state silently computed something else
        # (docs/llama-server-facts.md#swa-full-restores-wrong-state).
        probe = dict(rec.probe)
        probe["logprobs"] = [lp - 0.5 for lp in probe["logprobs"]]
        store.table.update(rec.filename, {"probe": json.dumps(probe)})
    else:
        # A file of another configuration (different cell layout: 4 slots, not 2)
        # dressed up as ours, hash and all.
        from core.cache.store import file_sha256

        foreign = tmp_path / "foreign"
        other = Core(
            Paths.under(foreign),
            settings_for(
                Path(core.settings.server.model), server__slots=1, server__ctx_per_slot=24576
            ),
            policy_factory=None,
        )
        other.start(wait_ready=True, timeout=120)
        sup = other.supervisor
        assert sup is not None and sup.base_url is not None
        body = {"prompt": rec.probe["prefix"][:200], "n_predict": 0, "id_slot": 0}
        urllib.request.urlopen(
            urllib.request.Request(
                f"{sup.base_url}/completion",
                data=json.dumps(body).encode(),
                headers=sup.auth_headers(),
            ),
            timeout=60,
        ).read()
        save = {"filename": rec.filename}
        urllib.request.urlopen(
            urllib.request.Request(
                f"{sup.base_url}/slots/0?action=save",
                data=json.dumps(save).encode(),
                headers=sup.auth_headers(),
            ),
            timeout=60,
        ).read()
        assert sup.resolved is not None and sup.resolved.slot_dir is not None
        src = sup.resolved.slot_dir / rec.filename
        other.stop()
        path.write_bytes(src.read_bytes())
        store.table.update(
            rec.filename, {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        )
    index.close()
    mgr = _restart_and_wait(core)
    rejected = _events(core, "restore_rejected")
    assert rejected, f"{damage}: the damaged state was not rejected"
    assert not _events(core, "restore_ok")
    reason = rejected[0]["reason"]
    expected = {"truncate": "size", "corrupt": "sha256", "probe": "log-probs", "foreign": ""}[
        damage
    ]
    assert expected in reason
    # The bad file was deleted; the prefix was rebuilt cold (a fresh file may replace it).
    assert _events(core, "prewarm_cold")
    fresh = core.call(lambda: mgr.state.store.get(rec.filename)).result(10)
    assert fresh is None or fresh.sha256 != rec.sha256 or damage == "probe"
    if fresh is not None and damage == "probe":
        assert fresh.probe["logprobs"] != probe["logprobs"]


def test_divergence_is_diagnosed_and_shown_in_status(tiny32k: Path, tmp_path: Path) -> None:
    core = Core(Paths.under(tmp_path / "h"), _settings(tiny32k), policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    try:
        trace = make_trace(sessions=1, turns=2, scale=0.3, restart_before_session=None)
        first, second = trace[1], trace[2]
        post_chat(core, first.body, headers=first.headers)
        # The second turn's system prompt gained a timestamp near its start: the
        # conversation can only be reused up to there.
        body = json.loads(json.dumps(second.body))
        sys_msg = body["messages"][0]
        sys_msg["content"] = sys_msg["content"][:200] + " [12:34:56] " + sys_msg["content"][200:]
        data = post_chat(core, body, headers=second.headers).json()
        assert data["timings"]["cache_n"] < 200
        wait_until(lambda: _events(core, "divergence"), 30, message="divergence event")
        ev = _events(core, "divergence")[0]
        where = ev["details"]["where"]
        assert where is not None and where["new"].lstrip().startswith("[12:34:56]")
        assert where["token_index"] > 0
        status = core.status().result(10)
        text = status["cache"]["text"]
        assert "last divergence" in text and "12:34:56" in text
        assert status["clients"][0]["client"] == "opencode"
    finally:
        core.stop()


def test_client_hanging_up_during_prefill_is_recorded_and_frees_the_slot(
    tiny32k: Path, tmp_path: Path
) -> None:
    """A client that gives up while llama-server is still prefilling (no byte sent yet)
    is a 499, not an upstream failure, and its slot is not left marked busy."""
    import asyncio

    import aiohttp

    core = Core(Paths.under(tmp_path / "h"), _settings(tiny32k), policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    try:
        assert core.proxy is not None
        url = f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions"
        long_prompt = "alpha beta gamma delta epsilon zeta eta theta " * 600

        async def give_up() -> None:  # a client that hangs up mid-request: not post_chat's
            async with aiohttp.ClientSession() as s:
                with pytest.raises(TimeoutError):
                    async with s.post(
                        url,
                        json={
                            "messages": [{"role": "user", "content": long_prompt}],
                            "stream": True,
                            "max_tokens": 50,
                        },
                        timeout=aiohttp.ClientTimeout(total=0.5),
                    ) as r:
                        await r.read()

        asyncio.run(give_up())
        row = wait_until(
            lambda: next(iter(core.query("recent_requests", limit=1).result(5)), None),
            60,
            message="the request was recorded",
        )
        assert row["status"] == 499 and row["error"] == "client disconnected"
        mgr = _manager(core)
        assert core.call(lambda: [s.inflight for s in mgr.state.slots.slots]).result(5) == [0, 0]
    finally:
        core.stop()
