"""Probe references are taken alone, so correct states verify (they were rejected
now and then in tests/integration/test_alternating_sessions.py).

A probe's log-probs are bit-exact only when no other slot's tokens share its batches. Two
of Warmslot's own saves in different slots — in the flaky runs, a displaced conversation's
reference in slot 0 while a prefix's reference was taken in the side slot — each waited
until the other slots were quiet, then both probed at once: their references shared
batches (two probes of one restore agreeing proved nothing, both had shared), and the
later check of the correct state, alone, was rejected with "probe token … entered the top
16". Here two conversations in two slots are saved at the same moment, on a real
llama-server, and every saved state must then restore and verify.
"""

from __future__ import annotations

import asyncio

import pytest

from core.cache.conversations import KIND
from core.cache.manager import CacheManager, policy_factory
from core.cache.store import StateRecord
from core.engine import Core
from core.errors import VerificationFailed
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore, settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import cache_idle, cache_manager, post_chat, session_headers, wait_until

pytestmark = pytest.mark.integration

WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "buffer", "socket", "thread", "module"]
ROUNDS = 3


def _text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * 7 + i // 3) % len(WORDS)] for i in range(n))


def _chat(core: Core, messages: list[dict[str, str]], session: str) -> tuple[str, str]:
    """A short greedy turn of `session`: its answer and the slot that served it."""
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "seed": 0}
    r = post_chat(core, body, headers=session_headers(session))
    return str(r.json()["choices"][0]["message"]["content"]), r.headers["X-Warmslot-Slot"]


async def _save_at_once(mgr: CacheManager, slots: list[int]) -> list[str]:
    """Save the conversations of `slots` at the same moment; what each save did."""
    return list(await asyncio.gather(*(mgr.conversations.save(s, "test") for s in slots)))


async def _conversations(mgr: CacheManager) -> dict[str, StateRecord]:
    """The saved conversation states by session (read on the core's thread, its database's)."""
    return {r.session: r for r in mgr.state.store.all() if r.kind == KIND}


async def _restore(mgr: CacheManager, rec: StateRecord, slot: int) -> str | None:
    """Restore and verify `rec` in `slot`: why it was rejected, or None."""
    async with mgr.ops.lock(slot):
        try:
            await mgr.ops.restore(rec, slot)
        except VerificationFailed as e:
            return str(e)
    return None


@pytest.mark.timeout(1200)
def test_references_taken_at_once_in_two_slots_verify(make_core: MakeCore) -> None:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    # Two agent slots and the side slot; no save after a response (this test saves), no RAM
    # prompt cache (a probe must see the restored state, not a RAM copy).
    settings = settings_for(
        model,
        server__slots=3,
        server__ctx_per_slot=12288,
        server__cache_ram_mib=0,
        cache__conversation_save_tokens=0,
    )
    core = make_core(settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    mgr = cache_manager(core)
    sessions = {"conv-a": 1, "conv-b": 2}
    # One system prompt, as two agents of one project have: its stable prefix is learned.
    system = "You are a coding agent. Notes:\n" + _text(0, 200)
    messages = {s: [{"role": "system", "content": system}] for s in sessions}
    verified: list[str] = []
    for turn in range(ROUNDS):
        slots: dict[str, int] = {}
        for s, seed in sessions.items():
            messages[s].append(
                {"role": "user", "content": f"Output {turn}:\n" + _text(seed + turn, 500)}
            )
            answer, slot = _chat(core, messages[s], s)
            messages[s].append({"role": "assistant", "content": answer})
            slots[s] = int(slot)
        assert len(set(slots.values())) == 2, slots  # each conversation in its own slot
        wait_until(lambda: cache_idle(core), 120, interval=0.1, message="cache idle")

        outcomes = core.submit(_save_at_once(mgr, list(slots.values()))).result(600)
        print(f"round {turn}: {outcomes}")
        assert all(o.startswith("saved") for o in outcomes), outcomes
        recs = core.submit(_conversations(mgr)).result(30)
        assert set(recs) == set(sessions), recs
        for s in sessions:
            problem = core.submit(_restore(mgr, recs[s], slots[s])).result(300)
            assert problem is None, (
                f"round {turn}: the correct state of {s} was rejected: {problem}"
            )
            verified.append(s)
    assert len(verified) == ROUNDS * len(sessions)
