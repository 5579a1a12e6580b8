"""The typed status (core.status) describes what a real core sends: `Core.status()` and
`/warmslot/status` have every declared key, no undeclared one, each value of its type,
and `warmslot status` reads the endpoint's JSON back through the same types."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from core.bench.trace import make_trace
from core.cache.manager import policy_factory
from core.cli.main import format_status
from core.engine import Core
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from core.status import Status, cache_of, from_json
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.fixtures.status_shapes import shape_errors
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration


def _saved(core: Core) -> bool:
    cache = cache_of(core.server_status().result(30))
    return cache is not None and bool(cache["saved"]) and not cache["warming"]


def test_a_real_cores_status_has_the_declared_shape(tmp_path: Path) -> None:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    settings = settings_for(model, server__ctx_per_slot=24576, server__cache_ram_mib=512)
    core = Core(Paths.under(tmp_path / "h"), settings, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    try:
        # An opencode-shaped session: a learned prefix, saved to disk, rows in every table.
        trace = make_trace(sessions=1, turns=2, scale=0.3, restart_before_session=None)
        for turn in trace[:3]:
            post_chat(core, turn.body, headers=turn.headers)
        wait_until(lambda: _saved(core), 120, message="a prefix saved to disk")
        status = core.status().result(30)
        assert shape_errors(status, Status) == []
        cache = cache_of(status)
        assert cache is not None and cache["slots"] and cache["prefixes"] and cache["saved"]
        assert status["totals"] is not None and status["totals"]["requests"] >= 3
        assert status["clients"] and status["sessions"] and status["recent_requests"]
        # The cheap poll the tray uses: the same shape, without history.
        cheap = core.server_status().result(30)
        assert shape_errors(cheap, Status) == [] and cheap["totals"] is None
        # What `warmslot status` reads: the endpoint's JSON, through the same types.
        assert core.proxy is not None
        url = f"http://127.0.0.1:{core.proxy.port}/warmslot/status"
        with urllib.request.urlopen(url, timeout=30) as resp:
            sent = from_json(resp.read())
        assert shape_errors(sent, Status) == []
        assert set(sent) == set(status)  # the keys the endpoint always had, kept
        text = format_status(sent)
        assert "llama-server: ready" in text and cache["saved"][0]["file"] in text
    finally:
        core.stop()


def test_the_checker_finds_a_missing_an_undeclared_and_a_mistyped_key() -> None:
    """The shape check above could fail: it names each kind of difference."""
    from tests.fixtures.status_shapes import blank_status

    st: Any = blank_status()
    assert shape_errors(st, Status) == []
    del st["server"]["restarts"]
    st["cache"]["surprise"] = 1
    st["warmslot"]["pid"] = "1"
    errors = shape_errors(st, Status)
    assert "status.server.restarts: missing (ServerStatus)" in errors
    assert any(e.startswith("status.cache") and "surprise" in e for e in errors)
    assert "status.warmslot.pid: '1' is not a int" in errors
    with pytest.raises(ValueError):
        from_json(b'{"running": false}')
    assert from_json(json.dumps(blank_status()))["server"]["state"] == "ready"
