"""A real client's second session through Warmslot, with its recorded requests.

Codex CLI's recorded requests (tests/fixtures/clients/codex: OpenAI Responses, 17k
tokens with the tiny model's tokenizer) replayed through a real Core and llama-server:
the first turn of a second session must find the stable prefix that the first session's
slot holds. It went to an empty slot and re-read everything (0 of 17,447 tokens
reused) while the cache manager compared the slot's last chat view with the client's
raw Responses body, which never match (docs/clients.md).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from core.cache.manager import policy_factory
from core.events import RequestCompleted
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.helpers import EventLog, wait_until

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "clients" / "codex" / "requests.json"


def _post(port: int, entry: dict[str, Any]) -> dict[str, str]:
    body = {**entry["body"], "stream": False, "max_output_tokens": 4}
    headers = {k: v for k, v in entry["headers"].items() if k in ("user-agent", "session-id")}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{entry['path']}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status == 200
        resp.read()
        return dict(resp.headers)


def test_a_second_codex_session_starts_on_the_slot_holding_its_prefix(
    make_core: MakeCore,
) -> None:
    entries = json.loads(FIXTURE.read_text())
    first = next(e for e in entries if e["step"] == "s1-turn1")
    second = next(e for e in entries if e["step"] == "s2-turn1")
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    core = make_core(
        policy_factory=policy_factory,
        server__model=str(model),
        server__slots=3,
        server__ctx_per_slot=24576,
    )
    log = EventLog()
    core.subscribe(log.append, (RequestCompleted,))
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None
    h1 = _post(core.proxy.port, first)
    prefix_tokens = int(h1["X-Warmslot-Prefix"].split(":")[1])
    assert prefix_tokens >= 10_000  # Codex's developer text and tools
    h2 = _post(core.proxy.port, second)
    wait_until(lambda: len(log.of(RequestCompleted)) >= 2, 60, message="2 requests recorded")
    done = log.of(RequestCompleted)
    print(
        f"\nstable prefix {prefix_tokens}: "
        + "; ".join(f"slot {r.slot} cache_n {r.cache_n} prompt_n {r.prompt_n}" for r in done)
    )
    assert h1["X-Warmslot-Session"] != h2["X-Warmslot-Session"]
    assert h2["X-Warmslot-Slot"] == h1["X-Warmslot-Slot"]
    assert done[1].cache_n is not None and done[1].cache_n >= 0.9 * prefix_tokens
