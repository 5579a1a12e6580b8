"""Keep-alive against a real llama-server and the tiny dense model, on a fake clock.

A pinned prefix displaced from its slot (another client used the slot behind
Warmslot's back) is back within one keep-alive interval; re-warming it while
it is resident costs one token, measured from the server's own timings.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from core.cache.manager import CacheManager, policy_factory
from core.clock import FakeClock
from core.engine import Core
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import settings_for
from tests.conftest import test_cache as model_cache
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration


def _live_tokens(core: Core, slot: int) -> int:
    assert core.supervisor is not None and core.supervisor.base_url is not None
    sup = core.supervisor
    req = urllib.request.Request(f"{sup.base_url}/slots", headers=sup.auth_headers())
    with urllib.request.urlopen(req, timeout=30) as resp:
        slots = json.loads(resp.read())
    return int(slots[slot].get("n_prompt_tokens", 0))


@pytest.mark.parametrize("cache_ram_mib", [256, 0], ids=["ram-cache", "no-ram-cache"])
def test_keepalive_brings_back_a_displaced_pinned_prefix_and_costs_one_token_when_resident(
    tmp_path: Path, cache_ram_mib: int
) -> None:
    from core.bench.trace import make_trace

    model = make_tiny_model(model_cache() / "tiny-32k.gguf", n_ctx=32768)
    clock = FakeClock(start=time.time())
    settings = settings_for(model, server__ctx_per_slot=8192, server__cache_ram_mib=cache_ram_mib)
    core = Core(Paths.under(tmp_path / "h"), settings, policy_factory=policy_factory, clock=clock)
    core.start(wait_ready=True, timeout=120)
    try:
        mgr = core.policy
        assert isinstance(mgr, CacheManager)

        async def idle() -> bool:
            return mgr.idle() and mgr.state.identity is not None and clock.sleepers == 4

        wait_until(lambda: core.submit(idle()).result(5), 60, message="cache manager ready")
        for r in make_trace(sessions=1, turns=1, scale=0.05, restart_before_session=None):
            headers = post_chat(core, r.body, headers=r.headers).headers
        slot = int(headers["X-Warmslot-Slot"])
        fp, n = headers["X-Warmslot-Prefix"].split(":")
        n_prefix = int(n)
        wait_until(lambda: core.submit(idle()).result(5), 120, message="prefix saved")
        saved = [s for s in core.status().result(10)["cache"]["saved"] if s["fingerprint"] == fp]
        assert saved, "the learned prefix was saved"
        core.pin(saved[0]["file"], True).result(10)
        assert _live_tokens(core, slot) > n_prefix  # the conversation sits on the prefix

        # Another client uses the slot directly, behind Warmslot's back.
        assert core.supervisor is not None and core.supervisor.base_url is not None
        post_chat(
            core.supervisor.base_url,
            {"prompt": "Something else entirely, about ships.", "n_predict": 2, "id_slot": slot},
            path="/completion",
            headers=core.supervisor.auth_headers(),  # a client holding the server's key
        )
        assert _live_tokens(core, slot) < n_prefix

        interval = settings.cache.keepalive_interval_s
        core.submit(clock.advance(interval)).result(120)  # one keep-alive interval
        assert _live_tokens(core, slot) == n_prefix, "the prefix is back in its slot"
        events = core.query("recent_events", limit=50, category="cache", kind="keepalive")
        (displaced,) = events.result(10)
        d = displaced["details"]
        assert displaced["slot"] == slot and d["resident"] is False
        assert displaced["reason"].startswith("displaced")
        assert d["cache_n"] + d["prompt_n"] == n_prefix
        print(
            f"\n[{cache_ram_mib} MiB RAM cache] displaced re-warm of {n_prefix} tokens: "
            f"cache_n {d['cache_n']}, prompt_n {d['prompt_n']}, {d['prompt_ms']:.1f} ms"
        )

        # Resident and idle for 80 % of the short TTL: re-warmed for one token.
        core.submit(clock.advance(interval)).result(120)
        rows = core.query("recent_events", limit=50, category="cache", kind="keepalive")
        resident = rows.result(10)[0]
        r = resident["details"]
        assert r["resident"] is True and "idle 240 s" in resident["reason"]
        assert r["cost_tokens"] == 1 and r["prompt_n"] == 1
        assert r["cache_n"] == n_prefix - 1
        assert _live_tokens(core, slot) == n_prefix
        print(
            f"[{cache_ram_mib} MiB RAM cache] resident re-warm: cache_n {r['cache_n']}, "
            f"prompt_n {r['prompt_n']}, {r['prompt_ms']:.2f} ms"
        )

        runs = core.query("sweep_runs", sweep="keepalive").result(10)
        assert [x["actions"] for x in runs] == [1, 1] and all(not x["error"] for x in runs)
        status = core.status().result(10)["cache"]
        assert "sweep keepalive every 4 min: last run 1 actions" in status["text"]
    finally:
        core.stop()


def test_a_rewarmed_prefix_without_a_saved_state_is_saved_from_its_slot(tmp_path: Path) -> None:
    """Keep-alive re-prefilled a displaced prefix whose state was gone, and the next
    displacement prefilled it again. On the patched server (0004) it is now saved from
    the slot the re-warm filled: a disk write, no prefill."""
    from core.bench.trace import make_trace

    model = make_tiny_model(model_cache() / "tiny-32k.gguf", n_ctx=32768)
    clock = FakeClock(start=time.time())
    settings = settings_for(model, server__ctx_per_slot=8192, server__cache_ram_mib=0)
    core = Core(Paths.under(tmp_path / "h"), settings, policy_factory=policy_factory, clock=clock)
    core.start(wait_ready=True, timeout=120)
    try:
        mgr = core.policy
        assert isinstance(mgr, CacheManager)

        async def idle() -> bool:
            return mgr.idle() and mgr.state.identity is not None and clock.sleepers == 4

        wait_until(lambda: core.submit(idle()).result(5), 60, message="cache manager ready")
        assert mgr.state.identity is not None and "prefix-save-v1" in mgr.state.identity.patches
        for r in make_trace(sessions=1, turns=1, scale=0.05, restart_before_session=None):
            headers = post_chat(core, r.body, headers=r.headers).headers
        slot = int(headers["X-Warmslot-Slot"])
        fp, n = headers["X-Warmslot-Prefix"].split(":")
        n_prefix = int(n)
        wait_until(lambda: core.submit(idle()).result(5), 120, message="prefix saved")

        def saved() -> list[dict[str, Any]]:
            states = core.status().result(10)["cache"]["saved"]
            return [s for s in states if s["fingerprint"] == fp]

        (state,) = saved()
        core.evict(state["file"]).result(10)  # its state is gone; its definition stays
        assert saved() == []
        # Another client uses the slot directly, behind Warmslot's back.
        assert core.supervisor is not None and core.supervisor.base_url is not None
        post_chat(
            core.supervisor.base_url,
            {"prompt": "Something else entirely, about ships.", "n_predict": 2, "id_slot": slot},
            path="/completion",
            headers=core.supervisor.auth_headers(),
        )
        core.submit(clock.advance(settings.cache.keepalive_interval_s)).result(120)
        assert _live_tokens(core, slot) == n_prefix, "the prefix is back in its slot"
        rows = core.query("recent_events", limit=50, category="cache", kind="keepalive")
        (rewarm,) = rows.result(10)
        assert rewarm["details"]["saving"] is True, rewarm
        wait_until(lambda: core.submit(idle()).result(5) and saved(), 120, message="saved")
        saves = core.query("recent_events", limit=50, category="cache", kind="save").result(10)
        newest = saves[0]
        assert newest["tokens"] == n_prefix and "no prefill" in newest["reason"], newest
        print(f"\nre-warmed {n_prefix} tokens, then: {newest['reason']}")
    finally:
        core.stop()
