"""Two real models under a budget that fits one: alternating requests swap them, and
the swapped-back model's prefix comes back from disk (restored and verified)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from core.bench.trace import make_trace
from core.cache.manager import CacheManager, policy_factory
from core.config import ModelProfile
from core.engine import Core
from core.machine import devices
from core.models import profiles
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration


async def _idle(core: Core) -> bool:
    assert core.pool is not None
    mgrs = [e.manager for e in core.pool.entries.values() if e.manager is not None]
    return all(m.idle() for m in mgrs) and not core.pool._loading


def test_alternating_models_swap_and_restore_the_prefix(tmp_path: Path) -> None:
    a = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    b = make_tiny_model(cache_dir() / "tiny-32k-seed1.gguf", n_ctx=32768, seed=1)
    s = settings_for(a, server__ctx_per_slot=24576, server__cache_ram_mib=512)
    s.models = [
        ModelProfile(name="a", role="text"),
        ModelProfile(name="b", model=str(b), priority=100),
    ]
    host = devices.read_host(tmp_path)
    fps = [
        profiles.footprint(p, profiles.server_settings(s, p), m, devices.read_gpus(), host)
        for p, m in zip(profiles.profiles(s), (a, b), strict=True)
    ]
    mib = [f.ram // profiles.MIB for f in fps]
    s.pool.ram_floor_mib = 0
    s.pool.ram_budget_mib = max(mib) + min(mib) // 2  # one fits, two do not
    s.pool.vram_budget_mib = 1  # no GPU use expected; tiny models plan on the host
    core = Core(Paths.under(tmp_path / "home"), s, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    try:
        trace = make_trace(sessions=2, turns=1, scale=0.3, restart_before_session=None)
        agent = next(r for r in trace if r.kind == "agent")
        for r in trace:  # model a learns and saves the opencode prefix
            post_chat(core, {**r.body, "model": "a"}, headers=r.headers, timeout=300)
        wait_until(lambda: core.submit(_idle(core)).result(5), 120, message="persist on a")
        mgr = core.policy
        assert isinstance(mgr, CacheManager)
        assert core.call(lambda: mgr.state.store.all(mgr.state.launch_id)).result(10), (
            "a's prefix on disk"
        )

        # /v1/models lists both profiles
        assert core.proxy is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{core.proxy.port}/v1/models") as resp:
            listed = json.loads(resp.read())
        assert [m["id"] for m in listed["data"]] == ["a", "b"]

        # b: a is unloaded to make room (budget fits one), b loads
        body = {**agent.body, "model": "b"}
        reply = post_chat(core, body, headers=agent.headers, timeout=300)
        data, headers = reply.json(), reply.headers
        assert headers["X-Warmslot-Model"] == "b", data
        cold_b = data["timings"]
        st = core.status().result(10)
        states = {m["name"]: m["state"] for m in st["models"]}
        assert states == {"a": "stopped", "b": "ready"}
        wait_until(lambda: core.submit(_idle(core)).result(5), 120, message="persist on b")

        # back to a: b goes, a loads and restores + verifies its prefix before serving
        headers_new = {**agent.headers, "x-session-id": "after-swap"}
        reply = post_chat(core, {**agent.body, "model": "a"}, headers=headers_new, timeout=300)
        data, headers = reply.json(), reply.headers
        assert headers["X-Warmslot-Model"] == "a"
        prefix_n = int(headers["X-Warmslot-Prefix"].split(":")[1])
        # a cold server reuses nothing (b's first request above); after the swap back the
        # restored state serves nearly the whole prompt (the server re-evaluates its tail)
        assert data["timings"]["cache_n"] >= 0.95 * prefix_n, (data["timings"], prefix_n)
        assert cold_b["cache_n"] < 0.1 * prefix_n, cold_b
        restored = core.query("recent_events", limit=200, category="cache", kind="restore_ok")
        assert restored.result(10), "a's prefix was restored from disk after the swap"

        events = core.query("recent_events", limit=200, category="models").result(10)
        kinds = [(e["kind"], e["reason"].split(":")[0]) for e in reversed(events)]
        assert ("unload", "a") in kinds and ("unload", "b") in kinds
        assert kinds.count(("loaded", "b")) == 1 and kinds.count(("loaded", "a")) == 1
        admits = [e for e in events if e["kind"] == "admit"]
        for e in admits:
            numbers = e["details"]
            assert numbers["budget"]["ram_mib"] == s.pool.ram_budget_mib
            assert numbers["need"]["ram_mib"] > 0
            assert numbers["unload"][0]["model"] in ("a", "b")
            assert "fits after unloading" in e["reason"]
        saved = [e["details"] for e in events if e["kind"] == "saved_before_unload"]
        assert saved and all(x["on_disk"] >= 1 for x in saved)
        calls = core.status().result(10)["model_calls"]["by_model"]
        assert calls["a"]["agent"] >= 2 and calls["b"]["agent"] == 1
    finally:
        core.stop()
