"""Several backends behind one proxy (docs/scale.md#several-backends).

Two real llama-servers (the primary 'main' and a launched backend 'b1', the tiny
model, loopback, the patched build) behind one Core with the cache manager on. Four
opencode-shaped sessions of two projects replay opencode's recorded requests
(tests/fixtures/clients/opencode): project A as recorded, project B with its own tools
(a project MCP server) and working directory, so its stable prefix differs.

Each project's sessions must land on one backend, where the project's prefix is: from
turn 2 every agent turn reuses ≥ 95 % of its prompt, and a second session's first turn
≥ 90 %. Then project B's backend is killed (SIGKILL): its sessions' next turns must be
answered by the other backend (the first request after Warmslot saw the exit
succeeds), with the stable prefix restored there from the shared disk tier.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from httpx import Headers

from core.cache.manager import policy_factory
from core.config import BackendSettings
from core.engine import Core
from core.events import RequestCompleted
from core.models.backends import backend_lines
from core.paths import resources_dir
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore, settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import EventLog, post_chat, session_headers, wait_until

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "clients" / "opencode"
CWD = "/root/.cache/warmslot-agents/rec/opencode/work"
JIRA = {
    "type": "function",
    "function": {
        "name": "jira_search",
        "description": "Search the billing project's Jira issues (MCP server 'jira').",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "JQL or words"}},
            "required": ["query"],
        },
    },
}


def _project_b(body: dict[str, Any]) -> dict[str, Any]:
    """The same request from another project: its own MCP tool and working directory."""
    out = copy.deepcopy(body)
    if out.get("tools"):
        out["tools"] = [JIRA, *out["tools"]]
    for m in out["messages"]:
        if isinstance(m.get("content"), str):
            m["content"] = m["content"].replace(CWD, "/home/dev/billing")
    return out


def _sessions() -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """session → its turns, each (title side call or {}, agent turn)."""
    entries = json.loads((FIXTURE / "requests.json").read_text())
    s1 = [e for e in entries if e["step"].startswith("s1-")]
    s2 = [e for e in entries if e["step"].startswith("s2-")]
    title1, turns1 = s1[0]["body"], [e["body"] for e in s1[1:]]
    title2, first2 = s2[0]["body"], s2[1]["body"]
    # Session 2's later turns: session 1's, with session 2's own first question.
    turns2 = [first2] + [copy.deepcopy(b) for b in turns1[1:]]
    for b in turns2[1:]:
        b["messages"][1] = copy.deepcopy(first2["messages"][1])
    plan = {
        "a1": [(title1, turns1[0]), ({}, turns1[1]), ({}, turns1[2])],
        "a2": [(title2, turns2[0]), ({}, turns2[1]), ({}, turns2[2])],
    }
    plan["b1"] = [(_project_b(t) if t else {}, _project_b(b)) for t, b in plan["a1"]]
    plan["b2"] = [(_project_b(t) if t else {}, _project_b(b)) for t, b in plan["a2"]]
    return plan


OPENCODE = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"


def _post(core: Core, session: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], Headers]:
    """An opencode turn of `session`, short and greedy: status, JSON (or the error's text),
    headers."""
    body = {**body, "stream": False, "max_tokens": 4, "temperature": 0}
    body.pop("stream_options", None)
    headers = {"User-Agent": OPENCODE, **session_headers(session)}
    r = post_chat(core, body, headers=headers, expect=None)
    data = r.json() if r.status_code == 200 else {"error": r.text}
    return r.status_code, data, r.headers


def _status(core: Core) -> dict[str, Any]:
    st = core.server_status().result(30)
    return {r["name"]: r for r in st["backends"]["backends"]}


def _turn(core: Core, session: str, title: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"session": session}
    if title:
        status, _, headers = _post(core, session, title)
        assert status == 200, headers
        row["title_backend"] = headers.get("X-Warmslot-Backend")
        assert headers.get("X-Warmslot-Kind") == "aux"
    status, data, headers = _post(core, session, body)
    assert status == 200, data
    t = data["timings"]
    prompt = int(t["cache_n"]) + int(t["prompt_n"])
    row.update(
        backend=headers["X-Warmslot-Backend"],
        cache_n=int(t["cache_n"]),
        prompt=prompt,
        hit=int(t["cache_n"]) / prompt,
        restored=int(headers.get("X-Warmslot-Restored", "0")),
    )
    return row


def test_two_projects_stay_with_their_prefix_and_a_killed_backend_moves_its_sessions(
    make_core: MakeCore,
) -> None:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    settings = settings_for(
        model,
        server__slots=5,  # four agent slots: after the kill all four sessions fit on one
        server__ctx_per_slot=24576,
        server__chat_template_file=str(resources_dir() / "templates" / "gemma3-tools.jinja"),
    )
    settings.backends = [BackendSettings(name="b1")]
    core = make_core(settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    wait_until(
        lambda: all(r["ready"] for r in _status(core).values()),
        300,
        message=lambda: f"backends not ready: {_status(core)}",
    )
    plan = _sessions()
    rows: list[dict[str, Any]] = []
    for turn in range(3):
        # Turn 1 in project order: a2 arrives while its project has one session and the
        # other backend none, so only the prefix (not the load) sends it after a1.
        order = ("a1", "a2", "b1", "b2") if turn == 0 else ("a1", "b1", "a2", "b2")
        for session in order:
            title, body = plan[session][turn]
            rows.append({**_turn(core, session, title, body), "turn": turn + 1})
    report = "\n".join(
        f"turn {r['turn']} {r['session']}: {r['backend']} {r['cache_n']}/{r['prompt']} "
        f"= {r['hit']:.1%} restored {r['restored']}"
        for r in rows
    )
    print(report)
    where = {s: {r["backend"] for r in rows if r["session"] == s} for s in plan}
    # Each project on one backend, the two projects on different ones.
    assert where["a1"] == where["a2"] and len(where["a1"]) == 1, report
    assert where["b1"] == where["b2"] and len(where["b1"]) == 1, report
    assert where["a1"] != where["b1"], report
    for r in rows:
        if r["turn"] >= 2:
            assert r["hit"] >= 0.95, report
        elif r["session"] in ("a2", "b2"):
            assert r["hit"] >= 0.90, report

    # Kill project B's backend; its sessions' next turns go to the other one.
    (b_backend,) = where["b1"]
    (a_backend,) = where["a1"]
    pid = _status(core)[b_backend]["pid"]
    assert pid
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _status(core)[b_backend]["ready"], 30, message="the kill not seen")
    seen_s = time.monotonic() - t0
    moved: list[dict[str, Any]] = []
    for session in ("b1", "b2"):
        # One more turn on the conversation so far (turn 3's body with a new question).
        body = copy.deepcopy(plan[session][2][1])
        body["messages"].append({"role": "assistant", "content": "done"})
        body["messages"].append({"role": "user", "content": "Now run the tests."})
        moved.append({**_turn(core, session, {}, body), "turn": 4})
        body["messages"].append({"role": "assistant", "content": "ok"})
        body["messages"].append({"role": "user", "content": "Commit it."})
        moved.append({**_turn(core, session, {}, body), "turn": 5})
    report2 = "\n".join(
        f"turn {r['turn']} {r['session']}: {r['backend']} {r['cache_n']}/{r['prompt']} "
        f"= {r['hit']:.1%} restored {r['restored']}"
        for r in moved
    )
    print(f"kill seen after {seen_s:.2f} s\n{report2}")
    assert all(r["backend"] == a_backend for r in moved), report2
    st = _status(core)
    assert st[a_backend]["moved_in"] == 2, st
    first = [r for r in moved if r["turn"] == 4]
    # The stable prefix came from the shared disk tier (the other backend saved it), so
    # the first turn after the move re-reads only the conversation after it.
    assert all(r["restored"] > 0 or r["hit"] >= 0.90 for r in first), report2
    assert all(r["hit"] >= 0.95 for r in moved if r["turn"] == 5), report2
    # Both backends report what they served; the killed one restarts by itself.
    wait_until(lambda: _status(core)[b_backend]["ready"], 120, message="no restart")
    full = core.status().result(30)
    assert full["backends"]["moved"] == 2
    lines = backend_lines(full["backends"])
    print("\n".join(lines))
    assert lines[0] == "backends (4 sessions, 2 moved):", lines
    assert any(line.split()[0] == a_backend and "2 moved in" in line for line in lines), lines
    assert core.proxy is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{core.proxy.port}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert f'warmslot_backend_sessions_moved_in_total{{backend="{a_backend}"}} 2' in metrics
    assert f'warmslot_backend_ready{{backend="{b_backend}"}} 1' in metrics
    assert f'warmslot_backend_requests_total{{backend="{b_backend}",kind="aux"}}' in metrics


def _simple(core: Core, session: str, system: str, user: str) -> tuple[int, dict[str, str]]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    }
    status, _, headers = _post(core, session, body)
    return status, headers


def test_a_remote_warmslot_backend_serves_until_it_goes_away(make_core: MakeCore) -> None:
    remote = make_core(policy_factory=policy_factory)
    served = EventLog()
    remote.subscribe(served.append, (RequestCompleted,))
    remote.start(wait_ready=True, timeout=300)
    assert remote.proxy is not None
    settings = settings_for(Path(remote.settings.server.model))
    url = f"http://127.0.0.1:{remote.proxy.port}"
    settings.backends = [BackendSettings(name="far", url=url)]
    core = make_core(settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    # Its /health is checked every 2 s: ready once the remote Warmslot answers 200.
    wait_until(lambda: _status(core)["far"]["ready"], 30, message=lambda: str(_status(core)))
    assert _status(core)["far"]["where"] == url
    head = "You are a careful assistant for project {}. " + "Follow the house rules. " * 20
    status, h1 = _simple(core, "s-one", head.format("one"), "hello")
    assert status == 200 and h1["X-Warmslot-Backend"] == "main"
    status, h2 = _simple(core, "s-two", head.format("two"), "hello")
    assert status == 200 and h2["X-Warmslot-Backend"] == "far"
    status, h3 = _simple(core, "s-two", head.format("two"), "hello again")
    assert status == 200 and h3["X-Warmslot-Backend"] == "far"
    # The remote Warmslot served both, in a slot of its own cache manager, as the same
    # session (the client's session header went through).
    done = wait_until(
        lambda: len(served.of(RequestCompleted)) == 2 and served.of(RequestCompleted), 30
    )
    assert {e.session for e in done} == {"s-two"} and all(e.slot is not None for e in done)

    remote.stop()
    wait_until(lambda: not _status(core)["far"]["ready"], 30, message="remote still ready")
    assert "unreachable" in _status(core)["far"]["state"]
    status, h4 = _simple(core, "s-two", head.format("two"), "and again")
    assert status == 200 and h4["X-Warmslot-Backend"] == "main"
    st = core.server_status().result(30)
    assert st["backends"]["moved"] == 1
    rows = {r["name"]: r for r in st["backends"]["backends"]}
    assert rows["far"]["calls"]["agent"] == 2 and rows["main"]["moved_in"] == 1


def test_killing_the_primary_moves_its_sessions_to_another_backend(make_core: MakeCore) -> None:
    settings = settings_for(Path(make_tiny_model(cache_dir() / "tiny.gguf")), server__slots=3)
    settings.backends = [BackendSettings(name="b1")]
    core = make_core(settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    wait_until(lambda: all(r["ready"] for r in _status(core).values()), 300)
    head = "You are a careful assistant for project {}. " + "Follow the house rules. " * 20
    status, h1 = _simple(core, "s-main", head.format("one"), "hello")
    assert status == 200 and h1["X-Warmslot-Backend"] == "main"
    status, h2 = _simple(core, "s-b1", head.format("two"), "hello")
    assert status == 200 and h2["X-Warmslot-Backend"] == "b1"
    pid = _status(core)["main"]["pid"]
    assert pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _status(core)["main"]["ready"], 30, message="the kill not seen")
    status, h3 = _simple(core, "s-main", head.format("one"), "hello again")
    assert status == 200 and h3["X-Warmslot-Backend"] == "b1", h3
    # The primary restarts by itself (its supervisor) and takes no session back.
    wait_until(lambda: _status(core)["main"]["ready"], 120, message="main did not restart")
    status, h4 = _simple(core, "s-main", head.format("one"), "and again")
    assert status == 200 and h4["X-Warmslot-Backend"] == "b1"
    st = core.server_status().result(30)
    assert st["backends"]["moved"] == 1 and st["server"]["state"] == "ready"
