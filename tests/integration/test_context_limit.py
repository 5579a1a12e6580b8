"""Hitting the slot's context is never silent: a real llama-server with a
small slot refuses a long prompt and cuts an answer short; the response says so in
``X-Warmslot-Warning``/``X-Warmslot-Context``, a ``context_limit`` event is recorded and
the status text has the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.cache.manager import CacheManager, policy_factory
from core.engine import Core
from tests.conftest import MakeCore
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration


def _events(core: Core) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = core.query(
        "recent_events", limit=100, category="cache", kind="context_limit"
    ).result(10)
    return rows


@pytest.mark.timeout(600)
def test_context_hits_are_headers_events_and_status(make_core: MakeCore, tiny_model: Path) -> None:
    core = make_core(server__ctx_per_slot=512, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    words = " ".join(["alpha", "beta", "gamma", "delta"] * 200)  # well over 512 tokens
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 4}
    r = post_chat(core, body, headers={"x-session-id": "s-long"}, expect=400)
    data, headers = r.json(), r.headers
    assert "exceeds the available context size" in data["error"]["message"]
    tokens, _, n_ctx = headers["X-Warmslot-Context"].partition("/")
    assert int(tokens) > 512 and n_ctx == "512", headers
    assert "llama-server refused it" in headers["X-Warmslot-Warning"]
    # An answer that runs into the end of the slot: no max_tokens, a prompt that
    # leaves little room. A random-weight model rarely stops on its own.
    short = " ".join(["alpha", "beta"] * 60)
    body = {"messages": [{"role": "user", "content": short}], "temperature": 0}
    r = post_chat(core, body, headers={"x-session-id": "s-cut"})
    data, headers = r.json(), r.headers
    assert data["choices"][0]["finish_reason"] == "length", data
    assert "answer cut short" in headers["X-Warmslot-Warning"], headers
    wait_until(lambda: len(_events(core)) >= 2, 30, interval=0.1, message="2 context events")
    kinds = sorted(e["details"]["refused"] for e in _events(core))
    assert kinds == [False, True]
    policy = core.policy
    assert isinstance(policy, CacheManager)
    text = core.submit(policy.status()).result(30)["text"]
    assert "requests that hit the slot's context: 2" in text, text
