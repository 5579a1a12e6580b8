"""A restart of Warmslot is warm without a disk tier (docs/cache.md).

Two Cores share one home folder, as two runs of `warmslot serve` do. The first
learns an opencode-shaped prefix through the proxy (two sessions of one project:
the learned boundary runs up to the first user message) and is stopped. The
second starts with persistence off — no slot file exists or may be used — and
must know the prefix again from the index, re-warm it into the primary slot
(the boot re-warm), say so in status, and serve a new session's first agent turn
from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.bench.trace import TraceRequest, iter_agent_turns, make_trace
from core.cache.manager import CacheManager, policy_factory
from core.config import Settings
from core.engine import Core
from core.paths import resources_dir
from core.server.launch import DEMO_TEMPLATE
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore, settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import post_chat, session_headers, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny32k() -> Path:
    """The tiny dense model with a 32k trained context (opencode-sized prompts fit)."""
    return make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)


def _idle(core: Core) -> bool:
    async def idle() -> bool:
        policy = core.policy
        return isinstance(policy, CacheManager) and policy.idle()

    return core.submit(idle()).result(10)


def _events(core: Core, kind: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = core.query(
        "recent_events", limit=500, category="cache", kind=kind
    ).result(10)
    return rows


def _cache_status(core: Core) -> dict[str, Any]:
    status: dict[str, Any] = core.status().result(30)["cache"]
    return status


def _hit(data: dict[str, Any]) -> tuple[int, int]:
    t = data["timings"]
    return int(t["cache_n"]), int(t["cache_n"]) + int(t["prompt_n"])


def learn_and_stop(
    make_core: MakeCore, settings: Settings, home: Path
) -> tuple[str, str, TraceRequest]:
    """A first Warmslot serves sessions 1 and 2 (title call + first agent turn each) of
    one project and is stopped. Returns the prefix they used (fingerprint, tokens) and
    session 3's first agent turn."""
    trace = make_trace(sessions=3, turns=1, scale=1.0, restart_before_session=None)
    agents = list(iter_agent_turns(trace))
    first = make_core(settings, home=home, policy_factory=policy_factory)
    first.start(wait_ready=True, timeout=300)
    for r in trace:
        if r.session != agents[2].session:
            headers = post_chat(first, r.body, headers=r.headers).headers
    prefix_fp, prefix_n = headers["X-Warmslot-Prefix"].split(":")
    learned = _events(first, "prefix_learned")
    assert any(e["details"].get("source") == "learned" for e in learned), learned
    wait_until(lambda: _idle(first), 120, interval=0.2, message="first core idle")
    first.stop()
    return prefix_fp, prefix_n, agents[2]


def restart_is_warm(make_core: MakeCore, settings: Settings, home: Path) -> dict[str, Any]:
    """Learn, stop, start again without a disk tier; returns what was measured."""
    prefix_fp, prefix_n, agent = learn_and_stop(make_core, settings, home)
    second = make_core(settings, home=home, policy_factory=policy_factory)
    second.start(wait_ready=True, timeout=300)
    cache = wait_until(
        lambda: (c := _cache_status(second))["boot_rewarm"]["state"] == "done" and c,
        600,
        interval=0.5,
        message=lambda: f"boot re-warm: {_cache_status(second)['boot_rewarm']}",
    )
    assert cache["disk_tier"]["usable"] is False  # nothing could come from a slot file
    assert cache["saved"] == []
    boot = cache["boot_rewarm"]
    assert (boot["warmed"], boot["total"]) == (1, 1), boot
    listed = {p["fingerprint"]: p for p in cache["prefixes"]}
    assert prefix_fp in listed, (prefix_fp, cache["prefixes"])
    assert (
        listed[prefix_fp]["tokens"] == int(prefix_n) and listed[prefix_fp]["client"] == "opencode"
    )
    slot0 = cache["slots"][0]
    assert slot0["prefix"] == prefix_fp and slot0["tokens"] >= int(prefix_n) - 1
    assert "boot re-warm finished" in cache["text"]
    # The re-warm did the prefill (the fresh server held nothing) …
    (warm,) = [e for e in _events(second, "prewarm_cold") if e["fingerprint"] == prefix_fp]
    assert warm["slot"] == 0 and warm["details"]["cache_n"] == 0
    # … so a new session's first agent turn finds the prefix in its slot.
    new_session = {**agent.headers, **session_headers("ses_after_restart")}
    reply = post_chat(second, agent.body, headers=new_session)
    data, headers = reply.json(), reply.headers
    cache_n, prompt = _hit(data)
    assert headers["X-Warmslot-Slot"] == "0"
    assert headers["X-Warmslot-Prefix"] == f"{prefix_fp}:{prefix_n}"
    assert cache_n >= 0.9 * prompt, (cache_n, prompt)
    done = _events(second, "boot_rewarm_done")[0]
    return {
        "prefix_tokens": int(prefix_n),
        "cache_n": cache_n,
        "prompt_tokens": prompt,
        "hit": round(cache_n / prompt, 4),
        "rewarm_s": done["details"]["seconds"],
        "rewarm_prompt_ms": warm["details"]["prompt_ms"],
    }


