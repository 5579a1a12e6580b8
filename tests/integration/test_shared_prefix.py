"""A new session gets the stable prefix it shares with another session from wherever it is.

Two agent sessions of one client with the same long system prompt and tools (a stable
prefix of thousands of tokens), each with its own messages after a shared opening. The
first session's prefix is learned from its system text and tools, saved and verified on
disk; the second session's first turn teaches a longer common prefix (a new fingerprint:
the two openings share more than the system text). That turn must not pay a cold prefill
while a verified copy of the shared part exists (docs/cache.md#the-shared-prefix-wherever-it-is):

* the first session's slot busy with its next turn: the saved shorter prefix is restored
  into the new session's slot, and only the rest is read. Before, only a state of the
  exact new fingerprint was ever restored: the turn went to an empty slot and read
  everything (miss);
* the first session's slot idle: the prefix is copied from it (a prefix save of that
  slot restored into the new session's own slot, patch 0004) and the first session keeps
  its slot. Before, the new session took that slot and the first session's conversation
  was saved and moved.

Either way the longer prefix reaches the disk with a reference taken when the server is
quiet, however busy it was when the prefix was written.
"""

from __future__ import annotations

import sqlite3
import threading
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.cache.manager import policy_factory
from core.engine import Core
from core.paths import Paths
from core.server.client import parse_metrics
from core.server.tinymodel import make_tiny_model
from core.status import BootRewarmStatus, cache_of
from tests.conftest import MakeCore, settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import WORDS as SHARED_WORDS
from tests.helpers import cache_idle, cache_manager, post_chat, session_headers, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORDS = SHARED_WORDS[:13]


def _text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 3 + i * 5 + i // 7) % len(WORDS)] for i in range(n))


SYSTEM = "You are a careful coding agent. Rules and project notes follow.\n" + _text(1, 1100)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{k}",
            "description": _text(20 + k, 60),
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": _text(40 + k, 12)}},
                "required": ["path"],
            },
        },
    }
    for k in range(4)
]
# Both sessions open with the same environment block (as agents do: cwd, platform, the
# project's files), then their own task: their common prefix is longer than the system
# text and tools.
OPENING = "<environment>\n" + _text(60, 260) + "\n</environment>\n"


@pytest.fixture(scope="module")
def tiny32k() -> Path:
    return make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)


def _core(make_core: MakeCore, model: Path) -> Core:
    core = make_core(
        policy_factory=policy_factory,
        server__model=str(model),
        server__slots=3,  # two agent slots and the side slot
        server__ctx_per_slot=32768,
    )
    core.start(wait_ready=True, timeout=300)
    wait_until(
        lambda: _on_loop(core, lambda m: m.state.identity is not None),
        60,
        message="the server's identity read",
    )
    return core


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0, "seed": 0}


def _row(session: str, r: httpx.Response, messages: list[dict[str, Any]]) -> dict[str, Any]:
    data, h = r.json(), r.headers
    messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    t = data["timings"]
    row = {
        "session": session,
        "slot": h["X-Warmslot-Slot"],
        "cache": h["X-Warmslot-Cache"],
        "restored": int(h.get("X-Warmslot-Restored", "0")),
        "prefix": h.get("X-Warmslot-Prefix", ""),
        "conversation": h.get("X-Warmslot-Conversation", ""),
        "cache_n": int(t["cache_n"]),
        "prompt_n": int(t["prompt_n"]),
        "prompt_ms": round(float(t["prompt_ms"])),
    }
    print(row)
    return row


