"""Keep-alive against a model of llama-server's slots; the pin/evict/rewarm commands."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from core.cache.fingerprint import state_filename
from core.cache.keepalive import IDLE_SHARE, residency
from core.cache.slot_ops import prewarm_body
from core.errors import CacheError
from core.machine.pressure import Reading
from tests.core.bg_support import (
    IDENT,
    FakeCore,
    FakeLlama,
    FakeManager,
    add_state,
    make_manager,
    prefix,
)

PREFIX = list(range(1, 201))


def low_pressure() -> Reading:
    return Reading(1000, 100, 0, 0, None, 1000, 500)  # 10 % RAM available → low


def setup(tmp_path: Path, *, pinned: bool = False) -> tuple[FakeCore, FakeManager, FakeLlama, str]:
    core, mgr = make_manager(tmp_path)
    fake = mgr.fake
    assert fake is not None
    info = prefix(PREFIX)
    mgr.state.by_fp[info.fingerprint] = info
    # The prefix was prewarmed into slot 0 (what Warmslot last sent there).
    fake.contents[0] = list(PREFIX)
    st = mgr.state.slots.slots[0]
    st.prefix_fp, st.tokens_hint, st.last_used = (
        info.fingerprint,
        len(PREFIX),
        core.clock.monotonic(),
    )
    if pinned:
        add_state(core, mgr, name_seed="p", fp=info.fingerprint, pinned=True)
    return core, mgr, fake, info.fingerprint


@pytest.mark.parametrize(
    "prefix_n,expected,live,resident",
    [
        (200, 200, 200, True),
        (200, 0, 250, True),  # unknown hint: the count is enough
        (200, 200, 215, True),  # a verification probe's tail on top
        (200, 200, 20, False),  # another prompt replaced it
        (200, 900, 200, False),  # the conversation on top was cut
        (200, 900, 899, True),  # prompt + output − 1: as left
        (200, 200, 0, False),  # cleared (server restarted or slept)
    ],
)
def test_residency(prefix_n: int, expected: int, live: int, resident: bool) -> None:
    assert residency(prefix_n, expected, live).resident is resident


async def test_resident_prefix_is_left_alone_until_idle_then_rewarmed_for_one_token(
    tmp_path: Path,
) -> None:
    core, mgr, _fake, fp = setup(tmp_path)
    threshold = IDLE_SHARE * core.settings.cache.ttl_short_s
    await core.clock.advance(threshold - 1)
    out = await mgr.keepalive.sweep()
    assert out.actions == 0 and out.details["decisions"][0]["why"] == "resident"
    await core.clock.advance(1)
    out = await mgr.keepalive.sweep()
    assert out.actions == 1
    (ev,) = core.cache_events("keepalive")
    assert ev.slot == 0 and ev.fingerprint == fp[:16] and ev.details["resident"] is True
    assert ev.details["cost_tokens"] == 1 and ev.details["cache_n"] == len(PREFIX) - 1
    assert "idle 240 s ≥ 80% of the short TTL (240 s)" in ev.reason
    # The re-warm counts as use: no second re-warm until idle again.
    await core.clock.advance(60)
    assert (await mgr.keepalive.sweep()).actions == 0


async def test_displaced_prefix_is_rewarmed_and_the_cost_recorded(tmp_path: Path) -> None:
    core, mgr, fake, _fp = setup(tmp_path)
    fake.contents[0] = [1, 2, 3] + [999] * 17  # another client's prompt in slot 0
    out = await mgr.keepalive.sweep()
    assert out.actions == 1
    assert fake.contents[0] == PREFIX
    (ev,) = core.cache_events("keepalive")
    assert ev.details["resident"] is False
    assert ev.details["cache_n"] == 3 and ev.details["prompt_n"] == len(PREFIX) - 3
    assert ev.reason.startswith("displaced: the slot holds 20 tokens")


async def test_a_conversation_on_top_of_the_prefix_is_not_cut(tmp_path: Path) -> None:
    core, mgr, fake, _ = setup(tmp_path)
    fake.contents[0] = PREFIX + list(range(5000, 5600))
    mgr.state.slots.slots[0].tokens_hint = len(fake.contents[0]) + 1
    await core.clock.advance(3600)
    out = await mgr.keepalive.sweep()
    assert out.actions == 0 and len(fake.contents[0]) == 800
    assert "conversation" in out.details["decisions"][0]["why"]


async def test_busy_slots_are_skipped(tmp_path: Path) -> None:
    _core, mgr, fake, _ = setup(tmp_path)
    fake.contents[0] = []
    mgr.state.slots.slots[0].inflight = 1
    assert (await mgr.keepalive.sweep()).actions == 0
    mgr.state.slots.slots[0].inflight = 0
    async with mgr.ops.lock(0):  # Warmslot's own work on the slot (restore, persist)
        assert (await mgr.keepalive.sweep()).actions == 0
    assert (await mgr.keepalive.sweep()).actions == 1


async def test_under_pressure_only_pinned_prefixes_are_kept_alive(tmp_path: Path) -> None:
    _core, mgr, fake, _ = setup(tmp_path)
    mgr.state.pressure.update(low_pressure())
    fake.contents[0] = []
    out = await mgr.keepalive.sweep()
    assert out.actions == 0
    assert out.details["decisions"][0]["why"] == (
        "keep-alive paused except for pinned prefixes: RAM low"
    )
    assert fake.calls == []  # not even GET /slots (it would wake a sleeping server)
    _core2, mgr2, fake2, _ = setup(tmp_path / "pinned", pinned=True)
    mgr2.state.pressure.update(low_pressure())
    fake2.contents[0] = []
    assert (await mgr2.keepalive.sweep()).actions == 1


async def test_a_pinned_prefix_in_no_slot_comes_back_into_a_free_slot(tmp_path: Path) -> None:
    core, mgr, fake, fp = setup(tmp_path, pinned=True)
    # Another session took slot 0 and replaced the prefix with its own.
    other = prefix(list(range(300, 400)))
    mgr.state.by_fp[other.fingerprint] = other
    st = mgr.state.slots.slots[0]
    st.prefix_fp, st.session, st.tokens_hint = other.fingerprint, "ses-b", 100
    fake.contents[0] = list(other.tokens)
    mgr.state.slots.sessions["ses-b"] = 0
    out = await mgr.keepalive.sweep()
    # Slot 1 is the side-call slot; with two slots there is no free primary slot.
    assert out.actions == 0
    assert any("none is free" in d["why"] for d in out.details["decisions"])
    mgr.state.slots.release("ses-b")
    mgr.state.slots.slots[0].prefix_fp = ""
    out = await mgr.keepalive.sweep()
    assert out.actions == 1 and fake.contents[0][:200] == PREFIX
    assert mgr.state.slots.slots[0].prefix_fp == fp
    # Its file (zeros, not what was indexed) failed the check: prewarmed instead, and
    # saved afresh in the background.
    assert core.cache_events("restore_rejected")
    await asyncio.gather(*mgr._jobs)
    assert core.cache_events("save")


# ----------------------------------------------------------------- commands
async def test_pin_unpin_and_evict_commands(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    rec = add_state(core, mgr, name_seed="x")
    assert (await mgr.pin(rec.filename, True))["pinned"] is True
    stored = mgr.state.store.get(rec.filename)
    assert stored is not None and stored.pinned
    await mgr.pin(rec.filename, False)
    assert [e.kind for e in core.cache_events()] == ["pinned", "unpinned"]
    out = await mgr.evict(rec.filename)
    assert out["bytes"] == rec.bytes and mgr.state.store.get(rec.filename) is None
    ev = core.cache_events("evicted")[0]
    assert ev.reason == "deleted by the user" and ev.details["rule"] == "user"
    assert not (core.paths.slot_dir / IDENT / rec.filename).exists()


@pytest.mark.parametrize(
    "name", ["../telemetry.sqlite3", "ws-../../x.bin", "notes.txt", "", "ws-ABC.bin"]
)
async def test_commands_refuse_unsafe_names(tmp_path: Path, name: str) -> None:
    core, mgr = make_manager(tmp_path)
    victim = core.paths.state_dir / "telemetry.keep"
    victim.write_text("x")
    for call in (mgr.evict(name), mgr.pin(name, True)):
        with pytest.raises(CacheError, match="refusing"):
            await call
    assert victim.exists() and not core.cache_events()


async def test_rewarm_command(tmp_path: Path) -> None:
    core, mgr, _fake, fp = setup(tmp_path)
    with pytest.raises(CacheError, match="at least 8"):
        await mgr.rewarm(fp[:4])
    with pytest.raises(CacheError, match="no known prefix"):
        await mgr.rewarm("deadbeefdeadbeef")
    out = await mgr.rewarm(fp[:16])
    assert out == {
        "fingerprint": fp[:16],
        "slot": 0,
        "restored": False,
        "cache_n": len(PREFIX) - 1,
        "prompt_n": 1,
    }
    (ev,) = core.cache_events("rewarm")
    assert ev.reason == "re-warm requested by the user" and ev.details["cost_tokens"] == 1


async def saved_prefix(tmp_path: Path) -> tuple[Any, Any, Any, Any, Any]:
    """A 3-slot manager on the fake server with PREFIX saved to disk (a real fake-server
    save with its probe answer): (core, manager, fake server, prefix, its record)."""
    core, mgr = make_manager(tmp_path, slots=3)
    fake = mgr.fake
    assert fake is not None
    info = prefix(PREFIX)
    mgr.state.by_fp[info.fingerprint] = info
    await mgr.ops.persist_now(info)
    rec = mgr.state.store.get(state_filename(info.fingerprint))
    assert rec is not None
    return core, mgr, fake, info, rec


async def test_rewarm_restores_a_saved_prefix_into_a_free_slot(tmp_path: Path) -> None:
    core, mgr, fake, info, _ = await saved_prefix(tmp_path)
    for st in mgr.state.slots.slots:
        st.prefix_fp, st.tokens_hint = "", 0
    fake.contents.clear()
    out = await mgr.rewarm(info.fingerprint[:12])
    assert out["restored"] is True and out["slot"] == 0
    assert core.cache_events("restore_ok")
    assert fake.contents[0][:200] == PREFIX


async def test_prewarm_and_keepalive_send_one_body(tmp_path: Path) -> None:
    """A (chunked) prewarm and a keep-alive re-warm build the same /completion body."""
    _, mgr = make_manager(tmp_path)
    fake = mgr.fake
    assert fake is not None
    bodies: list[dict[str, Any]] = []
    answer = fake.completion

    async def recording(body: dict[str, Any]) -> dict[str, Any]:
        bodies.append(body)
        return await answer(body)

    fake.completion = recording  # type: ignore[method-assign]
    info = prefix(PREFIX)
    await mgr.ops.prewarm(info, 0, reason="test", chunk=64)  # an empty slot: 64 at a time
    await mgr.keepalive.rewarm_in(info, 1, reason="test")

    ends = [64, 128, 192, 200]
    assert bodies == [prewarm_body(PREFIX[:n], 0) for n in ends] + [prewarm_body(PREFIX, 1)]
    assert bodies[-1] == {
        "prompt": PREFIX,
        "n_predict": 0,  # only the prompt stays in the slot
        "id_slot": 1,
        "cache_prompt": True,
        "response_fields": ["timings", "tokens_cached"],
    }
    assert fake.contents[0] == fake.contents[1] == PREFIX


async def test_a_restore_whose_probe_cannot_run_is_cleared_not_served(tmp_path: Path) -> None:
    """An error while verifying (the server went away, a time-out) leaves no unverified
    state in the slot — llama-server's own slot choice could reuse it — and keeps the
    file, which may well be good."""
    from core.errors import VerificationFailed
    from core.server.client import UpstreamError

    core, mgr, fake, _, rec = await saved_prefix(tmp_path)
    fake.contents.clear()
    answer = fake.completion

    async def server_gone(body: dict[str, Any]) -> dict[str, Any]:
        raise UpstreamError("POST /completion failed: connection refused")

    fake.completion = server_gone  # type: ignore[method-assign]
    with pytest.raises(VerificationFailed, match="could not verify"):
        await mgr.ops.restore(rec, 1)
    assert fake.calls[-1] == ("erase", 1) and fake.contents[1] == []
    assert mgr.state.slots.slots[1].prefix_fp == ""
    assert mgr.state.store.get(rec.filename) is not None  # kept for a later try
    (ev,) = core.cache_events("restore_rejected")
    assert "could not verify" in ev.reason
    fake.completion = answer  # type: ignore[method-assign]
    await mgr.ops.restore(rec, 1)  # the next try verifies and serves it
    assert fake.contents[1][: len(PREFIX)] == PREFIX


async def test_a_restore_that_did_not_pay_is_said(tmp_path: Path) -> None:
    """The request after a restore should reuse what was restored; when it
    reused far less, an event and the status say so, with the likely cause."""
    from core.proxy.app import ProxyRequest
    from core.proxy.types import SlotPlan
    from core.routing.router import Decision, Kind, Router
    from core.server.client import Timings

    core, mgr, _, info, rec = await saved_prefix(tmp_path)

    def request(rid: str) -> ProxyRequest:
        headers = {"x-session-id": "s"}
        body = {"messages": [{"role": "user", "content": "x"}]}
        decision = Router.single(None).decide("chat", headers, body)
        assert isinstance(decision, Decision)
        req = ProxyRequest(
            request_id=rid, path="/v1/chat/completions", endpoint="chat", client="opencode",
            user_agent="", session="s", headers=headers, body=body, stream=False,
            has_tools=False, decision=decision,
        )  # fmt: skip
        req.plan = SlotPlan(1, "test", "s", Kind.AGENT, info.fingerprint)
        mgr.state.slots.begin(1)
        return req

    await mgr.ops.restore(rec, 1)
    assert mgr.state.slots.slots[1].promised == (len(PREFIX), "restored prefix state")
    await mgr.completed(request("r1"), Timings(len(PREFIX) - 1, 30, 3.0, 1, 1.0), 200)
    assert not core.cache_events("restore_unpaid")  # it paid (the last token is re-read)
    assert mgr.state.slots.slots[1].promised == (0, "")  # checked once
    await mgr.ops.restore(rec, 1)
    await mgr.completed(request("r2"), Timings(0, 230, 30.0, 1, 1.0), 200)
    (ev,) = core.cache_events("restore_unpaid")
    assert "reused 0" in ev.reason and "reused nothing of the slot" in ev.reason
    assert ev.details["request_id"] == "r2" and ev.details["promised"] == len(PREFIX)
    status = await mgr.status()
    assert status["restore_shortfalls"][0]["request_id"] == "r2"
    assert "last restore that did not pay: restored prefix state" in status["text"]
