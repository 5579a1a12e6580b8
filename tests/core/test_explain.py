"""Why a request reused what it did (core.cache.explain): sections, divergence, storage,
and `warmslot explain` against a real llama-server with a Claude-Code-shaped prompt."""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from httpx import Headers

from core.cache import explain
from core.cache.manager import CacheManager, policy_factory
from core.engine import Core
from core.events import Event, RequestExplained
from core.telemetry import Telemetry
from tests.helpers import post_chat

WARMSLOT = Path(sys.executable).parent / "warmslot"

# ------------------------------------------------------------------ sections


def test_spans_follow_the_rendering_and_name_each_part() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are a coding agent.\nToday: 2026-11-30"},
            {"role": "user", "content": "fix the bug"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "read", "description": "Read a file."}},
            {"type": "function", "function": {"name": "grep", "description": "Search files."}},
        ],
    }
    rendered = (
        "<|im_start|>system\nYou are a coding agent.\nToday: 2026-11-30\n\n# Tools\n<tools>\n"
        '{"name": "read", "description": "Read a file."}\n'
        '{"name": "grep", "description": "Search files."}\n</tools><|im_end|>\n'
        "<|im_start|>user\nfix the bug<|im_end|>\n<|im_start|>assistant\ndone<|im_end|>\n"
        "<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
    )
    got = explain.spans(body, rendered)
    names = [s.name for s in got]
    assert names == [
        "system",
        "tool read",
        "tool grep",
        "message 2 (user)",
        "message 3 (assistant)",
        "message 4 (user)",
        "end",
    ]
    # Contiguous and complete: every character belongs to exactly one section.
    assert got[0].start == 0 and got[-1].end == len(rendered)
    assert all(a.end == b.start for a, b in itertools.pairwise(got))
    by = {s.name: rendered[s.start : s.end] for s in got}
    assert by["system"].endswith("Today: 2026-11-30")
    assert by["message 2 (user)"].endswith("fix the bug")  # its turn header comes with it
    assert by["end"] == "<|im_end|>\n<|im_start|>assistant\n"


def test_spans_without_any_known_part_is_one_section() -> None:
    assert explain.spans({"messages": []}, "abc") == [explain.Span("prompt", 0, 3)]


def test_token_map_counts_bytes_and_a_leading_bos() -> None:
    rendered = "héllo wörld"
    pieces = [b"<s>", b" h", "é".encode(), b"llo", b" w", "ö".encode()[:1], "ö".encode()[1:]]
    pieces += [b"rld"]
    # The pieces stand for "<s>" + " " + rendered: 4 bytes before the text.
    tm = explain.TokenMap(rendered, pieces)
    assert tm.shift == 4
    assert tm.tokens_at([0, 1, 2, 6, 7, 8]) == [1, 2, 3, 4, 5, 7]


# ------------------------------------------------------------------ divergence


class _Server:
    """apply_template/tokenize_pieces over a fixed table: character tokens, BOS first."""

    def __init__(self) -> None:
        self.rendered: dict[str, str] = {}
        self.calls = 0

    async def apply_template(self, body: dict[str, Any]) -> str:
        self.calls += 1
        return self.rendered[json.dumps(body, sort_keys=True)]

    async def tokenize_pieces(
        self, content: str, *, add_special: bool = False
    ) -> list[tuple[int, bytes]]:
        self.calls += 1
        out = [(1, b"<s>")] if add_special else []
        return out + [(ord(c), c.encode()) for c in content]