def _turn(core: Core, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    row = _row(
        session, post_chat(core, _body(messages), headers=session_headers(session)), messages
    )
    wait_until(lambda: cache_idle(core), 300, interval=0.1, message="cache idle")
    return row


def _on_loop(core: Core, read: Any) -> Any:
    """`read(manager)` on the core's loop, which owns the cache index."""

    async def run() -> Any:
        return read(cache_manager(core))

    return core.submit(run()).result(10)


def _saved_prefixes(core: Core) -> dict[str, int]:
    """Prefix states in the cache index with a reference: fingerprint (16) → tokens."""

    def read(m: Any) -> dict[str, int]:
        return {
            r.fingerprint[:16]: r.n_tokens
            for r in m.state.store.all()
            if r.kind == "prefix" and r.verify_result in ("reference", "ok")
        }

    return dict(_on_loop(core, read))


def _events(core: Core, kind: str) -> list[str]:
    rows = core.query("recent_events", limit=500, category="cache", kind=kind).result(10)
    return [str(e["reason"]) for e in rows]


def _first_session(core: Core) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Two turns of the first session: its messages, its last turn and the prefix on disk."""
    one: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    one.append({"role": "user", "content": OPENING + "Fix the parser. " + _text(70, 80)})
    _turn(core, "agent-one", one)
    one.append({"role": "user", "content": "Tool output:\n" + _text(80, 300)})
    last = _turn(core, "agent-one", one)
    saved = _saved_prefixes(core)
    print(f"on disk: {saved}")
    assert saved, "the first session's stable prefix is on disk, verified"
    return one, last, max(saved.values())


def _second_session() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": OPENING + "Add a test. " + _text(90, 80)},
    ]


def test_a_new_session_restores_the_shared_prefix_while_the_other_slot_works(
    make_core: MakeCore, tiny32k: Path
) -> None:
    core = _core(make_core, tiny32k)
    one, first, shared = _first_session(core)
    # The first session's next turn reads a long tool output: its slot is busy.
    one.append({"role": "user", "content": "Tool output:\n" + _text(100, 3200)})
    answer: dict[str, httpx.Response] = {}
    busy = threading.Thread(
        target=lambda: answer.update(
            r=post_chat(core, _body(one), headers=session_headers("agent-one"))
        )
    )
    busy.start()
    slot_one = int(first["slot"])
    wait_until(
        lambda: _on_loop(core, lambda m: m.state.slots.slots[slot_one].inflight),
        60,
        message="the first session's turn in flight",
    )
    two = _second_session()
    r2 = post_chat(core, _body(two), headers=session_headers("agent-two"))
    still_busy = _on_loop(core, lambda m: m.state.slots.slots[slot_one].inflight)
    second = _row("agent-two", r2, two)
    busy.join(300)
    _row("agent-one", answer["r"], one)
    assert still_busy or second["slot"] != first["slot"], "placed while the other slot worked"
    assert second["slot"] != first["slot"], second
    # The shared prefix came from its verified state on disk, by the server's own count —
    # unless its probe could not run alone (the other slot kept working) within what the
    # restore saves over prefilling: then the turn did not wait longer than that for it
    # and prefilled, and said why (core.cache.costs).
    events = core.query("recent_events", limit=200, category="cache", kind="prewarm_skipped")
    skipped = [e["reason"] for e in events.result(10) if "not used now" in e["reason"]]
    if not skipped:
        assert second["restored"] >= shared, (second, shared)
        assert second["cache_n"] >= shared, (second, shared)
    else:
        print(f"restore not used: {skipped}")
        # It waited at most what the restore would have saved: the prefill it then did.
        assert int(r2.headers["X-Warmslot-Prepare-Ms"]) <= second["prompt_ms"], second
    # The longer prefix the second session taught reaches the disk, verified, although
    # the server was busy when it was written.
    wait_until(lambda: cache_idle(core), 600, interval=0.2, message="cache idle")
    learned_fp, learned_n = second["prefix"].split(":")
    assert int(learned_n) > shared
    saved = _saved_prefixes(core)
    print(f"on disk: {saved}; saves: {_events(core, 'save')}")
    print(f"save_failed: {_events(core, 'save_failed')}")
    assert saved.get(learned_fp) == int(learned_n), saved


def test_a_new_session_gets_the_prefix_copied_from_an_idle_slot(
    make_core: MakeCore, tiny32k: Path
) -> None:
    core = _core(make_core, tiny32k)
    m = cache_manager(core)
    if not _on_loop(core, lambda m: m.prefix_saver.can_save_prefix()):
        pytest.skip("the server cannot save part of a slot (patch 0004)")
    one, first, shared = _first_session(core)
    two = _second_session()
    second = _turn(core, "agent-two", two)
    learned_n = int(second["prefix"].split(":")[1])
    assert learned_n > shared
    # Its own slot, with the whole learned prefix copied into it; the first session
    # keeps its slot and its conversation.
    assert second["slot"] != first["slot"], second
    assert second["restored"] >= learned_n, second
    assert second["cache_n"] >= learned_n, second
    one.append({"role": "user", "content": "Tool output:\n" + _text(110, 200)})
    again = _turn(core, "agent-one", one)
    assert again["slot"] == first["slot"], again
    assert again["restored"] == 0 and not again["conversation"].startswith("restored"), again
    assert again["cache_n"] >= 0.95 * (first["cache_n"] + first["prompt_n"]), (again, first)
    assert not _events(core, "save_failed"), _events(core, "save_failed")
    assert m is cache_manager(core)


def _server_prompt_tokens(core: Core) -> int:
    sup = core.supervisor
    assert sup is not None and sup.base_url is not None
    req = urllib.request.Request(f"{sup.base_url}/metrics", headers=sup.auth_headers())
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(parse_metrics(resp.read().decode())["llamacpp:prompt_tokens_total"])


def test_the_boot_rewarm_restores_the_longest_saved_state_and_prefills_only_the_rest(
    make_core: MakeCore, tiny32k: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    settings = settings_for(tiny32k, server__slots=3, server__ctx_per_slot=32768)
    first = make_core(settings, home=home, policy_factory=policy_factory)
    first.start(wait_ready=True, timeout=300)
    _, _, shared = _first_session(first)
    second = _turn(first, "agent-two", _second_session())
    learned_fp, learned = second["prefix"].split(":")
    learned_n = int(learned)
    first.stop()
    # What is left after the longer prefix's state and the conversations expired (the
    # retention's rules): only the first session's shorter prefix state.
    state_dir = Paths.under(home).state_dir
    index = sqlite3.connect(state_dir / "cache-index.sqlite3")
    with index:
        where = "kind != 'prefix' OR fingerprint LIKE ?"
        gone = [
            r[0]
            for r in index.execute(f"SELECT filename FROM states WHERE {where}", [learned_fp + "%"])
        ]
        index.execute(f"DELETE FROM states WHERE {where}", [learned_fp + "%"])
        left = index.execute("SELECT kind, n_tokens FROM states").fetchall()
    index.close()
    for name in gone:  # the file and the record beside it, as the retention deletes them
        for path in state_dir.rglob(Path(name).stem + ".*"):
            path.unlink()
    assert left == [("prefix", shared)], left

    core = make_core(settings, home=home, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)

    def rewarmed() -> BootRewarmStatus | None:
        cache = cache_of(core.status().result(30))
        boot = cache["boot_rewarm"] if cache is not None else None
        return boot if boot is not None and boot["state"] == "done" else None

    boot = wait_until(rewarmed, 300, message="the boot re-warm done")
    print(boot)
    rows = boot.get("sources", [])
    by_fp = {s["fingerprint"]: s for s in rows}
    # The learned prefix: its shorter saved state restored, only the rest prefilled.
    step = by_fp[learned_fp]
    assert (step["source"], step["restored"]) == ("prefix state", shared), step
    assert step["prefilled"] == learned_n - shared, step
    assert "restored the" in step["text"] and "prefilled" in step["text"], step
    # The shorter prefix itself: restored whole, nothing prefilled.
    assert any(s["restored"] == shared and s["prefilled"] == 0 for s in rows), boot
    # The server's own count: nothing but that rest and the verification probes was read.
    read = _server_prompt_tokens(core)
    print(f"the new server read {read} prompt tokens before any request")
    assert learned_n - shared <= read < learned_n - shared + 200, read
    (done,) = _events(core, "boot_rewarm_done")
    assert "prefix state" in done and "prefilled" in done, done
    # A new session then starts from the warm learned prefix.
    third = _turn(core, "agent-three", _second_session())
    assert third["cache_n"] >= learned_n, third


def test_a_prefix_whose_reference_found_the_server_busy_is_kept_and_verified_later(
    make_core: MakeCore, tiny32k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = _core(make_core, tiny32k)
    gate = cache_manager(core).ops.probe_gate
    real = gate.reference
    calls: list[int] = []

    async def busy_first(
        client: Any, body: Any, slot: int, restore: Any, **kw: Any
    ) -> tuple[Any, list[float]]:
        # The first reference sees other slots working through all its tries, as when
        # another session's long turn ran beside it (ProbeGate's own check says so).
        calls.append(slot)
        if len(calls) == 1:
            await restore()
            return None, [0.0]
        return await real(client, body, slot, restore, **kw)

    monkeypatch.setattr(gate, "reference", busy_first)
    one: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    one.append({"role": "user", "content": OPENING + "Fix the parser. " + _text(70, 80)})
    first = _turn(core, "agent-one", one)
    saves = _events(core, "save")
    print(f"reference calls {calls}; saves {saves}; failed {_events(core, 'save_failed')}")
    assert len(calls) >= 2, calls
    # Kept and verified once the server was quiet: on disk with its reference, never
    # deleted ("no probe reference ran alone in 3 tries").
    fp, n = first["prefix"].split(":")
    assert _saved_prefixes(core).get(fp) == int(n)
    assert any("its reference taken later" in s for s in saves), saves
    assert not _events(core, "save_failed")
