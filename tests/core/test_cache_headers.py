"""The X-Warmslot-* headers the proxy renders from the cache's plan (core.proxy.headers):
the cache decides (`prepare` returns a `SlotPlan`) and writes no header itself."""

from __future__ import annotations

from core.proxy.headers import Reuse, cache_headers
from core.proxy.types import SlotPlan
from core.routing.router import Kind


def test_the_plan_names_the_kind_the_prefix_what_was_restored_and_the_warning() -> None:
    plan = SlotPlan(
        1,
        "its session's slot",
        "s-1",
        Kind.AGENT,
        prefix_fp="ab" * 32,
        prefix_tokens=1251,
        restored=1251,
        warning="the chat template drops tool 'read' … and the system text",
        conversation="restored 3000 of 3010 tokens (session)",
    )
    out = cache_headers(Reuse(1250, 10), slot=1, session="s-1", plan=plan, ms_per_token=None)
    assert out["X-Warmslot-Kind"] == "agent"
    assert out["X-Warmslot-Prefix"] == "abababababababab:1251"
    assert out["X-Warmslot-Restored"] == "1251"
    assert out["X-Warmslot-Warning"] == (
        "the chat template drops tool 'read' ... and the system text"
    )
    assert out["X-Warmslot-Conversation"] == "restored 3000 of 3010 tokens (session)"
    assert out["X-Warmslot-Slot"] == "1" and out["X-Warmslot-Cache"] == "hit"


def test_a_side_call_without_a_prefix_gets_no_prefix_and_no_warning() -> None:
    plan = SlotPlan(2, "the side-call slot", "s-1", Kind.SIDE)
    out = cache_headers(None, slot=2, session="s-1", plan=plan, ms_per_token=None)
    assert out["X-Warmslot-Kind"] == "aux" and out["X-Warmslot-Restored"] == "0"
    assert not {"X-Warmslot-Prefix", "X-Warmslot-Warning", "X-Warmslot-Conversation"} & set(out)


def test_a_request_the_cache_left_alone_has_no_plan_headers() -> None:
    out = cache_headers(None, slot=None, session="", plan=None, ms_per_token=None)
    assert out == {"X-Warmslot-Cache": "unknown", "X-Warmslot-Restored": "0"}


def test_a_long_warning_is_cut_to_200_ascii_characters() -> None:
    plan = SlotPlan(0, "", "", Kind.AGENT, warning="é" * 300)
    out = cache_headers(None, slot=0, session="", plan=plan, ms_per_token=None)
    assert out["X-Warmslot-Warning"] == "?" * 200
