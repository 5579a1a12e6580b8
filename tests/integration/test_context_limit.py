"""Hitting the slot's context is never silent (issue 16, 0e): a real llama-server with a
small slot refuses a long prompt and cuts an answer short; the response says so in
``X-Warmslot-Warning``/``X-Warmslot-Context``, a ``context_limit`` event is recorded and
the status text has the line."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from core.cache.manager import CacheManager, policy_factory
from core.engine import Core
from tests.conftest import MakeCore
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def _post(
    core: Core, body: dict[str, Any], session: str
) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert core.proxy is not None
    req = urllib.request.Request(
        f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


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
    status, data, headers = _post(
        core, {"messages": [{"role": "user", "content": words}], "max_tokens": 4}, "s-long"
    )
    assert status == 400 and "exceeds the available context size" in data["error"]["message"]
    tokens, _, n_ctx = headers["X-Warmslot-Context"].partition("/")
    assert int(tokens) > 512 and n_ctx == "512", headers
    assert "llama-server refused it" in headers["X-Warmslot-Warning"]
    # An answer that runs into the end of the slot: no max_tokens, a prompt that
    # leaves little room. A random-weight model rarely stops on its own.
    short = " ".join(["alpha", "beta"] * 60)
    status, data, headers = _post(
        core, {"messages": [{"role": "user", "content": short}], "temperature": 0}, "s-cut"
    )
    assert status == 200 and data["choices"][0]["finish_reason"] == "length", data
    assert "answer cut short" in headers["X-Warmslot-Warning"], headers
    wait_until(lambda: len(_events(core)) >= 2, 30, interval=0.1, message="2 context events")
    kinds = sorted(e["details"]["refused"] for e in _events(core))
    assert kinds == [False, True]
    policy = core.policy
    assert isinstance(policy, CacheManager)
    text = core.submit(policy.status()).result(30)["text"]
    assert "requests that hit the slot's context: 2" in text, text
