"""The request path's work budget (docs/benchmarks.md#request-budget): at
steady state — a known session whose slot holds its prefix — a managed request costs
llama-server one call, its own generation, and nothing runs in its wake either.

Counted on the real server: every request Warmslot sends over the upstream session
(`Upstream.calls`, by path), from before a request until the cache manager is idle
after it, over an opencode-shaped trace of 3 sessions × (a title call + 5 agent turns).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from core.bench.trace import make_trace
from core.cache.manager import policy_factory
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore, settings_for, test_cache
from tests.helpers import cache_idle, post_chat, wait_until


def test_a_steady_state_request_costs_the_server_one_call(
    make_core: MakeCore, tmp_path: Path
) -> None:
    model = make_tiny_model(test_cache() / "tiny-32k.gguf", n_ctx=32768)
    settings = settings_for(model, server__slots=4, server__ctx_per_slot=8192)
    core = make_core(settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None and core.upstream is not None
    calls = core.upstream.calls
    wait_until(lambda: cache_idle(core), 120, message="the cache settled after the start")
    rows: list[tuple[str, int, dict[str, Any], Counter[str]]] = []
    for tr in make_trace(sessions=3, turns=5, scale=0.15, restart_before_session=None):
        before = Counter(calls)
        headers = post_chat(core, tr.body, headers=tr.headers, timeout=300).headers
        wait_until(lambda: cache_idle(core), 120, message="the cache settled after a request")
        rows.append((tr.kind, tr.turn, headers, Counter(calls) - before))
    for kind, turn, headers, spent in rows:
        print(kind, turn, headers.get("X-Warmslot-Cache"), dict(spent))
    steady = [(h, spent) for kind, turn, h, spent in rows if kind == "agent" and turn >= 2]
    assert len(steady) == 12
    for headers, spent in steady:
        assert headers["X-Warmslot-Cache"] == "hit", headers
        assert spent == Counter({"/v1/chat/completions": 1}), spent
    # The work that remains is the first turn of each session: learning its prefix from
    # the server's rendering (and, for a new prefix, saving it to disk).
    first = [spent for kind, turn, _, spent in rows if kind == "agent" and turn == 1]
    assert all(spent["/apply-template"] >= 1 for spent in first)
