"""The boot re-warm against a model of llama-server: learned prefixes survive a
restart of Warmslot, come back into their slot, and never hold up a request
for another prefix."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from core.cache import warmup
from core.cache.deps import DiskTier, deps_from
from core.cache.fingerprint import ServerIdentity
from core.cache.inventory import format_inventory
from core.cache.manager import CacheManager
from core.machine.pressure import Reading
from core.proxy.app import ProxyRequest
from core.routing.router import Decision, Router
from tests.core.bg_support import SERVER, FakeCore, FakeLlama, FakeManager, make_manager
from tests.fixtures.status_shapes import blank_cache
from tests.helpers import wait_until_async


class RenderingLlama(FakeLlama):
    """FakeLlama plus a chat template, a tokenizer (one token per character) and a
    gate that holds prefills (``n_predict`` 0, what a prewarm sends) until opened."""

    gate: asyncio.Event | None = None
    open_prefills: int = 0  # prefills let through before the gate applies
    sent: int = 0  # completions received (calls lists only those answered)

    async def apply_template(self, body: dict[str, Any]) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}\n" for m in body["messages"])

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return [ord(c) for c in text]

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        self.sent += 1
        if self.gate is not None and body.get("n_predict") == 0:
            if self.open_prefills > 0:
                self.open_prefills -= 1
            else:
                await self.gate.wait()
        return await super().completion(body)


def system(project: str, n_words: int = 60) -> str:
    words = " ".join(f"rule{i}" for i in range(n_words))
    return f"You are opencode ({project}). {words}\n<env>\n  cwd: /home/{project}\n</env>\n"


def request(session: str, project: str = "alpha", n_words: int = 60) -> ProxyRequest:
    body = {
        "messages": [
            {"role": "system", "content": system(project, n_words)},
            {"role": "user", "content": f"task for {session}"},
        ],
        "tools": [{"type": "function", "function": {"name": "read"}}],
    }
    headers = {"user-agent": "opencode/1.0", "x-session-id": session}
    decision = Router.single(None).decide("chat", headers, body)
    assert isinstance(decision, Decision)
    return ProxyRequest(
        request_id=session,
        path="/v1/chat/completions",
        endpoint="chat",
        client="opencode",
        user_agent="opencode/1.0",
        session=session,
        headers=headers,
        body=body,
        stream=False,
        has_tools=True,
        decision=decision,
    )


async def prepared_fp(mgr: CacheManager, req: ProxyRequest) -> str:
    """The fingerprint of the prefix `prepare` planned for `req` ("" for none)."""
    plan = await mgr.prepare(req)
    assert plan is not None
    return plan.prefix_fp


def attach(core: FakeCore, identity: ServerIdentity = SERVER) -> tuple[FakeManager, RenderingLlama]:
    """A cache manager for a freshly started server (what a new Warmslot process has)."""
    mgr = FakeManager(deps_from(core))  # type: ignore[arg-type]
    fake = RenderingLlama(core.paths.slot_dir / "x", n_slots=core.settings.server.slots)
    mgr.fake = fake
    mgr.state.identity = identity
    mgr.state.disk = DiskTier(False, "sliding-window model on a stock server")
    return mgr, fake


async def learn_and_stop(tmp_path: Path, *projects: str, n_words: int = 60) -> tuple[FakeCore, str]:
    """A first Warmslot learns the opencode prefix of each project (default: alpha),
    then stops. Returns the core and the last prefix's fingerprint."""
    core, first = make_manager(tmp_path)
    first.fake = RenderingLlama(core.paths.slot_dir / "x", n_slots=2)
    first.state.disk = DiskTier(False, "sliding-window model on a stock server")
    fp = ""
    for project in projects or ("alpha",):
        req = request(f"s-{project}", project, n_words)
        fp = await prepared_fp(first, req)
        assert fp and fp in first.state.by_fp
    await first.close()
    return core, fp


async def boot(mgr: FakeManager, n_ctx: int | None = 4096) -> asyncio.Task[None]:
    """What happens after the server is ready: load definitions, start the re-warm.
    Returns once its first step runs (or it has nothing to do)."""
    warmup.load_definitions(mgr.state, mgr.learner.prefixes, n_ctx)
    task = asyncio.ensure_future(warmup.warm_known(mgr.state, mgr.ops, mgr.boot, mgr.conversations))
    await wait_until_async(
        lambda: task.done() or mgr.boot.snapshot()["current_slot"] is not None,
        5,
        message="the boot re-warm never started a step",
    )
    return task


