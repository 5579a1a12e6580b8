"""A model switch starts clean: the prefixes, definitions and saved states Warmslot knows
belong to one model (and chat template); after a switch none of them is sent to the new
model, and switching back brings the first model's back (docs/cache.md#model-switch).

The tray's *Use this model* is exactly this: `server.model` changed on a running core,
then llama-server restarted. Two tiny models of one vocabulary (different weights), so
the old model's tokens would not even be refused: only Warmslot can tell them apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from httpx import Headers

from core.cache.manager import policy_factory
from core.events import CacheEvent, CacheEventKind
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore, settings_for, test_cache
from tests.helpers import EventLog, cache_idle, cache_manager, post_chat, wait_until

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i} reads and edits files in the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for i in range(6)
]
SYSTEM = "You are a coding agent. " + " ".join(
    f"Rule {i}: read a file before you edit it and keep its style." for i in range(40)
)


def _agent_turn(port: int, session: str) -> Headers:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"fix the failing test ({session})"},
        ],
        "tools": TOOLS,
        "max_tokens": 2,
        "temperature": 0,
    }
    return post_chat(port, body, headers={"x-session-id": session}, timeout=300).headers


def _switch(core: Any, model: Path) -> None:
    # In memory only: this test's small slots are not in the settings file.
    update = core.update_settings({"server.model": str(model)}, persist=False).result(30)
    assert update.applied, update.problems
    core.restart_server().result(180)
    wait_until(lambda: cache_idle(core), 180, message="the cache settled after the switch")


def test_a_model_switch_never_replays_another_models_prefix(
    make_core: MakeCore, tmp_path: Path
) -> None:
    model_a = make_tiny_model(test_cache() / "tiny-32k.gguf", n_ctx=32768)
    model_b = make_tiny_model(test_cache() / "tiny-32k-seed1.gguf", n_ctx=32768, seed=1)
    settings = settings_for(model_a, server__slots=2, server__ctx_per_slot=8192)
    core = make_core(settings, policy_factory=policy_factory)
    log = EventLog()
    core.subscribe(log.append)
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None and core.upstream is not None
    headers = _agent_turn(core.proxy.port, "on-a")
    prefix_a = headers["X-Warmslot-Prefix"]
    wait_until(lambda: cache_idle(core), 180, message="prefix A learned and saved")
    mgr = cache_manager(core)
    tokens_a = next(
        i.tokens for i in mgr.state.by_fp.values() if i.fingerprint.startswith(prefix_a[:16])
    )
    assert core.call(lambda: mgr.state.store.all()).result(10), "prefix A was saved to disk"

    # A → B: nothing of A's reaches B; a request on B learns B's own prefix.
    seen = len(log.of(CacheEvent))
    calls_before = core.upstream.calls["/completion"]
    _switch(core, model_b)
    after_b = log.of(CacheEvent)[seen:]
    assert all(i.tokens != tokens_a for i in mgr.state.by_fp.values()), "A's prefix is known on B"
    assert not [e for e in after_b if e.kind is CacheEventKind.BOOT_REWARM_STARTED], after_b
    assert core.upstream.calls["/completion"] == calls_before, "a prewarm was sent to B"
    on_b = _agent_turn(core.proxy.port, "on-b")
    assert on_b["X-Warmslot-Prefix"] != prefix_a
    wait_until(lambda: cache_idle(core), 180, message="prefix B learned")

    # B → A: A's prefix comes back from its saved state (verified), B's is not replayed.
    seen = len(log.of(CacheEvent))
    _switch(core, model_a)
    after_a = log.of(CacheEvent)[seen:]
    back = [
        e
        for e in after_a
        if e.kind
        in (CacheEventKind.RESTORE_OK, CacheEventKind.PREWARM_HIT, CacheEventKind.PREWARM_COLD)
    ]
    assert back and all(e.fingerprint == prefix_a[:16] for e in back), after_a
    assert any(e.kind is CacheEventKind.RESTORE_OK for e in back), after_a
    again = _agent_turn(core.proxy.port, "on-a")
    assert again["X-Warmslot-Prefix"] == prefix_a and again["X-Warmslot-Cache"] == "hit"
