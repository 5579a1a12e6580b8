"""Client profiles against what the real clients sent (tests/fixtures/clients/).

Each fixture is a recorded 3-turn session plus the first turn of a second session
(scripts/record_agents.py; versions and command lines in each folder's README). For
each client: the name the router derives from its User-Agent, how it marks its session,
where its system text's volatile tail starts (core/routing/profiles.py PROFILES: the head
before the cut must be the same in both sessions, the tail must hold what changes) and
which of its calls are side calls (core/routing/profiles.py classify_aux via the router).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from core import chat as apis
from core.cache import prefix as pfx
from core.proxy import billing
from core.proxy import checks as proxy_checks
from core.routing import profiles
from core.routing.router import Decision, Kind, Router, client_name

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"


def recorded(client: str) -> list[dict[str, Any]]:
    """The client's recorded generation requests, in order."""
    entries = json.loads((FIXTURES / client / "requests.json").read_text())
    return [
        e for e in entries if e["method"] == "POST" and apis.ROUTES.get(e["path"], ("", False))[1]
    ]


def view(entry: dict[str, Any]) -> apis.ChatView:
    chat = apis.chat_view(apis.ROUTES[entry["path"]][0], entry["body"])
    assert chat is not None
    return chat


def decisions(entries: list[dict[str, Any]]) -> list[Decision]:
    """The router's decision for each request, in order, on one router (as served)."""
    router = Router.single(None)
    out = []
    for e in entries:
        d = router.decide(apis.ROUTES[e["path"]][0], e["headers"], e["body"])
        assert isinstance(d, Decision)
        out.append(d)
    return out


