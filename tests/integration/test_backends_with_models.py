"""``[[backends]]`` beside ``[[models]]`` (docs/scale.md#several-backends): one server set.

Real llama-servers behind one Core with the cache manager on: the pool's primary model
('coder', the tiny model) on two backends ('main', the core's own server, and 'b1', a
second llama-server launched with the same settings), and a second pooled model
('helper', another tiny model) loaded when a request names it. Requests for the primary
model are spread over its two backends by session and stable prefix; a request for the
other model goes to its own server and names no backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from httpx import Headers

from core.cache.manager import policy_factory
from core.config import BackendSettings, ModelProfile
from core.engine import Core
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore, settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import post_chat, session_headers, wait_until

pytestmark = pytest.mark.integration

HEAD = "You are a careful assistant for project {}. " + "Follow the house rules. " * 20


def _ask(core: Core, model: str, session: str, project: str) -> Headers:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": HEAD.format(project)},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    reply = post_chat(core, body, headers=session_headers(session), timeout=300)
    return reply.headers


def _backends(core: Core) -> dict[str, Any]:
    st = core.server_status().result(30)
    return {r["name"]: r for r in st["backends"]["backends"]}


def test_backends_and_models_together_reach_every_server(make_core: MakeCore) -> None:
    coder = make_tiny_model(cache_dir() / "tiny.gguf")
    helper = make_tiny_model(cache_dir() / "tiny-seed7.gguf", seed=7)
    settings = settings_for(Path(coder), server__slots=2)
    settings.models = [
        ModelProfile(name="coder", role="text", footprint_mib=64),
        ModelProfile(name="helper", model=str(helper), role="text", footprint_mib=64),
    ]
    settings.backends = [BackendSettings(name="b1")]
    core = make_core(settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    wait_until(lambda: all(r["ready"] for r in _backends(core).values()), 300)

    # The primary model, two projects: one backend each (a new prefix goes where least is).
    one = _ask(core, "coder", "s-one", "one")
    two = _ask(core, "coder", "s-two", "two")
    assert one["X-Warmslot-Model"] == "coder" and two["X-Warmslot-Model"] == "coder"
    assert {one["X-Warmslot-Backend"], two["X-Warmslot-Backend"]} == {"main", "b1"}
    again = _ask(core, "coder", "s-two", "two")  # a session sticks to its backend
    assert again["X-Warmslot-Backend"] == two["X-Warmslot-Backend"]

    # The other model: loaded for the request, on its own server, no backend named.
    other = _ask(core, "helper", "s-helper", "one")
    assert other["X-Warmslot-Model"] == "helper" and "X-Warmslot-Backend" not in other

    st = core.server_status().result(30)
    rows = {r["name"]: r for r in st["backends"]["backends"]}
    assert rows["main"]["calls"]["agent"] + rows["b1"]["calls"]["agent"] == 3
    assert rows["main"]["calls"]["agent"] >= 1 and rows["b1"]["calls"]["agent"] >= 1
    models = {m["name"]: m for m in st["models"]}
    assert models["helper"]["state"] == "ready" and models["helper"]["calls"]["agent"] == 1
    ports = {rows["main"]["port"], rows["b1"]["port"], models["helper"]["port"]}
    assert None not in ports and len(ports) == 3, ports  # three servers, one each
    assert core.servers is not None
    assert len(core.servers.pids()) == 3
    # Each llama-server has its own cache manager, the primary's first.
    assert [m.model for m in core.cache_managers()] == ["", "backend b1", "helper"]
