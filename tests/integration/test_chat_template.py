"""Chat template integrity: tools must reach the prompt; template changes re-key prefixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.bench.trace import make_trace
from core.cache.manager import CacheManager, policy_factory
from core.engine import Core
from core.paths import Paths
from core.server.tinymodel import CHAT_TEMPLATE, make_tiny_model
from tests.conftest import settings_for
from tests.helpers import post_chat, wait_until

pytestmark = pytest.mark.integration


def _agent_request() -> tuple[dict[str, Any], dict[str, str]]:
    r = make_trace(sessions=1, turns=1, scale=0.1)[1]
    return r.body, r.headers


def _gemma_core(tmp_path: Path, gemma_model: Path, *, demo: bool) -> Core:
    paths = Paths.under(tmp_path / ("demo" if demo else "plain"))
    if demo:  # the demo model, already assembled: link it where Warmslot keeps it
        paths.models_dir.mkdir(parents=True)
        (paths.models_dir / gemma_model.name).symlink_to(gemma_model)
    s = settings_for(
        gemma_model, server__model="" if demo else str(gemma_model), server__ctx_per_slot=8192
    )
    return Core(paths, s, policy_factory=policy_factory)


def test_demo_model_renders_tools(tmp_path: Path, gemma_model: Path) -> None:
    core = _gemma_core(tmp_path, gemma_model, demo=True)
    core.start(wait_ready=True, timeout=180)
    try:
        body, headers = _agent_request()
        rendered = post_chat(
            core, {"messages": body["messages"], "tools": body["tools"]}, path="/apply-template"
        ).json()
        for tool in body["tools"]:
            assert tool["function"]["name"] in rendered["prompt"]
        resp_headers = post_chat(core, {**body, "max_tokens": 2}, headers=headers).headers
        assert "X-Warmslot-Warning" not in resp_headers
        assert "--chat-template-file" in core.supervisor.argv  # type: ignore[union-attr]
    finally:
        core.stop()


def test_template_that_drops_tools_is_reported(tmp_path: Path, gemma_model: Path) -> None:
    # The same GGUF configured by path gets no template from us: the server falls
    # back to a generic one that silently drops every tool.
    core = _gemma_core(tmp_path, gemma_model, demo=False)
    core.start(wait_ready=True, timeout=180)
    try:
        body, headers = _agent_request()
        resp_headers = post_chat(core, {**body, "max_tokens": 2}, headers=headers).headers
        assert "dropped tool" in resp_headers.get("X-Warmslot-Warning", "")
        status = core.status().result(10)
        assert "tool bash" in status["cache"]["template_warning"]
        assert "WARNING" in status["cache"]["text"]
        from core.cache.inventory import doctor_lines

        assert "✘" in doctor_lines(status)[0]
        notices = core.query("recent_events", category="notice").result(10)
        assert any("dropped" in n["reason"] for n in notices)
    finally:
        core.stop()


def test_changing_the_template_rebuilds_prefixes_once(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny.gguf", n_ctx=16384)
    home = tmp_path / "home"
    template_a = tmp_path / "a.jinja"
    template_a.write_text(CHAT_TEMPLATE)
    template_b = tmp_path / "b.jinja"
    template_b.write_text("{#- variant B -#}\n" + CHAT_TEMPLATE.replace("# Tools", "## Tools"))
    trace = make_trace(sessions=2, turns=1, scale=0.2, restart_before_session=None)

    def run(template: Path) -> tuple[set[str], list[dict[str, Any]]]:
        s = settings_for(
            model, server__ctx_per_slot=12288, server__chat_template_file=str(template)
        )
        core = Core(Paths.under(home), s, policy_factory=policy_factory)
        core.start(wait_ready=True, timeout=120)
        try:
            mgr = core.policy
            assert isinstance(mgr, CacheManager)
            wait_until(lambda: core.call(mgr.idle).result(5), 60, message="warm-up")
            for r in trace:
                post_chat(core, r.body, headers=r.headers)
            wait_until(lambda: core.call(mgr.idle).result(5), 120, message="persist")
            fps = core.call(lambda: {p.fingerprint for p in mgr.state.by_fp.values()}).result(5)
            events = core.query("recent_events", limit=200, category="cache").result(10)
            return fps, events
        finally:
            core.stop()

    fps_a, events_a = run(template_a)
    assert any(e["kind"] == "save" for e in events_a)
    fps_b, events_b = run(template_b)
    new_events = [e for e in events_b if e["id"] > max(x["id"] for x in events_a)]
    kinds = [e["kind"] for e in new_events]
    assert fps_a.isdisjoint(fps_b - fps_a) and fps_b - fps_a, "new template, new fingerprints"
    assert "restore_ok" not in kinds, "a state built with the old template was restored"
    # Prefix states (conversation states are saved too, under their own fingerprints).
    saves = [
        e for e in new_events if e["kind"] == "save" and e["details"].get("state") != "conversation"
    ]
    assert saves and all(e["fingerprint"] in {f[:16] for f in fps_b - fps_a} for e in saves)
    assert len({e["fingerprint"] for e in saves}) == len(saves), "each prefix rebuilt once"
