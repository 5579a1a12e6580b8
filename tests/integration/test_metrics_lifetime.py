"""/metrics on a real Core and llama-server (tiny model): scraped, then the history pruned
through the telemetry prune, scraped again, then Warmslot started again on the same
folder and scraped once more — no counter goes down, and every series has its HELP and
TYPE (read with prometheus_client's own parser). docs/security.md#metrics.

Before, the per-user `_total` counters were a GROUP BY over the kept rows, so the prune
took them away, and the proxy's own totals began again at 0 on every start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core.config.keys import add_key, keys_file
from core.engine import Core
from core.paths import Paths
from tests.conftest import MakeCore
from tests.helpers import post_chat

CHAT = {"messages": [{"role": "user", "content": "count me"}], "max_tokens": 2}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _url(core: Core) -> str:
    assert core.proxy is not None
    return f"http://127.0.0.1:{core.proxy.port}"


def _chat(core: Core, key: str) -> None:
    post_chat(core, CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _scrape(core: Core, key: str) -> tuple[Samples, str]:
    r = httpx.get(_url(core) + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    counters = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(r.text)
        if f.type == "counter"
        for s in f.samples
    }
    return counters, r.text


def _described(text: str) -> list[str]:
    """Series without a HELP or a TYPE line of their own (none expected)."""
    helps = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")}
    types = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")}
    names = {ln.split("{")[0].split()[0] for ln in text.splitlines() if ln and ln[0] != "#"}
    return sorted(n for n in names if n not in helps or n not in types)


def _lower(before: Samples, after: Samples) -> dict[Any, Any]:
    return {k: (v, after.get(k)) for k, v in before.items() if after.get(k, -1.0) < v}


def test_counters_survive_a_prune_and_a_restart(tmp_path: Path, make_core: MakeCore) -> None:
    home = tmp_path / "home"
    paths = Paths.under(home)
    alice = add_key(keys_file(paths.config_file), "alice")
    bob = add_key(keys_file(paths.config_file), "bob")
    core = make_core(home=home)
    core.start(wait_ready=True, timeout=180)
    for key in (alice, alice, bob):
        _chat(core, key)
    one, text = _scrape(core, alice)
    assert _described(text) == []
    assert one[("warmslot_user_requests_total", (("user", "alice"),))] == 2
    assert one[("warmslot_user_requests_total", (("user", "bob"),))] == 1
    assert one[("warmslot_requests_total", ())] == 3
    assert one[("warmslot_prompt_tokens_total", ())] + one[("warmslot_cached_tokens_total", ())] > 0

    # The hourly prune with a retention that keeps nothing: the history is empty.
    assert core.call(lambda: core.telemetry.prune(0) if core.telemetry else 0).result(30) > 0
    assert core.query("per_user").result(30) == []
    two, _ = _scrape(core, alice)
    assert _lower(one, two) == {}
    assert two == one

    # Warmslot starts again on the same folder.
    core.stop()
    again = make_core(home=home)
    again.start(wait_ready=True, timeout=180)
    three, text = _scrape(again, bob)
    assert _described(text) == []
    assert _lower(two, three) == {}
    assert three == two
    _chat(again, bob)
    four, _ = _scrape(again, bob)
    assert _lower(three, four) == {}
    assert four[("warmslot_user_requests_total", (("user", "bob"),))] == 2
    assert four[("warmslot_requests_total", ())] == 4