async def test_a_learned_prefix_is_rewarmed_after_warmslot_restarts(tmp_path: Path) -> None:
    core, fp = await learn_and_stop(tmp_path)
    mgr, fake = attach(core)
    assert mgr.state.by_fp == {}  # a new process knows nothing in memory
    await (await boot(mgr))
    info = mgr.state.by_fp[fp]
    assert info.client == "opencode" and info.source == "profile:opencode"
    assert fake.contents[0] == info.tokens  # prewarmed into the primary slot
    assert mgr.state.slots.slots[0].prefix_fp == fp
    snap = mgr.boot.snapshot()
    assert snap["state"] == "done" and (snap["done"], snap["total"], snap["warmed"]) == (1, 1, 1)
    assert snap["finished_at"] is not None
    assert [e.kind for e in core.cache_events() if e.kind.startswith("boot_rewarm")] == [
        "boot_rewarm_started",
        "boot_rewarm_done",
    ]
    assert core.cache_events("prewarm_cold")
    # A new session of the same client and system prompt gets that prefix, warm.
    req = request("s2")
    assert await prepared_fp(mgr, req) == fp and req.slot == 0
    status = await mgr.status()
    assert status["boot_rewarm"]["state"] == "done"
    assert [p["fingerprint"] for p in status["prefixes"]] == [fp[:16]]
    assert "boot re-warm finished" in status["text"] and "1 of 1 prefixes warm" in status["text"]