async def test_divergence_names_section_and_index_and_prices_it() -> None:
    published: list[Event] = []
    ex = explain.Explainer(published.append)
    srv = _Server()

    def body(date: str, question: str) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "system", "content": f"Agent rules.\nDate: {date}"},
                {"role": "user", "content": question},
            ]
        }

    def render(b: dict[str, Any]) -> str:
        m = b["messages"]
        return f"S:{m[0]['content']}|U:{m[1]['content']}|A:"

    req = {"request_id": "r1", "client": "cc", "session": "s", "slot": 0, "kind": "agent"}
    for b in (body("2026-11-30", "hi"), body("2026-12-01", "hi")):
        srv.rendered[json.dumps(b, sort_keys=True)] = render(b)
    rate = 2.0  # ms per token, as measured on cold prefills (core.telemetry.rates.PrefillRates)
    ex.record(req, body("2026-11-30", "hi"), 100, 0, 40, rate)
    ex.record({**req, "request_id": "r2"}, body("2026-12-01", "hi"), 100, 20, 21, rate)
    # Recording renders nothing: the server is asked only when an explanation is.
    assert srv.calls == 0 and ex.find("r1") is None
    second = await ex.explain(srv, "r2")
    assert second is not None
    assert srv.calls == 4  # both prompts rendered and tokenized, once each
    first = await ex.explain(srv, "r1")  # its own prompt is known by now: no call
    assert srv.calls == 4
    assert first is not None and first["divergence"] is None
    assert "no earlier prompt" in first["note"]
    div = second["divergence"]
    old = render(body("2026-11-30", "hi"))
    index = old.index("2026-11-30") + len("2026-1")  # the first character that differs
    assert div["token"] == index + 1  # + the BOS token
    assert div["section"] == "system" and div["old_section"] == "system"
    assert div["offset"] == index + 1  # the system section starts at token 0
    assert div["old"].startswith("1-30") and div["new"].startswith("2-01")
    assert second["lost_tokens"] == len(old) + 1 - (index + 1)
    assert second["cost_s"] == pytest.approx(second["lost_tokens"] * 2.0 / 1000)
    assert "diverged at token" in second["summary"] and "in system" in second["summary"]
    # The telemetry event carries the summary and the sections.
    assert [e.request_id for e in published if isinstance(e, RequestExplained)] == ["r2", "r1"]
    ev = published[0]
    assert isinstance(ev, RequestExplained) and ev.div_token == index + 1
    assert json.loads(ev.sections)[0]["name"] == "system"
    assert ex.find("r1") is first and ex.find(None) is first
    assert await ex.explain(srv, "r2") is second  # computed once
    assert [r["request_id"] for r in ex.status()] == ["r2"]
    # The rendered text's point of divergence, for the divergence event and status.
    assert second["where"]["new"].startswith("2-01") and second["where"]["token_index"] == index + 1


