"""Warmslot's folders are owner-only and what it creates afterwards is too (core.paths).

The whole picture, every file a real `warmslot serve` run leaves (databases, slot files
llama-server wrote, logs, keys), is tests/integration/test_reliability.py::test_files_*.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.paths import PRIVATE_UMASK, Paths

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX modes")


@pytest.fixture
def umask_restored() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ensure_makes_and_tightens_folders(tmp_path: Path, umask_restored: None) -> None:
    paths = Paths.under(tmp_path / "home")
    paths.state_dir.mkdir(parents=True, mode=0o755)  # as an older version left it
    paths.state_dir.chmod(0o755)
    paths.ensure()
    for d in (
        paths.config_dir,
        paths.data_dir,
        paths.cache_dir,
        paths.state_dir,
        paths.log_dir,
        paths.slot_dir,
    ):
        assert mode(d) == 0o700, d


def test_files_made_after_ensure_are_owner_only(tmp_path: Path, umask_restored: None) -> None:
    paths = Paths.under(tmp_path / "home")
    paths.ensure()
    assert os.umask(PRIVATE_UMASK) == PRIVATE_UMASK  # (reading it sets it back as it was)
    f = paths.state_dir / "made-later.json"
    f.write_text("{}")
    assert mode(f) == 0o600


def test_a_scratch_home_shares_the_users_builds(tmp_path: Path) -> None:
    """A benchmark's throwaway home finds (and keeps) the user's llama-server builds:
    `warmslot bench overhead` built llama-server into a temporary folder on every run."""
    user = Paths.under(tmp_path / "user")
    scratch = user.scratch(tmp_path / "bench")
    assert scratch.builds_dir == user.builds_dir
    assert scratch.state_dir == tmp_path.resolve() / "bench" / "state"
    assert scratch.config_file != user.config_file and scratch.slot_dir != user.slot_dir
