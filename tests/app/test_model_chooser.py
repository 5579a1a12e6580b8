"""The model chooser and client setup dialogs, offscreen, over a fake home tree."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from app.backend import CoreBackend
from app.client_setup import ClientSetupDialog
from app.menu import CHOOSE_MODEL, COPY_URL, START, menu_entries
from app.model_chooser import COLUMNS, ModelChooser
from app.qt import QtWidgets
from app.state import AppState, TrayState
from app.tasks import Tasks
from core import config as config_mod
from core.config import Settings
from core.config.keys import add_key, keys_file
from core.engine import Core
from core.models.catalog import Catalog, find_models
from core.server.tinymodel import make_tiny_model
from tests.app.conftest import Launch, prepare
from tests.core.test_model_catalog import BIG_HOST, Tree, build_tree

TOOL_VARS = ("LLAMA_CACHE", "HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS", "XDG_CACHE_HOME")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return build_tree(tmp_path_factory.mktemp("chooser"))


def tree_scan(tree: Tree) -> Any:
    def scan(s: Settings) -> Catalog:
        return find_models(
            home=tree.home, env=tree.env, platform="linux", models_dir=tree.models_dir,
            extra_dirs=[tree.extra], configured=s.server.model, system=False, gpus=[],
            host=BIG_HOST,
        )  # fmt: skip

    return scan


def chooser(qtbot: Any, core: Core, tasks: Tasks, tree: Tree, **kw: Any) -> ModelChooser:
    dlg = ModelChooser(CoreBackend(core), tasks, core.paths, scan=tree_scan(tree), **kw)
    qtbot.addWidget(dlg)
    dlg.show()
    qtbot.waitUntil(lambda: dlg.scans >= 1, timeout=30_000)
    return dlg


def row_of(dlg: ModelChooser, path: Path) -> int:
    return [e.path for e in dlg.entries].index(str(path))


def cell(dlg: ModelChooser, row: int, column: str) -> str:
    item = dlg.table.item(row, COLUMNS.index(column))
    assert item is not None
    return item.text()


def test_the_list_shows_every_model_and_use_saves_server_model(
    qtbot: Any, core: Core, tasks: Tasks, tree: Tree
) -> None:
    dlg = chooser(qtbot, core, tasks, tree)
    assert dlg.table.rowCount() == len(tree.paths) == len(dlg.entries)
    assert dlg.status.text().startswith(f"{len(tree.paths)} models found.")
    swa = row_of(dlg, tree.paths["swa"])
    assert cell(dlg, swa, "Source") == "LM Studio"
    assert cell(dlg, swa, "Architecture") == "gemma3"
    assert cell(dlg, swa, "Context") == "32,768"
    assert cell(dlg, swa, "SWA / hybrid") == "sliding-window"
    assert cell(dlg, swa, "Fits") == "yes"
    ol = row_of(dlg, tree.paths["ollama"])
    assert (cell(dlg, ol, "Name"), cell(dlg, ol, "Source")) == ("tinyllama:2m", "Ollama")
    broken = row_of(dlg, tree.paths["broken"])
    assert cell(dlg, broken, "Fits") == "error"
    dlg.table.selectRow(broken)
    assert not dlg.use_button.isEnabled() and "not a readable GGUF" in dlg.detail.text()

    hf = row_of(dlg, tree.paths["hf"])
    dlg.table.selectRow(hf)
    assert dlg.use_button.isEnabled()
    assert "disk tier" not in dlg.detail.text() and "fits: 4 slots" in dlg.detail.text()
    dlg.use_button.click()
    qtbot.waitUntil(lambda: dlg.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=30_000)
    assert config_mod.load(core.paths.config_file).server.model == str(tree.paths["hf"])
    assert core.settings.server.model == str(tree.paths["hf"])
    assert [e.path for e in dlg.entries if e.current] == [str(tree.paths["hf"])]
    assert cell(dlg, hf, "Name").startswith("● ")


def test_with_llama_server_running_it_offers_the_restart(
    qtbot: Any, core: Core, tasks: Tasks, tree: Tree
) -> None:
    restarts: list[int] = []
    dlg = chooser(
        qtbot, core, tasks, tree, restart=lambda: restarts.append(1), server_running=lambda: True
    )
    dlg.table.selectRow(row_of(dlg, tree.paths["hybrid"]))
    assert "hybrid (disk tier needs the patched server)" in dlg.detail.text()
    dlg.use_selected()
    qtbot.waitUntil(lambda: dlg.restart_box.isVisible(), timeout=30_000)
    assert "keeps serving the old model" in dlg.restart_text.text()
    assert config_mod.load(core.paths.config_file).server.model == str(tree.paths["hybrid"])
    assert dlg.isVisible() and restarts == []
    dlg.restart_now.click()
    assert restarts == [1] and dlg.result() == QtWidgets.QDialog.DialogCode.Accepted


def test_browse_adds_a_chosen_file(
    qtbot: Any, core: Core, tasks: Tasks, tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    dlg = chooser(qtbot, core, tasks, tree)
    chosen = tree.home.parent / "gen" / "tiny-1.gguf"  # a generated file no layout covers
    monkeypatch.setattr(
        QtWidgets.QFileDialog,
        "getOpenFileName",
        lambda *a, **k: (str(chosen), "GGUF models (*.gguf)"),
    )
    dlg.browse_button.click()
    qtbot.waitUntil(lambda: str(chosen) in [e.path for e in dlg.entries], timeout=30_000)
    selected = dlg.selected()
    assert selected is not None and selected.path == str(chosen)
    assert (selected.source_label, selected.architecture, selected.error) == (
        "chosen file", "llama", ""
    )  # fmt: skip
    assert dlg.use_button.isEnabled()


def test_client_setup_dialog_shows_snippets_with_the_url(qtbot: Any) -> None:
    s = Settings()
    s.server.model = "/m/qwen3-coder.gguf"
    dlg = ClientSetupDialog("http://127.0.0.1:18123", s)
    qtbot.addWidget(dlg)
    assert dlg.url == "http://127.0.0.1:18123/v1"
    assert dlg.tabs.count() == 4
    titles = [dlg.tabs.tabText(i) for i in range(4)]
    assert titles == ["opencode", "aider", "Claude Code", "Codex CLI"]  # all four work
    oc = json.loads(dlg.snippets["opencode"].toPlainText())
    assert oc["provider"]["warmslot"]["options"]["baseURL"] == dlg.url
    assert "aider --model openai/qwen3-coder" in dlg.snippets["aider"].toPlainText()
    dlg.copy_buttons["codex"].click()
    assert 'base_url = "http://127.0.0.1:18123/v1"' in QtWidgets.QApplication.clipboard().text()
    # Each setting with its reason, from the same declaration (core/clients.py); the agents
    # wait as long as Warmslot does (proxy.upstream_timeout_s).
    assert "CLAUDE_STREAM_IDLE_TIMEOUT_MS" in dlg.reasons["claude-code"].text()
    assert "stream_idle_timeout_ms = 600000" in dlg.snippets["codex"].toPlainText()
    s.proxy.upstream_timeout_s = 1800
    slow = ClientSetupDialog("http://127.0.0.1:18123", s)
    qtbot.addWidget(slow)
    assert "API_TIMEOUT_MS=1800000" in slow.snippets["claude-code"].toPlainText()
    # The slot's context (core.clients.slot_context): each agent compacts before it is full.
    sized = ClientSetupDialog("http://127.0.0.1:18123", s, context=65536)
    qtbot.addWidget(sized)
    assert "model_context_window = 65536" in sized.snippets["codex"].toPlainText()
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" in sized.reasons["claude-code"].text()
    # Not running yet: the configured address.
    s.proxy.port = 18999
    later = ClientSetupDialog("", s)
    qtbot.addWidget(later)
    assert later.url == "http://127.0.0.1:18999/v1"


def test_menu_copy_url_entry_follows_the_proxy_url() -> None:
    on = {
        e.id: e
        for e in menu_entries(AppState(tray=TrayState.STOPPED, proxy_url="http://127.0.0.1:8089"))
    }
    assert on[COPY_URL].enabled and "http://127.0.0.1:8089/v1" in on[COPY_URL].tooltip
    off = {e.id: e for e in menu_entries(AppState(tray=TrayState.STOPPED))}
    assert not off[COPY_URL].enabled


def test_tray_handlers_and_the_overview_button(
    qtbot: Any, tmp_path: Path, start_app: Launch, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in TOOL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "empty-home"))  # scan nothing of the real user
    prepare(tmp_path)
    app = start_app(tmp_path, tray_available=False)
    qtbot.waitUntil(lambda: bool(app.controller.state.proxy_url), timeout=30_000)
    url = app.copy_client_url()
    assert url == app.controller.state.proxy_url + "/v1"
    assert QtWidgets.QApplication.clipboard().text() == url
    setup = app.open_client_setup()
    unkeyed = setup.snippets["opencode"].toPlainText()
    assert setup.url == url and url in unkeyed
    setup.close()
    assert app.dashboard is not None
    app.dashboard.page("overview").model_button.click()
    dlg = app.model_chooser
    assert dlg is not None and dlg.isVisible()
    qtbot.waitUntil(lambda: dlg.scans >= 1, timeout=30_000)
    assert os.fspath(app.paths.models_dir) in [str(r.path) for r in dlg_roots(dlg)]
    dlg.close()
    qtbot.waitUntil(lambda: app.model_chooser is None, timeout=10_000)

    # A named key only (no proxy.api_key): the snippets read the key from the environment.
    assert "WARMSLOT_API_KEY" not in unkeyed
    qtbot.waitUntil(lambda: app.client_setup is None, timeout=10_000)
    add_key(keys_file(app.paths.config_file), "alice")
    keyed = app.open_client_setup()
    assert "WARMSLOT_API_KEY" in keyed.snippets["opencode"].toPlainText()
    keyed.close()


def dlg_roots(dlg: ModelChooser) -> list[Any]:
    """The places the chooser's last scan looked in (from its status line's catalog)."""
    return list(dlg.last_catalog.roots) if dlg.last_catalog is not None else []


@pytest.mark.integration
def test_choosing_a_model_and_restarting_serves_it(
    qtbot: Any,
    tmp_path: Path,
    start_app: Launch,
    server_binary: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end with a real llama-server: the chooser lists a model from
    server.model_dirs, Use this model + Restart llama-server now loads it."""
    for var in TOOL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "empty-home"))
    first = make_tiny_model(tmp_path / "first.gguf", seed=11)
    library = tmp_path / "library"
    second = make_tiny_model(library / "coder" / "second.gguf", seed=12)
    home = tmp_path / "home"
    levels = ("ram_low", "ram_critical", "vram_low", "vram_critical", "disk_low", "disk_critical")
    calm = {f"pressure.{k}_pct": 0.0 for k in levels}  # a busy machine must not degrade it
    prepare(
        home,
        **{
            "server.model": str(first),
            "server.binary": str(server_binary),
            "server.threads": 2,
            "server.ctx_per_slot": 4096,
            "server.model_dirs": [str(library)],
            **calm,
        },
    )
    app = start_app(home, tray_available=False)
    app.handlers[START]()
    qtbot.waitUntil(lambda: app.controller.state.server_state == "ready", timeout=120_000)
    assert app.controller.state.model == "first.gguf"

    app.handlers[CHOOSE_MODEL]()
    dlg = app.model_chooser
    assert dlg is not None
    qtbot.waitUntil(lambda: dlg.scans >= 1, timeout=60_000)
    listed = {e.path: e for e in dlg.entries}
    assert listed[str(first)].current and listed[str(first)].source == "configured"
    entry = listed[str(second)]
    assert (entry.name, entry.source_label, entry.fits) == ("coder/second", "added folder", True)
    assert dlg.select_path(str(second))
    dlg.use_button.click()
    qtbot.waitUntil(lambda: dlg.restart_box.isVisible(), timeout=30_000)
    assert config_mod.load(app.paths.config_file).server.model == str(second)
    dlg.restart_now.click()

    def serves_second() -> bool:
        st = app.controller.status or {}
        path = ((st.get("server") or {}).get("model") or {}).get("path")
        return path == str(second) and (st.get("server") or {}).get("state") == "ready"

    qtbot.waitUntil(serves_second, timeout=120_000)
    assert app.controller.state.model == "second.gguf"