async def test_extension_is_no_divergence_and_a_restore_forgets_the_slot() -> None:
    ex = explain.Explainer(lambda e: None)
    srv = _Server()
    a = {"messages": [{"role": "user", "content": "one"}]}
    b = {"messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]}
    srv.rendered[json.dumps(a, sort_keys=True)] = "U:one|"
    srv.rendered[json.dumps(b, sort_keys=True)] = "U:one|U:two|"
    req = {"client": "cc", "session": None, "slot": 1}
    ex.record({**req, "request_id": "x1"}, a, 10, 0, 7, None)
    ex.record({**req, "request_id": "x2"}, b, 10, 7, 6, None)
    rec = await ex.explain(srv, "x2")
    assert rec is not None and rec["divergence"] is None and "extends" in rec["note"]
    ex.slot_changed(1)
    ex.record({**req, "request_id": "x3"}, b, 10, 0, 13, None)
    rec = await ex.explain(srv, "x3")
    assert rec is not None and "no earlier prompt" in rec["note"]


async def test_kept_requests_are_bounded_by_count_and_bytes() -> None:
    ex = explain.Explainer(lambda e: None)
    srv = _Server()
    a = {"messages": [{"role": "user", "content": "one"}]}
    srv.rendered[json.dumps(a, sort_keys=True)] = "U:one|"
    big = explain.KEEP_BYTES // 3
    for k in range(5):
        ex.record(
            {"request_id": f"r{k}", "client": "", "session": "", "slot": 0}, a, big, 0, 7, None
        )
    # Three bodies of a third of the budget do not fit with a fourth: the oldest go.
    assert list(ex.kept) == ["r2", "r3", "r4"] and ex.kept_bytes == 3 * big
    assert await ex.explain(srv, "r1") is None  # no longer kept
    # A kept request whose predecessor was let go explains without it.
    ex.kept["r2"].previous = None
    rec = await ex.explain(srv, "r2")
    assert rec is not None and "no earlier prompt" in rec["note"]
    for k in range(explain.KEEP + 10):
        ex.record({"request_id": f"s{k}", "client": "", "session": "", "slot": 1}, a, 1, 0, 7, None)
    assert len(ex.kept) == explain.KEEP and f"s{explain.KEEP + 9}" in ex.kept


# ------------------------------------------------------------------ telemetry


def test_telemetry_stores_explanations_and_migrates_an_old_database(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.db"
    tel = Telemetry(path)
    tel.close()
    # An older database: without the explanations table and its migration record.
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE explanations")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm003_explanations'")
    conn.commit()
    conn.close()
    tel = Telemetry(path)
    rec = {
        "request_id": "abc",
        "client": "cc",
        "session": "s",
        "slot": 0,
        "n_tokens": 10,
        "cache_n": 2,
        "prompt_n": 8,
        "previous_tokens": 9,
        "divergence": {"token": 2, "section": "system", "offset": 2},
        "lost_tokens": 7,
        "cost_s": 0.1,
        "summary": "diverged",
        "sections": [{"name": "system", "start": 0, "n_tokens": 10}],
        "compute_ms": 1.5,
    }
    tel.record(explain.event_of(rec))
    row = tel.query("explanation", request_id="abc")
    assert row is not None and row["div_token"] == 2 and row["div_section"] == "system"
    back = explain.from_row(row)
    assert back["sections"] == rec["sections"] and back["divergence"] == rec["divergence"]
    assert tel.query("explanation") == row  # the latest
    assert tel.query("explanation", request_id="nope") is None
    assert [r["request_id"] for r in tel.query("explanations", diverged=True)] == ["abc"]
    tel.close()


# ------------------------------------------------------------------ real server


def _chat(core: Core, body: dict[str, Any], session: str) -> tuple[dict[str, Any], Headers]:
    """A Claude Code request of `session`: the answer's JSON and headers."""
    headers = {"User-Agent": "claude-cli/2.0.0 (external, cli)", "x-session-id": session}
    r = post_chat(core, body, headers=headers)
    return r.json(), r.headers


def claude_code_body(date: str) -> dict[str, Any]:
    """Claude Code's shape: a long system prompt whose tail holds the environment (date,
    working directory), a tools list, one user turn."""
    rules = "\n".join(
        f"- Rule {i}: when you edit a file, read it first and keep the code style."
        for i in range(40)
    )
    system = (
        "You are Claude Code, an interactive CLI tool that helps users with software "
        f"engineering tasks.\n\n# Rules\n{rules}\n\n<env>\nWorking directory: /home/user/"
        f"project\nIs directory a git repo: yes\nPlatform: linux\nToday's date: {date}\n</env>"
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{desc} Use it whenever the task needs it.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "a file path"}},
                    "required": ["path"],
                },
            },
        }
        for name, desc in (
            ("Read", "Reads a file from the local filesystem."),
            ("Edit", "Performs exact string replacements in files."),
            ("Bash", "Executes a given bash command in a persistent shell."),
        )
    ]
    return {
        "model": "m",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Please look at main.py and fix the failing test."},
        ],
        "tools": tools,
    }