def by_step(entries: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [e for e in entries if e["step"].startswith(prefix)]


def cut_of(client: str, entry: dict[str, Any]) -> tuple[str, int | None]:
    """The system text and the profile's cut in it (rendered = the system text itself)."""
    system = view(entry).system_text
    cut = profiles.profile_cut(client, system, system)
    return system, None if cut is None else cut[0]


def test_every_recorded_client_has_a_complete_fixture() -> None:
    for client in ("claude-code", "codex", "opencode", "aider"):
        entries = recorded(client)
        steps = {e["step"] for e in entries}
        assert {"s1-turn1", "s1-turn2", "s1-turn3", "s2-turn1"} <= steps, client
        assert all(e["status"] == 200 for e in entries), client
        assert (FIXTURES / client / "README.md").is_file(), client
        for e in entries:  # credentials never reach a fixture
            assert not {"authorization", "x-api-key"} & set(e["headers"]), client


@pytest.mark.parametrize("client", ["claude-code", "codex", "opencode", "aider"])
def test_the_proxy_accepts_every_recorded_request(client: str) -> None:
    """What the real client sent (and llama-server answered 200) passes validation.

    Claude Code 2.1 sends role "system" messages mid-conversation: the Messages check
    refused them with a 400 (found running the real client through Warmslot)."""
    for e in recorded(client):
        proxy_checks.validate(apis.ROUTES[e["path"]][0], e["body"], n_slots=3)


# --------------------------------------------------------------------- Claude Code


def test_claude_code_is_known_by_its_user_agent_and_sends_tools_on_every_turn() -> None:
    entries = recorded("claude-code")
    names = {client_name(e["headers"]["user-agent"]) for e in entries}
    assert names == {"claude-cli"} and "claude-cli" in profiles.PROFILES
    assert all(e["path"] == "/v1/messages" for e in entries)
    assert all(len(view(e).tools) >= 20 for e in entries)


def test_claude_code_names_its_session_in_a_header_and_in_metadata() -> None:
    entries = recorded("claude-code")
    for e in entries:
        meta = json.loads(e["body"]["metadata"]["user_id"])
        assert meta["session_id"] == e["headers"]["x-claude-code-session-id"]
    sessions = [d.session for d in decisions(entries)]
    s1 = {d for d, e in zip(sessions, entries, strict=True) if e["step"].startswith("s1")}
    s2 = {d for d, e in zip(sessions, entries, strict=True) if e["step"].startswith("s2")}
    assert len(s1) == 1 and len(s2) == 1 and s1 != s2
    # The session is the client's own id, not one derived from the prompt.
    assert next(iter(s1)).endswith(by_step(entries, "s1")[0]["headers"]["x-claude-code-session-id"])


def test_claude_code_turns_are_agent_turns_no_side_calls_in_print_mode() -> None:
    ds = decisions(recorded("claude-code"))
    assert [d.kind for d in ds] == [Kind.AGENT] * len(ds)


def test_claude_code_attribution_line_differs_between_sessions() -> None:
    entries = recorded("claude-code")
    s1, s2 = by_step(entries, "s1")[0], by_step(entries, "s2")[0]
    (sys1, cut1), (sys2, cut2) = cut_of("claude-cli", s1), cut_of("claude-cli", s2)
    # The attribution line opens the system text and its cc_version stamp differs
    # between the two sessions (the same within one) — so the head before the first
    # cut differs too: the proxy takes the line out (core.proxy.billing.strip_billing_header),
    # as CLAUDE_CODE_ATTRIBUTION_HEADER=0 makes Claude Code leave it out.
    assert sys1.startswith("x-anthropic-billing-header:")
    assert cut1 is not None and cut2 is not None and sys1[:cut1] != sys2[:cut2]
    stamp = re.compile(r"cc_version=([^;]+);")
    v1 = {stamp.findall(view(e).system_text)[0] for e in by_step(entries, "s1")}
    v2 = stamp.findall(sys2)[0]
    assert len(v1) == 1 and v2 not in v1
    assert without_attribution(sys1[:cut1]) == without_attribution(sys2[:cut2])


def without_attribution(system: str) -> str:
    """The system text as Claude Code sends it with CLAUDE_CODE_ATTRIBUTION_HEADER=0."""
    assert system.startswith("x-anthropic-billing-header:")
    return system[system.index("cc_entrypoint=") :].split(";", 1)[1]


def test_claude_code_boundary_without_the_attribution_line() -> None:
    entries = recorded("claude-code")
    systems = [without_attribution(view(e).system_text) for e in entries]
    cuts = [profiles.profile_cut("claude-cli", s, s) for s in systems]
    assert all(c is not None and c[1] == "profile:claude-cli" for c in cuts)
    heads = {s[: c[0]] for s, c in zip(systems, cuts, strict=True) if c is not None}
    # One head for both sessions and every turn, and it is most of the system text …
    assert len(heads) == 1
    head = next(iter(heads))
    assert len(head) > 1500 and head.endswith("# Memory\n\n")
    # … while the tail holds what is per project and per moment: the working directory
    # (in the memory folder's name and the environment block) and the git status.
    tail = systems[0][len(head) :]
    work = "/rec/claude/work"
    assert work in tail and work not in head
    assert "gitStatus:" in tail and "Recent commits:" in tail
    # The first cut is the memory folder's line (the earliest cwd-dependent text).
    assert tail.startswith("You have a persistent file-based memory at")


def test_claude_code_attribution_line_is_stripped_exactly_and_the_sessions_then_agree() -> None:
    # What the proxy forwards by default (proxy.strip_billing_header): each recorded
    # body without its attribution block, everything else byte for byte the same.
    entries = recorded("claude-code")
    heads = set()
    lines = set()
    for e in entries:
        body = copy.deepcopy(e["body"])
        removed = billing.strip_billing_header(body)
        assert len(removed) == 1 and removed[0].startswith("x-anthropic-billing-header:")
        lines.add(removed[0])
        original = e["body"]
        assert body["system"] == original["system"][1:]
        assert {k: v for k, v in body.items() if k != "system"} == {
            k: v for k, v in original.items() if k != "system"
        }
        # The system text is then what CLAUDE_CODE_ATTRIBUTION_HEADER=0 makes Claude
        # Code send …
        system = view({**e, "body": body}).system_text
        assert system == without_attribution(view(e).system_text)
        cut = profiles.profile_cut("claude-cli", system, system)
        assert cut is not None and cut[1] == "profile:claude-cli"
        heads.add(system[: cut[0]])
    # … so both sessions (two different stamps) share one stable head, which opens the
    # system text.
    assert len(lines) == 2
    assert len(heads) == 1 and next(iter(heads)).startswith("You are a Claude agent")


def test_claude_code_date_is_in_the_first_user_message_not_the_system_text() -> None:
    entries = recorded("claude-code")
    for e in entries:
        chat = view(e)
        first_user = next(m for m in chat.messages if m["role"] == "user")
        assert "Today's date is" in apis.content_text(first_user["content"])
        assert "Today's date is" not in chat.system_text.split("gitStatus:")[0]


# --------------------------------------------------------------------------- Codex


def test_codex_is_known_by_its_user_agent_and_names_its_session_in_a_header() -> None:
    entries = recorded("codex")
    assert {client_name(e["headers"]["user-agent"]) for e in entries} == {"codex_exec"}
    assert "codex_exec" in profiles.PROFILES
    assert all(e["path"] == "/v1/responses" for e in entries)
    ds = decisions(entries)
    for d, e in zip(ds, entries, strict=True):
        assert d.session == e["headers"]["session-id"] == e["body"]["prompt_cache_key"]
        assert d.kind is Kind.AGENT
    s1 = {d.session for d, e in zip(ds, entries, strict=True) if e["step"].startswith("s1")}
    s2 = {d.session for d, e in zip(ds, entries, strict=True) if e["step"].startswith("s2")}
    assert len(s1) == 1 and len(s2) == 1 and s1 != s2


def test_codex_session_would_collide_without_its_header() -> None:
    """Why the session-id header matters: the prompt alone names no session."""
    entries = recorded("codex")
    firsts = [by_step(entries, "s1")[0], by_step(entries, "s2")[0]]
    derived = {view(e).derived_session("codex_exec") for e in firsts}
    assert len(derived) == 1


def test_codex_boundary_is_the_end_of_its_developer_text() -> None:
    entries = recorded("codex")
    systems = {view(e).system_text for e in entries}
    # The developer messages (instructions, skills) are the same in both sessions and
    # every turn; no marker is in them, so the learner's end-of-system rule applies.
    assert len(systems) == 1
    system = next(iter(systems))
    assert profiles.profile_cut("codex_exec", system, system) is None
    assert "/rec/codex/work" not in system
    for e in entries:
        first_user = next(m for m in view(e).messages if m["role"] == "user")
        text = apis.content_text(first_user["content"])
        assert text.startswith("<environment_context>")
        assert "<cwd>" in text and "<current_date>" in text


# ------------------------------------------------------------------------ opencode


def test_opencode_sessions_title_side_calls_and_env_boundary() -> None:
    entries = recorded("opencode")
    assert {client_name(e["headers"]["user-agent"]) for e in entries} == {"opencode"}
    ds = decisions(entries)
    for d, e in zip(ds, entries, strict=True):
        assert d.session == e["headers"]["x-session-id"]
        titled = view(e).system_text.startswith("You are a title generator")
        assert (d.kind is Kind.SIDE) == titled
        if titled:  # by its prompt, or (once tools were seen) by carrying none
            assert d.why in (
                "title/summary request shape",
                "no tools from a client whose agent turns carry tools",
            )
    assert sum(d.kind is Kind.SIDE for d in ds) == 2  # one title call per session
    agents = [e for e, d in zip(entries, ds, strict=True) if d.kind is Kind.AGENT]
    heads = set()
    for e in agents:
        system, cut = cut_of("opencode", e)
        assert cut is not None
        heads.add(system[:cut])
        assert system[cut:].startswith("<env>") and "/rec/opencode/work" in system[cut:]
    assert len(heads) == 1


# --------------------------------------------------------------------------- aider


def test_aider_speaks_through_the_openai_sdk_and_its_commit_call_is_a_side_call() -> None:
    entries = recorded("aider")
    # aider's User-Agent is the OpenAI Python SDK's: no profile can be keyed on it.
    assert {client_name(e["headers"]["user-agent"]) for e in entries} == {"openai"}
    assert "openai" not in profiles.PROFILES
    ds = decisions(entries)
    kinds = {e["step"]: (d.kind, d.why) for e, d in zip(entries, ds, strict=True)}
    assert kinds["s1-commit"] == (Kind.SIDE, "commit message request (aider)")
    for step in ("s1-turn1", "s1-turn2", "s1-turn3", "s2-turn1"):
        assert kinds[step][0] is Kind.AGENT, step
    # No tools on any call: only the prompt tells the commit call apart.
    assert not any(view(e).tools for e in entries)


def test_aider_system_text_has_no_volatile_tail_and_history_goes_before_the_files() -> None:
    entries = recorded("aider")
    turns = by_step(entries, "s1-turn") + by_step(entries, "s2")
    systems = {view(e).system_text for e in turns}
    assert len(systems) == 1
    system = next(iter(systems))
    assert profiles.profile_cut("openai", system, system) is None  # no generic marker in it
    # A later turn keeps the opening (system, examples, repo map) and inserts the
    # history before the chat's files: the new prompt leaves the previous one there, so
    # the files and the question are read again on every turn.
    t1, t2 = (view(e).messages for e in by_step(entries, "s1-turn")[:2])
    n = pfx.common_prefix_len(t1, t2)
    assert "summaries of some files" in apis.content_text(t1[n - 2]["content"])  # repo map
    assert apis.content_text(t1[n]["content"]).startswith("I have *added these files")


def test_aider_summary_prompt_is_a_side_call() -> None:
    """aider's chat summary (aider/prompts.py summarize), sent with a system message."""
    body = {
        "messages": [
            {
                "role": "system",
                "content": "*Briefly* summarize this partial conversation about programming.\n"
                "Include less detail about older parts and more detail about the most recent.",
            },
            {"role": "user", "content": "# USER\nRead hello.py\n# ASSISTANT\nOk."},
        ]
    }
    assert profiles.classify_aux(body, has_tools=False, client_uses_tools=False) == (
        "chat summary request (aider)"
    )


@pytest.mark.parametrize("client", ["claude-code", "codex", "opencode", "aider"])
def test_profile_markers_sit_in_system_text_only(client: str) -> None:
    """A marker's words in a user message never cut the prefix (profile_cut's rule)."""
    for e in recorded(client):
        chat = view(e)
        name = client_name(e["headers"]["user-agent"])
        system = chat.system_text
        rendered = system + "\n" + json.dumps(chat.messages)
        cut = profiles.profile_cut(name, rendered, system)
        assert cut is None or cut[0] <= len(system)
