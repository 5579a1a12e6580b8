"""Warmslot's llama.cpp patches: loading ``patches/*.patch`` and applying them.

Patches (see patches/README.md) are applied in name order to a throw-away copy of the
source with ``git apply``, each checked first so a failure names the patch and the hunk.
A patch's name and exact bytes go into the build id.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import BuildError
from core.paths import resources_dir

__all__ = ["Patch", "PatchFailed", "apply_patches", "default_patches_dir", "load_patches"]


class PatchFailed(BuildError):
    """A patch from patches/ does not apply to the source being built."""

    def __init__(self, message: str, *, patch: str, detail: str, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.patch = patch
        self.detail = detail


@dataclass(frozen=True)
class Patch:
    """One patch file: its name and exact bytes (both go into the build id)."""

    name: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def default_patches_dir() -> Path:
    """The repository's (or bundle's) top-level ``patches/`` folder."""
    return resources_dir().parent / "patches"


def load_patches(patches_dir: Path) -> list[Patch]:
    """``*.patch`` files of `patches_dir` in name order; none if the folder is missing."""
    if not patches_dir.is_dir():
        return []
    return [
        Patch(p.name, p.read_bytes()) for p in sorted(patches_dir.glob("*.patch")) if p.is_file()
    ]


def _hunk_header(patch: bytes, file: str, line: int) -> str | None:
    """The ``@@ … @@`` header of the hunk of `patch` that edits `file` at old line `line`."""
    current = None
    for raw in patch.decode("utf-8", "replace").splitlines():
        if raw.startswith("diff --git "):
            current = None
        elif raw.startswith("--- "):
            current = raw[4:].split("\t")[0].strip()
            current = current[2:] if current.startswith("a/") else current
        elif raw.startswith("+++ ") and (current in (None, "/dev/null")):
            new = raw[4:].split("\t")[0].strip()
            current = new[2:] if new.startswith("b/") else new
        elif raw.startswith("@@") and current == file:
            m = re.match(r"@@ -(\d+)", raw)
            if m and int(m.group(1)) == line:
                return raw.strip()
    return None


def _patch_failure(patch: Patch, output: str) -> PatchFailed:
    errors = [
        ln.removeprefix("error: ").strip() for ln in output.splitlines() if ln.startswith("error:")
    ]
    where = ""
    for e in errors:
        m = re.match(r"patch failed: (.+):(\d+)$", e)
        if m:
            hunk = _hunk_header(patch.data, m.group(1), int(m.group(2)))
            where = f"hunk {hunk} of {m.group(1)}" if hunk else f"{m.group(1)} line {m.group(2)}"
            break
    detail = "; ".join(errors) or output.strip() or "git apply failed"
    msg = f"Patch {patch.name} does not apply"
    msg += f": {where} ({detail})" if where else f": {detail}"
    return PatchFailed(
        msg,
        patch=patch.name,
        detail=detail,
        hint="This llama.cpp revision differs from the one the patch was written for: update "
        "the patch, pick the source it was made for, or build without patches (--no-patches).",
    )


async def apply_patches(
    src_dir: Path, patches: Sequence[Patch], emit: Callable[[str], None] | None = None
) -> None:
    """Apply `patches` in order to `src_dir` (a throw-away copy) with ``git apply -p1``.

    Each patch is checked first (``git apply --check``) so a failure changes nothing and
    names the patch and the failing hunk. `src_dir` need not be a git repository.
    """
    env = dict(os.environ)
    # Stop git from discovering an enclosing repository (the builds dir may sit inside
    # one): then it would apply paths relative to that repo and skip ours silently.
    env["GIT_CEILING_DIRECTORIES"] = str(src_dir.parent)
    for patch in patches:
        for check in (True, False):
            cmd = ["git", "apply", "-p1", "--whitespace=nowarn"]
            cmd += ["--check", "-"] if check else ["-"]
            try:
                proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    cwd=src_dir,
                    env=env,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                )
            except FileNotFoundError as e:
                raise BuildError(
                    "git is needed to apply patches but is not installed",
                    hint="Install git, or build with --no-patches.",
                ) from e
            out, _ = await proc.communicate(patch.data)
            text = out.decode("utf-8", "replace")
            if proc.returncode != 0:
                raise _patch_failure(patch, text)
        if emit:
            emit(f"Applied patch {patch.name} (sha256 {patch.sha256[:12]})")
