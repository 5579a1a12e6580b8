"""The Cache view lists saved conversations and pins / evicts them (docs/cache.md).

A real Core (tiny model, real llama-server, real SQLite index) serves two sessions whose
conversations are saved; the Cache view, over the core's public API (`CoreBackend`:
commands → futures), shows one row per saved conversation with its client, session,
tokens, size, age and expiry, and its Pin and Evict buttons change the core's index.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.backend import CoreBackend
from app.bridge import Bridge
from app.dashboard import ViewContext
from app.dashboard.base import cell_texts
from app.dashboard.cache import CacheTab
from app.qt import Qt
from core.cache.manager import policy_factory
from core.engine import Core
from core.paths import Paths
from tests.conftest import settings_for
from tests.helpers import cache_idle, post_chat, wait_until

pytestmark = pytest.mark.timeout(600)

SYSTEM = "You are a careful coding assistant. Project notes follow.\n" + " ".join(
    ["alpha", "beta", "gamma", "delta", "kernel"][i % 5] for i in range(300)
)


@pytest.fixture
def live_core(tmp_path: Path, tiny_model: Path, server_binary: Path) -> Iterator[Core]:
    # Save a conversation once it holds 64 tokens beyond its prefix (every turn here).
    s = settings_for(tiny_model, cache__conversation_save_tokens=64)
    core = Core(Paths.under(tmp_path / "home"), s, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    yield core
    core.stop()


def _chat(core: Core, session: str, client: str, messages: list[dict[str, str]]) -> str:
    body = {"model": "t", "max_tokens": 3, "temperature": 0, "messages": messages}
    headers = {"x-session-id": session, "User-Agent": client}
    data = post_chat(core, body, headers=headers, timeout=300).json()
    return str(data["choices"][0]["message"]["content"])


def _conversations(core: Core) -> list[dict[str, Any]]:
    cache = core.server_status().result(30)["cache"]
    return [s for s in cache["saved"] if s["kind"] == "conversation"]


def _refreshed(qtbot: Any, tab: CacheTab) -> None:
    before = tab.refresh_count
    tab.refresh()
    qtbot.waitUntil(lambda: tab.refresh_count > before and not tab.busy, timeout=30_000)
    assert not tab.last_errors, tab.last_errors


def test_cache_view_lists_conversations_and_pins_and_evicts_them(
    qtbot: Any, live_core: Core, tasks: Any
) -> None:
    core = live_core
    for session, client, words in (("ses-one", "test-agent", 120), ("ses-two", "test-agent", 160)):
        # Two turns: the second finds its prefix on disk and the slot free to save.
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(2):
            text = f"turn {turn}: " + " ".join(["tool", "output"] * words)
            messages.append({"role": "user", "content": text})
            answer = _chat(core, session, client, messages)
            messages.append({"role": "assistant", "content": answer})
        wait_until(
            lambda s=session: any(c["session"] == s for c in _conversations(core)),
            120,
            interval=0.2,
            message=f"a saved conversation of {session}",
        )
    # Every save done: a later one of the same session would change the rows under test.
    wait_until(lambda: cache_idle(core), 120, message="the cache settled")
    saved = {c["session"]: c for c in _conversations(core)}
    assert set(saved) == {"ses-one", "ses-two"}

    ctx = ViewContext(backend=CoreBackend(core), tasks=tasks, bridge=Bridge(), clock=time.time)
    tab = CacheTab(ctx)
    qtbot.addWidget(tab)
    _refreshed(qtbot, tab)
    rows = {r[1]: r for r in cell_texts(tab.conversations)}
    assert set(rows) == {"ses-one", "ses-two"}
    for session, row in rows.items():
        state = saved[session]
        client, _, tokens, size, age, _, expires, pinned, current, file = row
        assert client == (state["client"] or "—")
        assert tokens == str(state["tokens"]) and int(tokens) > 300
        assert size.endswith(("KB", "MB", "kB", "KiB", "MiB")), size
        assert age.endswith("ago") or age == "just now", age
        # The "long" TTL class (60 min by default), counted from its last use.
        assert state["ttl_class"] == "long" and expires.startswith("in "), expires
        assert (pinned, current, file) == ("no", "yes", state["file"])
    # Conversations are listed apart from the prefix states.
    assert not {r[0] for r in cell_texts(tab.saved)} & {c["file"] for c in saved.values()}

    assert not tab.conversation_pin_button.isEnabled()  # nothing selected yet
    order = [r[1] for r in cell_texts(tab.conversations)]
    tab.conversations.selectRow(order.index("ses-one"))
    assert tab.conversation_pin_button.text() == "Pin"
    qtbot.mouseClick(tab.conversation_pin_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "done" in tab.action_label.text() and not tab.busy, timeout=30_000)
    pinned_state = {c["session"]: c for c in _conversations(core)}["ses-one"]
    assert pinned_state["pinned"] and pinned_state["expires_in_s"] is None  # never expires
    _refreshed(qtbot, tab)
    row = {r[1]: r for r in cell_texts(tab.conversations)}["ses-one"]
    assert (row[6], row[7]) == ("never (pinned)", "yes")

    order = [r[1] for r in cell_texts(tab.conversations)]
    tab.conversations.selectRow(order.index("ses-two"))
    qtbot.mouseClick(tab.conversation_evict_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(
        lambda: [r[1] for r in cell_texts(tab.conversations)] == ["ses-one"], timeout=30_000
    )
    gone = saved["ses-two"]["file"]
    assert gone not in {c["file"] for c in _conversations(core)}
    evicted = core.query("recent_events", limit=50, category="cache", kind="evicted").result(10)
    assert any(e["details"].get("file") == gone and e["details"]["rule"] == "user" for e in evicted)
