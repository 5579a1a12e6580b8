"""When the cache reads a stable prefix alone before its request, and how that reading is
counted (core.cache.boundary; the real-server test is
tests/integration/test_boundary_checkpoint.py)."""

from __future__ import annotations

from core.cache.boundary import needs_mark, same_conversation
from core.cache.slots import SlotState
from core.proxy.headers import Reuse
from core.server.client import Timings

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TOOLS = [{"type": "function", "function": {"name": "read"}}]


def _chat(*users: str) -> dict[str, object]:
    messages: list[dict[str, str]] = [SYSTEM]
    for i, text in enumerate(users):
        if i:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": text})
    return {"messages": messages, "tools": TOOLS}


def _slot(**fields: object) -> SlotState:
    st = SlotState(0)
    for k, v in fields.items():
        setattr(st, k, v)
    return st


def test_a_request_of_the_same_conversation_opens_like_it() -> None:
    assert same_conversation(_chat("a"), _chat("a", "b"))
    assert same_conversation(_chat("a", "b"), _chat("a"))  # rewound or rewritten later on
    assert same_conversation(_chat("a", "b"), _chat("a", "c"))
    assert not same_conversation(_chat("a"), _chat("x", "b"))  # another conversation
    assert not same_conversation({**_chat("a"), "tools": []}, _chat("a", "b"))  # other tools
    assert not same_conversation(None, _chat("a"))
    assert not same_conversation({"messages": [SYSTEM]}, {"messages": [SYSTEM]})  # no opening


def test_the_prefix_is_read_alone_into_an_empty_slot_or_over_another_session() -> None:
    chat = _chat("new task")
    assert needs_mark(_slot(), "fp", 1000, chat, "s2")
    other = _slot(tokens_hint=3000, prefix_fp="fp", session_of_last="s1", last_body=_chat("a"))
    assert needs_mark(other, "fp", 1000, chat, "s2")


def test_never_over_the_slots_own_conversation_or_a_busy_slot() -> None:
    held = _chat("a")
    same = _slot(tokens_hint=3000, prefix_fp="fp", session_of_last="s1", last_body=held)
    assert not needs_mark(same, "fp", 1000, _chat("a", "b"), "s1")
    # The same conversation under another session id (a resumed session), even with a
    # later message rewritten: the server goes back to its own best checkpoint.
    assert not needs_mark(same, "fp", 1000, _chat("a", "b"), "s9")
    two = _slot(tokens_hint=3000, prefix_fp="fp", session_of_last="s1", last_body=_chat("a", "b"))
    assert not needs_mark(two, "fp", 1000, _chat("a", "c"), "s9")
    # A client without sessions whose conversation goes on.
    assert not needs_mark(_slot(tokens_hint=3000, last_body=held), "fp", 1000, _chat("a", "b"), "")
    assert not needs_mark(_slot(inflight=1), "fp", 1000, _chat("a"), "s2")


def test_not_when_the_slot_holds_exactly_the_prefix() -> None:
    # Re-warmed or restored: the server's checkpoints for its end came with it.
    assert not needs_mark(_slot(tokens_hint=1000, prefix_fp="fp"), "fp", 1000, _chat("x"), "s2")
    assert needs_mark(_slot(tokens_hint=1000, prefix_fp="other"), "fp", 1000, _chat("x"), "s2")


def test_the_prefix_read_before_a_request_counts_as_its_prefill() -> None:
    # Cold: the split read all 1,000 prefix tokens; the request then "reused" them.
    before = Timings(cache_n=0, prompt_n=1000, prompt_ms=2000.0, predicted_n=0, predicted_ms=0.0)
    after = Timings(cache_n=1000, prompt_n=300, prompt_ms=600.0, predicted_n=4, predicted_ms=80.0)
    t = after.with_split(before)
    assert (t.cache_n, t.prompt_n, t.prompt_ms) == (0, 1300, 2600.0)
    assert (t.predicted_n, t.predicted_ms) == (4, 80.0)
    assert after.with_split(None) is after
    # A rewind: the split reused 900 and read 100 of the prefix.
    rewound = Timings(cache_n=900, prompt_n=100, prompt_ms=200.0, predicted_n=0, predicted_ms=0.0)
    assert after.with_split(rewound).cache_n == 900
    r = Reuse(1000, 300, 600.0).with_split(100, 200.0)
    assert (r.cached, r.prefilled, r.prompt_ms, r.verdict) == (900, 400, 800.0, "partial")
    assert Reuse(1000, 300).with_split(1000, 5.0).verdict == "miss"
