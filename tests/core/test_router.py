"""The router (core/routing/router.py): each request classified once, with its reason in words,
and sent to one model — single-model mode being a pool of one."""

from __future__ import annotations

from typing import Any

import pytest

from core import chat as apis
from core.bench.trace import make_trace
from core.routing.router import Decision, Kind, Refused, Router, Target
from core.server.upstream import Upstream

OPENCODE = {"user-agent": "opencode/1.18 ai-sdk/5"}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {}}}]


def chat(content: str = "fix the bug", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


def decide(
    router: Router, body: dict[str, Any], endpoint: str = "chat", **headers: str
) -> Decision:
    decision = router.decide(endpoint, {**OPENCODE, **headers}, body)
    assert isinstance(decision, Decision)
    return decision


def test_an_agent_turn_with_its_reason_session_and_upstream() -> None:
    upstream = Upstream(lambda: "http://x")
    d = decide(Router.single(upstream), chat(tools=TOOLS), **{"x-session-id": "s-1"})
    assert (d.kind, d.kind.label, d.model, d.client) == (Kind.AGENT, "agent", "", "opencode")
    assert d.why == "agent turn: chat request with tools"
    assert d.session == "s-1" and d.upstream is upstream and not d.routed_to_side


def test_a_session_is_derived_from_the_conversation_when_no_header_names_one() -> None:
    body = chat(tools=TOOLS)
    d = decide(Router.single(None), body)
    view = apis.chat_view("chat", body)
    assert view is not None and d.session == view.derived_session("opencode")
    assert d.session.startswith("derived-")


def test_the_aux_header_marks_a_side_call_whatever_the_body() -> None:
    router = Router.single(None)
    for value in ("1", "true", "yes"):
        d = decide(router, chat(tools=TOOLS), **{"x-warmslot-aux": value})
        assert d.kind is Kind.SIDE and d.kind.label == "aux" and "x-warmslot-aux" in d.why
    assert decide(router, chat(tools=TOOLS), **{"x-warmslot-aux": "0"}).kind is Kind.AGENT


def test_an_opencode_title_call_is_a_side_call() -> None:
    title, agent = make_trace(sessions=1, turns=1, scale=0.1)[:2]
    router = Router.single(None)
    d = decide(router, title.body)
    assert d.kind is Kind.SIDE and d.why == "title/summary request shape"
    assert decide(router, agent.body).kind is Kind.AGENT


def test_a_tool_less_call_from_a_client_whose_agent_turns_carry_tools_is_a_side_call() -> None:
    router = Router.single(None)
    assert decide(router, chat("what is 2+2")).kind is Kind.AGENT  # tools never seen yet
    decide(router, chat(tools=TOOLS))
    d = decide(router, chat("what is 2+2"))
    assert d.kind is Kind.SIDE and "carry tools" in d.why
    # another client has its own memory
    other = router.decide("chat", {"user-agent": "aider/0.5"}, chat("what is 2+2"))
    assert isinstance(other, Decision) and other.kind is Kind.AGENT


def test_a_request_that_is_not_chat_is_plain() -> None:
    d = decide(Router.single(None), {"prompt": "Once upon"}, endpoint="completions")
    assert d.kind is Kind.PLAIN and d.kind.label == "agent"
    assert d.why.startswith("completions request")
    assert d.session == ""  # only chat requests get a derived session


def pool_router(strict: bool = False, side_calls: bool = True) -> Router:
    targets = [
        Target("coder", Upstream(lambda: "http://coder"), primary=True),
        Target("chat", Upstream(lambda: "http://chat")),
        Target("titles", Upstream(lambda: "http://titles"), side=True),
    ]
    return Router(lambda: targets, strict=lambda: strict, side_calls=lambda: side_calls)


def test_the_pool_routes_by_the_model_field() -> None:
    router = pool_router()
    d = decide(router, chat(model="chat", tools=TOOLS))
    assert d.model == "chat" and d.upstream is not None and d.upstream.base_url == "http://chat"
    assert decide(router, chat(model="coder", tools=TOOLS)).model == "coder"


def test_a_side_call_to_the_primary_goes_to_the_side_model() -> None:
    router = pool_router()
    title = make_trace(sessions=1, turns=1, scale=0.1)[0].body
    d = decide(router, {**title, "model": "coder"})
    assert d.model == "titles" and d.routed_to_side and d.kind is Kind.SIDE
    assert "sent to the side model 'titles'" in d.why
    # …but not one addressed to another model, nor with side calls off
    assert decide(router, {**title, "model": "chat"}).model == "chat"
    assert decide(pool_router(side_calls=False), {**title, "model": "coder"}).model == "coder"


@pytest.mark.parametrize("strict", [False, True])
def test_an_unknown_model_goes_to_the_primary_or_is_refused_when_strict(strict: bool) -> None:
    router = pool_router(strict=strict)
    d = router.decide("chat", OPENCODE, chat(model="nope", tools=TOOLS))
    if strict:
        assert isinstance(d, Refused) and d.status == 404 and "'nope'" in d.error
    else:
        assert isinstance(d, Decision) and d.model == "coder"


def test_a_decision_is_frozen() -> None:
    d = decide(Router.single(None), chat())
    with pytest.raises(AttributeError):
        d.kind = Kind.SIDE  # type: ignore[misc]
