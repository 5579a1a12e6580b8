"""git for build sources: reading a checkout (commit, local changes, build number) and
exporting a commit's or a work tree's files. git never prompts (a build runs in the
background)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from core.build.source_tree import copy_file, sha256_file
from core.errors import BuildError


def _git_env() -> dict[str, str]:
    env = dict(os.environ)
    # Never block on a credentials prompt: a build runs in the background.
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.setdefault("GIT_ASKPASS", "true")
    return env


def git(*args: str | Path, cwd: Path | None = None, check: bool = True) -> str:
    """Run git; its stdout ("" on failure without `check`). BuildError when git is missing
    or, with `check`, fails."""
    cmd = ["git", *(str(a) for a in args)]
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            env=_git_env(),
            capture_output=True,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as e:
        raise BuildError(
            "git is not installed", hint="Install git, or use an archive source."
        ) from e
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise BuildError(
            f"git {' '.join(cmd[1:3])} failed: {msg[-1] if msg else proc.returncode}",
            hint="Check the URL/ref and your network connection.",
        )
    return proc.stdout if proc.returncode == 0 else ""


def git_toplevel(path: Path) -> Path | None:
    """`path` if it is the top of a git work tree, else None (also when git is missing)."""
    if not (path / ".git").exists():
        return None
    try:
        top = git("rev-parse", "--show-toplevel", cwd=path, check=False).strip()
    except BuildError:
        return None
    return path if top and Path(top).resolve() == path.resolve() else None


def git_build_number(repo: Path, commit: str) -> int | None:
    """llama.cpp's build number of `commit` (its commit count), None in a shallow clone."""
    # Upstream's build number is the commit count (cmake/build-info.cmake); a shallow
    # history would give a wrong count, so then only a tag name can tell.
    if git("rev-parse", "--is-shallow-repository", cwd=repo, check=False).strip() == "true":
        return None
    count = git("rev-list", "--count", commit, cwd=repo, check=False).strip()
    return int(count) if count.isdigit() else None


def git_archive_export(repo: Path, commit: str, dest: Path) -> None:
    """Write the tree of `commit` to `dest` (git archive)."""
    dest.mkdir(parents=True)
    # stderr to a file: a pipe nobody reads while the tar streams could fill up and block.
    with (
        tempfile.TemporaryFile() as errf,
        subprocess.Popen(
            ["git", "archive", "--format=tar", commit],
            cwd=repo,
            env=_git_env(),
            stdout=subprocess.PIPE,
            stderr=errf,
            stdin=subprocess.DEVNULL,
        ) as proc,
    ):
        assert proc.stdout is not None
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
                tf.extractall(dest, filter="data")
        except tarfile.TarError as e:
            proc.kill()
            tar_error: str | None = str(e)
        else:
            tar_error = None
        rc = proc.wait()
        errf.seek(0)
        err = errf.read().decode("utf-8", "replace").strip()
    if rc != 0 or tar_error:
        raise BuildError(f"git archive {commit[:12]} failed: {err or tar_error}")


def dirty_hash(repo: Path) -> str | None:
    """Hash of uncommitted changes (paths + current contents), None for a clean tree."""
    out = git("status", "--porcelain=v1", "-z", "--untracked-files=all", cwd=repo)
    fields = out.split("\0")
    paths: list[str] = []
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":
            i += 1  # the rename/copy origin follows as its own field
    if not paths:
        return None
    h = hashlib.sha256()
    for rel in sorted(set(paths)):
        p = repo / rel
        digest = sha256_file(p) if p.is_file() else "-"
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def copy_git_worktree(repo: Path, dest: Path) -> None:
    """Copy a work tree's files as the user sees them to `dest`."""
    # Tracked plus untracked-but-not-ignored files: the tree as the user sees it,
    # without their build directories or other ignored output.
    out = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=repo)
    dest.mkdir(parents=True)
    for rel in sorted(set(filter(None, out.split("\0")))):
        src = repo / rel
        if src.is_symlink() or src.is_file():
            copy_file(src, dest / rel)