async def test_a_first_start_has_nothing_to_rewarm_and_says_so_quietly(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    mgr.fake = RenderingLlama(core.paths.slot_dir / "x", n_slots=2)
    await (await boot(mgr))
    snap = mgr.boot.snapshot()
    assert (snap["state"], snap["total"], snap["done"]) == ("done", 0, 0)
    assert not [e for e in core.cache_events() if e.kind.startswith("boot_rewarm")]
    assert "no known prefixes to re-warm" in (await mgr.status())["text"]


async def test_status_forgets_the_last_rewarm_when_the_server_stops(tmp_path: Path) -> None:
    core, _ = await learn_and_stop(tmp_path)
    mgr, _ = attach(core)
    await (await boot(mgr))
    assert mgr.boot.snapshot()["state"] == "done"
    mgr.boot.forget()
    snap = mgr.boot.snapshot()
    assert (snap["state"], snap["total"], snap["finished_at"]) == ("idle", 0, None)
    assert "re-warm" not in (await mgr.status())["text"]


async def test_only_definitions_of_the_same_model_and_template_come_back(tmp_path: Path) -> None:
    core, fp = await learn_and_stop(tmp_path)
    other_build = ServerIdentity(
        model=SERVER.model, binary="b2", kv_flags=SERVER.kv_flags, chat_template="t"
    )
    mgr, _ = attach(core, other_build)
    assert warmup.load_definitions(mgr.state, mgr.learner.prefixes, 4096) == 1
    (info,) = mgr.state.by_fp.values()
    assert info.fingerprint != fp  # re-fingerprinted for the server that runs now
    for changed in ({"chat_template": "t2"}, {"model": "m2"}):
        fields = {**SERVER.__dict__, **changed}
        mgr2, _ = attach(core, ServerIdentity(**fields))
        assert (
            warmup.load_definitions(mgr2.state, mgr2.learner.prefixes, 4096) == 0
            and mgr2.state.by_fp == {}
        )
    mgr3, _ = attach(core)
    assert (
        warmup.load_definitions(mgr3.state, mgr3.learner.prefixes, n_ctx=64) == 0
    )  # longer than a slot holds


async def test_a_request_for_another_prefix_stops_the_running_rewarm(tmp_path: Path) -> None:
    core, fp = await learn_and_stop(tmp_path)
    mgr, fake = attach(core)
    fake.gate = asyncio.Event()  # the prewarm of alpha's prefix is "prefilling"
    task = await boot(mgr)
    assert mgr.boot.snapshot()["current_slot"] == 0
    req = request("s2", project="beta")  # another prefix, for the same (only) slot
    got = await asyncio.wait_for(prepared_fp(mgr, req), 2.0)  # does not wait for the gate
    assert req.slot == 0 and got != fp
    await asyncio.wait_for(task, 2.0)
    snap = mgr.boot.snapshot()
    assert (snap["state"], snap["warmed"], snap["skipped"]) == ("done", 0, 1)
    (skip,) = core.cache_events("boot_rewarm_skipped")
    assert "another prefix" in skip.reason and skip.slot == 0
    assert mgr.state.slots.slots[0].prefix_fp != fp  # never marked as holding alpha


async def test_a_request_for_the_same_prefix_waits_for_its_rewarm(tmp_path: Path) -> None:
    core, fp = await learn_and_stop(tmp_path)
    mgr, fake = attach(core)
    fake.gate = asyncio.Event()
    task = await boot(mgr)
    # The prewarm is prefilling (held at the gate) under the slot's lock.
    await wait_until_async(lambda: fake.sent == 1, 5, message="the prewarm was never sent")
    assert mgr.ops.lock(0).locked()
    locked_out = asyncio.Event()
    lock = mgr.ops.lock

    def noting_lock(slot: int) -> asyncio.Lock:
        if lock(slot).locked():
            locked_out.set()  # the request is about to wait for the re-warm's lock
        return lock(slot)

    mgr.ops.lock = noting_lock  # type: ignore[method-assign]
    req = request("s2")  # same system prompt: the prefix being re-warmed
    waiting = asyncio.ensure_future(prepared_fp(mgr, req))
    await asyncio.wait_for(locked_out.wait(), 5)
    assert not waiting.done()  # it waits: that is the quickest way to a warm slot
    assert not core.cache_events("boot_rewarm_skipped")  # and did not stop the re-warm
    fake.gate.set()
    await asyncio.wait_for(waiting, 2.0)
    await asyncio.wait_for(task, 2.0)
    assert mgr.boot.snapshot()["warmed"] == 1
    assert waiting.result() == fp and mgr.state.slots.slots[0].prefix_fp == fp
    assert not core.cache_events("boot_rewarm_skipped")


async def test_a_slot_claimed_before_its_rewarm_starts_is_skipped(tmp_path: Path) -> None:
    core, _ = await learn_and_stop(tmp_path, "alpha", "beta")
    core.settings.cache.aux_slot = False  # two primary slots: two prefixes to re-warm
    mgr, fake = attach(core)
    fake.gate = asyncio.Event()
    task = await boot(mgr)
    assert mgr.boot.snapshot()["total"] == 2 and mgr.boot.snapshot()["current_slot"] == 0
    mgr.boot.claim(1, "")  # a request takes slot 1 while slot 0 is still warming
    fake.gate.set()
    await asyncio.wait_for(task, 2.0)
    snap = mgr.boot.snapshot()
    assert (snap["done"], snap["warmed"], snap["skipped"]) == (2, 1, 1)
    assert 1 not in fake.contents or fake.contents[1] == []  # nothing sent to slot 1
    assert "1 skipped" in format_inventory(await mgr.status())


async def test_under_memory_pressure_nothing_is_rewarmed(tmp_path: Path) -> None:
    core, _ = await learn_and_stop(tmp_path)
    mgr, fake = attach(core)
    mgr.state.pressure.update(Reading(1000, 100, 0, 0, None, 1000, 500))  # RAM low
    await (await boot(mgr))
    snap = mgr.boot.snapshot()
    assert (snap["state"], snap["warmed"], snap["skipped"]) == ("done", 0, 1)
    assert core.cache_events("prewarm_skipped") and fake.contents.get(0, []) == []


async def test_a_long_prefix_is_rewarmed_in_chunks_that_extend_each_other(
    tmp_path: Path,
) -> None:
    core, fp = await learn_and_stop(tmp_path, n_words=300)  # ~2,100 one-char tokens
    mgr, fake = attach(core)
    await (await boot(mgr))
    n = mgr.state.by_fp[fp].n_tokens
    chunks = -(-n // warmup.BOOT_CHUNK_TOKENS)
    assert chunks >= 4
    assert fake.calls == [("completion", 0)] * chunks
    assert fake.contents[0] == mgr.state.by_fp[fp].tokens
    (ev,) = core.cache_events("prewarm_cold")
    # Nothing was reused at the start, every token was computed once (each request
    # reused the one before).
    assert ev.details["requests"] == chunks
    assert (ev.details["cache_n"], ev.details["prompt_n"]) == (0, n)


async def test_a_request_stops_a_chunked_rewarm_between_chunks(tmp_path: Path) -> None:
    core, fp = await learn_and_stop(tmp_path, n_words=300)
    mgr, fake = attach(core)
    fake.gate, fake.open_prefills = asyncio.Event(), 2  # the third chunk is "prefilling"
    task = await boot(mgr)
    await wait_until_async(lambda: fake.sent == 3, 5, message=lambda: f"{fake.sent} sent")
    assert len(fake.calls) == 2
    mgr.boot.claim(0, "")
    await asyncio.wait_for(task, 2.0)
    fake.gate.set()
    # The third chunk's request was dropped, and no chunk followed it: no task is left
    # that could still send or answer one.
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others, others
    assert (fake.sent, len(fake.calls)) == (3, 2)
    assert mgr.boot.snapshot()["skipped"] == 1 and mgr.state.slots.slots[0].prefix_fp != fp


@pytest.mark.parametrize("state", ["idle", "running", "done"])
def test_inventory_says_what_the_boot_rewarm_does(state: str) -> None:
    boot = {
        "state": state,
        "done": 1,
        "total": 2,
        "warmed": 1,
        "skipped": 0,
        "failed": 1,
        "current_slot": 1 if state == "running" else None,
        "started_at": 100.0,
        "finished_at": 112.5 if state == "done" else None,
    }
    st = {**blank_cache(), "disk_tier": {"usable": False, "reason": "off"}, "boot_rewarm": boot}
    text = format_inventory(st)
    expected = {
        "idle": None,
        "running": "re-warming recently used prefixes after the server start: 1 of 2 done "
        "(slot 1 now)",
        "done": "in 12.5 s: 1 of 2 prefixes warm, 1 failed",
    }[state]
    if expected is None:
        assert "re-warm" not in text
    else:
        assert expected in text


async def test_a_huge_body_is_not_rendered_to_learn_its_prefix(tmp_path: Path) -> None:
    """Rendering and tokenizing an 8 MiB conversation cost +250 MiB and a 1.2 s stall;
    above LEARN_MAX_BYTES the request keeps its session's slot and nothing is rendered."""
    from core.cache.learner import LEARN_MAX_BYTES

    core, _ = make_manager(tmp_path)
    mgr, fake = attach(core)
    req = request("s-huge")
    req.body_bytes = LEARN_MAX_BYTES + 1
    rendered: list[int] = []
    original = fake.apply_template

    async def counting(body: dict[str, Any]) -> str:
        rendered.append(1)
        return await original(body)

    fake.apply_template = counting  # type: ignore[method-assign]
    plan = await mgr.prepare(req)
    assert plan is not None and plan.prefix_fp == "" and rendered == []
    assert req.body["id_slot"] == plan.slot
    small = request("s-small")
    small.body_bytes = 40_000
    assert await prepared_fp(mgr, small)  # an ordinary body is learned as before
    assert rendered
    await mgr.close()


async def test_first_sightings_and_uses_are_on_the_cores_clock(tmp_path: Path) -> None:
    """What TTLs and retention compare comes from the core's clock, never the wall clock:
    a prefix learned and used under a FakeClock carries the fake times, in memory and in
    its stored definition, and ages as that clock moves. The definition is written after
    the request's response, not on its path."""
    core, mgr = make_manager(tmp_path)
    mgr.fake = RenderingLlama(core.paths.slot_dir / "x", n_slots=2)
    mgr.state.disk = DiskTier(False, "sliding-window model on a stock server")
    start = core.clock.time()
    assert abs(start - time.time()) > 86400  # the fake clock is nowhere near the wall clock
    first = request("s1")
    first.plan = await mgr.prepare(first)  # as the proxy does
    assert first.plan is not None
    fp = first.plan.prefix_fp
    info = mgr.state.by_fp[fp]
    assert info.first_seen == info.last_used == start
    book = mgr.state.definitions
    assert book is not None
    assert book.table.count == 0  # nothing is written on the request's path
    await mgr.completed(first, None, 499)  # the index hears of it after the response
    assert book.table.count == 1
    await core.clock.advance(600)
    second = request("s1")
    second.plan = await mgr.prepare(second)
    assert second.plan is not None and second.plan.prefix_fp == fp
    await mgr.completed(second, None, 499)
    assert info.last_used == start + 600 and info.first_seen == start
    book.flush()
    row = book.table.get(info.meta["definition"])
    assert (row["first_seen"], row["last_used"]) == (start, start + 600)