def _gemma_settings(gemma_model: Path) -> Settings:
    return settings_for(
        gemma_model,
        server__ctx_per_slot=12288,
        server__cache_ram_mib=512,
        server__chat_template_file=str(resources_dir() / DEMO_TEMPLATE),
        cache__persist=False,
    )


def test_restart_without_disk_tier_rewarms_the_learned_prefix(
    make_core: MakeCore, tiny32k: Path, tmp_path: Path
) -> None:
    settings = settings_for(
        tiny32k,
        server__ctx_per_slot=24576,
        server__cache_ram_mib=512,
        cache__persist=False,
    )
    measured = restart_is_warm(make_core, settings, tmp_path / "home")
    print(f"\ntiny dense, restart without disk tier: {measured}")


@pytest.mark.timeout(900)
def test_restart_of_the_default_model_without_disk_tier_is_warm(
    make_core: MakeCore, gemma_model: Path, tmp_path: Path
) -> None:
    """Gemma 3 (sliding window) as on a stock server: no disk tier, warm after a restart
    (~50 s on 2 cores: two cold prefills of the ~5.2k-token prefix)."""
    measured = restart_is_warm(make_core, _gemma_settings(gemma_model), tmp_path / "home")
    print(f"\nGemma 3 270M, restart without disk tier: {measured}")


@pytest.mark.timeout(900)
def test_a_request_for_another_prefix_does_not_wait_for_the_boot_rewarm(
    make_core: MakeCore, gemma_model: Path, tmp_path: Path
) -> None:
    """While the learned prefix is being re-warmed into slot 0 (~10 s of prefill for
    Gemma on 2 cores), another client's agent request for that slot stops the re-warm
    instead of queueing behind it."""
    settings = _gemma_settings(gemma_model)
    home = tmp_path / "home"
    prefix_fp, _, _ = learn_and_stop(make_core, settings, home)
    second = make_core(settings, home=home, policy_factory=policy_factory)
    second.start(wait_ready=True, timeout=300)
    wait_until(
        lambda: _cache_status(second)["boot_rewarm"]["current_slot"] == 0,
        120,
        interval=0.05,
        message="the boot re-warm of slot 0 runs",
    )
    other = TraceRequest(
        session="other",
        kind="agent",
        turn=1,
        body={
            "messages": [
                {"role": "system", "content": "You are a terse bot."},
                {"role": "user", "content": "Say hi."},
            ],
            "tools": [{"type": "function", "function": {"name": "noop", "parameters": {}}}],
            "max_tokens": 4,
        },
        headers={"User-Agent": "otherbot/1.0", "x-session-id": "other"},
    )
    reply = post_chat(second, other.body, headers=other.headers)
    data, headers = reply.json(), reply.headers
    # Its own prefix (its system message and tools, docs/cache.md#what-survives-a-restart).
    assert headers["X-Warmslot-Slot"] == "0"
    assert not headers.get("X-Warmslot-Prefix", "").startswith(prefix_fp), headers
    assert data["timings"]["prompt_n"] > 0
    boot = wait_until(
        lambda: (b := _cache_status(second)["boot_rewarm"])["state"] == "done" and b,
        120,
        interval=0.2,
    )
    assert (boot["warmed"], boot["skipped"]) == (0, 1), boot
    (skipped,) = _events(second, "boot_rewarm_skipped")
    assert skipped["slot"] == 0 and "another prefix" in skipped["reason"]
    assert skipped["fingerprint"] == prefix_fp
    # The re-warm never finished: it was stopped, not waited for.
    assert not _events(second, "prewarm_cold") and not _events(second, "prewarm_hit")
