"""`warmslot models` / `models use` / `clients` as real subprocesses over a fake home tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core import config
from core.config import Settings
from core.engine import Core
from core.paths import Paths
from tests.core.test_model_catalog import Tree, build_tree

WARMSLOT = Path(sys.executable).parent / "warmslot"
TOOL_VARS = ("LLAMA_CACHE", "HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS", "XDG_CACHE_HOME")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return build_tree(tmp_path_factory.mktemp("cli-catalog"))


def run(tree: Tree, wshome: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TOOL_VARS}
    env.update(tree.env, HOME=str(tree.home), WARMSLOT_HOME=str(wshome))
    return subprocess.run(
        [str(WARMSLOT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def mine(doc: dict[str, Any], tree: Tree) -> list[dict[str, Any]]:
    """The listed models that belong to the fake tree (a machine-wide Ollama may add more)."""
    base = str(tree.home.parent)
    return [m for m in doc["models"] if m["path"].startswith(base)]


def test_models_json_table_and_use(tree: Tree, tmp_path: Path) -> None:
    wshome = tmp_path / "ws"
    proc = run(tree, wshome, "models", "--json", "--dir", str(tree.extra))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = {m["path"]: m for m in mine(doc, tree)}
    # The tree's "own" model is in another Warmslot's data folder, not this one's.
    assert set(rows) == {str(p) for k, p in tree.paths.items() if k != "own"}
    assert rows[str(tree.paths["ollama"])]["name"] == "tinyllama:2m"
    assert rows[str(tree.paths["swa"])]["kind"] == "sliding-window"
    assert rows[str(tree.paths["swa"])]["needs_patched_server"] is True
    assert "not a readable GGUF" in rows[str(tree.paths["broken"])]["error"]
    assert rows[str(tree.paths["hf"])]["fits"] is True  # a tiny model fits anywhere
    # The fit plan chooses: 3 agent slots + the side slot, each the model's
    # trained context (4,096 for this generated model).
    assert rows[str(tree.paths["hf"])]["fit"].startswith("fits: 4 slots × 4,096 tokens")

    table = run(tree, wshome, "models", "--no-fit", "--dir", str(tree.extra))
    assert table.returncode == 0, table.stderr
    assert "someorg/Tiny-Coder-GGUF/tiny-coder-Q8_0" in table.stdout
    assert "Hugging Face cache" in table.stdout and "error: " in table.stdout

    number = [m["path"] for m in doc["models"]].index(str(tree.paths["hf"])) + 1
    use = run(tree, wshome, "models", "use", str(number), "--dir", str(tree.extra))
    assert use.returncode == 0, use.stderr
    assert "No Warmslot is running" in use.stdout
    cfg = Paths.under(wshome).config_file
    assert config.load(cfg).server.model == str(tree.paths["hf"])

    # The chosen model is marked current; clients get its name.
    again = json.loads(run(tree, wshome, "models", "--json", "--no-fit").stdout)
    assert [m["path"] for m in again["models"] if m["current"]] == [str(tree.paths["hf"])]
    clients = json.loads(run(tree, wshome, "clients", "--json").stdout)
    assert clients["base_url"] == "http://127.0.0.1:8089/v1"
    assert clients["model"] == "tiny-coder-Q8_0"
    assert [c["id"] for c in clients["clients"] if c["works"]] == [
        "opencode",
        "aider",
        "claude-code",
        "codex",  # all four work
    ]

    # A damaged file or a wrong number is refused and the setting stays.
    bad = run(tree, wshome, "models", "use", str(tree.paths["broken"]))
    assert bad.returncode == 1 and "not a readable GGUF" in bad.stderr
    assert run(tree, wshome, "models", "use", "999").returncode == 1
    assert config.load(cfg).server.model == str(tree.paths["hf"])


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Path]:
    """A running Warmslot (proxy only, no llama-server) in its own home."""
    home = tmp_path / "ws-running"
    s = Settings()
    s.proxy.port = 0
    core = Core(Paths.under(home), s)
    core.start(start_server=False)
    try:
        yield home
    finally:
        core.stop()


def test_use_says_a_running_instance_must_restart(tree: Tree, running: Path) -> None:
    proc = run(tree, running, "models", "use", str(tree.paths["ollama"]))
    assert proc.returncode == 0, proc.stderr
    assert f"A running Warmslot (pid {os.getpid()})" in proc.stdout
    assert "restart it to switch" in proc.stdout
    assert config.load(Paths.under(running).config_file).server.model == str(tree.paths["ollama"])