@pytest.mark.integration
def test_explain_names_the_system_section_and_the_date_token(
    make_core: Any, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    core = make_core(home=home, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    manager = core.policy
    assert isinstance(manager, CacheManager)
    first, h1 = _chat(core, claude_code_body("2026-11-30"), "cc-session")
    second, h2 = _chat(core, claude_code_body("2026-12-01"), "cc-session")
    assert h1["X-Warmslot-Slot"] == h2["X-Warmslot-Slot"]  # same session, same slot
    rid = h2["X-Warmslot-Request-Id"]
    rec = core.explain(rid).result(60)  # computed when asked, by the manager that served it
    assert rec is not None
    # What the date line's tokens are, asked of the server independently of explain.py.
    client = manager.state.client
    assert client is not None
    render = {k: v for k, v in claude_code_body("2026-12-01").items() if k in ("messages", "tools")}
    rendered = core.submit(client.apply_template(render)).result(30)
    line = rendered.index("Today's date: ")
    date_at = line + len("Today's date: 2026-1")  # "1-30" → "2-01": the first change
    before_date = core.submit(client.tokenize(rendered[:line], add_special=True)).result(30)
    through_date = core.submit(client.tokenize(rendered[: date_at + 1], add_special=True)).result(
        30
    )
    div = rec["divergence"]
    assert div is not None and div["section"] == "system", rec
    assert len(before_date) <= div["token"] < len(through_date), (div, len(before_date))
    # The server reused up to the divergence, not past it.
    assert second["timings"]["cache_n"] <= div["token"]
    assert rec["n_tokens"] == first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    assert {s["name"] for s in rec["sections"]} >= {"system", "tool Read", "tool Edit", "tool Bash"}
    assert sum(s["n_tokens"] for s in rec["sections"]) == rec["n_tokens"]

    env = {**os.environ, "WARMSLOT_HOME": str(home)}
    out = subprocess.run(
        [str(WARMSLOT), "explain", rid], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"diverged at token {div['token']:,} in system" in out.stdout
    assert "← diverged here" in out.stdout and "tool Bash" in out.stdout
    latest = subprocess.run(
        [str(WARMSLOT), "explain", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert json.loads(latest.stdout)["request_id"] == rid
    unknown = subprocess.run(
        [str(WARMSLOT), "explain", "no-such-id"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert unknown.returncode == 1 and "no explanation for request 'no-such-id'" in unknown.stdout
    st = core.status().result(30)
    assert rid in st["cache"]["text"] and "last divergences" in st["cache"]["text"]


# ------------------------------------------------------------------ X-Warmslot-Restored


async def test_prepare_says_restored_only_for_a_verified_restore(tmp_path: Path) -> None:
    """`restore` marks the slot with what it restored; `prepare` puts that into the plan
    of the request that uses it, which the proxy renders as X-Warmslot-Restored (a
    re-warm is not a restore), and forgets the slot's previous prompt for the explanation."""
    from core.proxy.headers import cache_headers
    from tests.core.bg_support import make_manager
    from tests.core.test_boot_rewarm import attach, request

    core, _ = make_manager(tmp_path)
    mgr, _ = attach(core)
    for promised, header in (
        ((0, ""), None),
        ((1200, "re-warmed prefix"), None),
        ((1200, "restored prefix state"), "1200"),
        ((900, "restored prefix (from a saved conversation)"), "900"),
    ):
        req = request(f"s{promised[0]}{header}")
        mgr.state.slots.slots[0].promised = promised
        mgr.state.slots.slots[1].promised = promised
        for slot in (0, 1):
            mgr.explainer.record(
                {"request_id": f"before{slot}", "client": "", "session": "", "slot": slot},
                {"messages": []},
                10,
                0,
                1,
                None,
            )
        plan = await mgr.prepare(req)
        assert plan is not None
        assert plan.restored == (int(header) if header else 0)
        rendered = cache_headers(None, slot=plan.slot, session="", plan=plan, ms_per_token=None)
        assert rendered["X-Warmslot-Restored"] == (header or "0")
        assert (plan.slot in mgr.explainer.last) == (promised[0] == 0)
        await mgr.completed(req, None, 499)


# ------------------------------------------------------------------ warmslot explain offline


def test_explain_reads_the_database_when_no_warmslot_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.cli.main import main
    from core.paths import Paths

    home = tmp_path / "home"
    monkeypatch.setenv("WARMSLOT_HOME", str(home))
    assert main(["explain"]) == 3  # nothing runs, no database
    assert "Warmslot is not running and its database has none" in capsys.readouterr().out
    paths = Paths.under(home)
    paths.ensure()
    tel = Telemetry(paths.telemetry_db)
    rec = {
        "request_id": "old-one",
        "client": "cc",
        "session": "s",
        "slot": 1,
        "ts": 1.0,
        "previous_tokens": 30,
        "cost_s": None,
        "summary": "",
        "compute_ms": 1.0,
        "n_tokens": 50,
        "cache_n": 10,
        "prompt_n": 40,
        "divergence": {
            "token": 10,
            "section": "message 2 (user)",
            "offset": 3,
            "before": "a",
            "old": "b",
            "new": "c",
        },
        "lost_tokens": 20,
        "sections": [
            {"name": "system", "start": 0, "n_tokens": 7},
            {"name": "message 2 (user)", "start": 7, "n_tokens": 43},
        ],
    }
    rec["summary"] = explain.summary(rec)
    tel.record(explain.event_of(rec))
    tel.close()
    assert main(["explain", "old-one"]) == 0
    out = capsys.readouterr().out
    assert "diverged at token 10 in message 2 (user)" in out
    assert "message 2 (user)   ← diverged here" in out
    assert main(["explain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_id"] == "old-one"
    assert main(["explain", "nope"]) == 3
