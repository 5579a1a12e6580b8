"""A llama.cpp source tree on disk: finding its root, hashing it, copying it (without
build outputs, VCS data or model files) and unpacking an archive of it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from core.errors import BuildError

_PROJECT = re.compile(r"project\s*\(\s*\"?llama\.cpp\"?", re.IGNORECASE)
# Directories that are never part of the source: VCS data, build trees, caches.
_SKIP_ANYWHERE = frozenset({".git", "__pycache__", "node_modules", ".cache", ".venv", ".ccache"})
# Model files people keep in a llama.cpp folder (models/, anywhere): often gigabytes, never
# needed to build the server, so not hashed or copied.
_SKIP_FILE_SUFFIXES = (".gguf",)
# Bytes read at a time when hashing or downloading.
READ_CHUNK = 1 << 20


def is_llama_root(path: Path) -> bool:
    """Whether `path` holds a CMakeLists.txt declaring project("llama.cpp")."""
    cml = path / "CMakeLists.txt"
    try:
        return cml.is_file() and bool(_PROJECT.search(cml.read_text("utf-8", "replace")[:20000]))
    except OSError:
        return False


def find_llama_root(path: Path, depth: int = 3) -> Path | None:
    """The llama.cpp source root at or below `path` (an sdist vendors it under llama.cpp/)."""
    level = [path]
    for _ in range(depth + 1):
        for d in level:
            if is_llama_root(d):
                return d
        # Prefer a child literally named llama.cpp, then the rest in name order.
        nxt: list[Path] = []
        for d in level:
            try:
                kids = sorted(
                    (k for k in d.iterdir() if k.is_dir() and k.name not in _SKIP_ANYWHERE),
                    key=lambda k: (k.name != "llama.cpp", k.name),
                )
            except OSError:
                continue
            nxt.extend(kids)
        level = nxt
    return None


def sha256_file(path: Path) -> str:
    """The sha256 of a file's content, hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _skip_dir(rel_parts: tuple[str, ...]) -> bool:
    name = rel_parts[-1]
    if name in _SKIP_ANYWHERE:
        return True
    # Build trees inside a checkout (build/, build-cuda/ …) are outputs, not source.
    return len(rel_parts) == 1 and name.startswith("build")


def _walk_tree(root: Path) -> Iterator[Path]:
    """Files and symlinks of a source tree, in a stable order, skipping outputs."""
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as err:
            raise BuildError(f"Cannot read {d}: {err.strerror}") from err
        dirs = []
        for e in entries:
            p = Path(e.path)
            if e.is_dir(follow_symlinks=False):
                if not _skip_dir(p.relative_to(root).parts):
                    dirs.append(p)
            elif not e.name.endswith(_SKIP_FILE_SUFFIXES):
                yield p
        stack.extend(reversed(dirs))


def tree_hash(root: Path) -> str:
    """sha256 over every file's relative path, exec bit and content (symlinks: target)."""
    h = hashlib.sha256()
    for p in sorted(_walk_tree(root), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            h.update(f"l\0{rel}\0{os.readlink(p)}\n".encode())
        elif stat.S_ISREG(st.st_mode):
            kind = "x" if st.st_mode & 0o111 else "f"
            h.update(f"{kind}\0{rel}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def copy_tree(root: Path, dest: Path) -> None:
    """Copy the source tree at `root` to `dest`, leaving out what `tree_hash` leaves out."""

    def ignore(d: str, names: list[str]) -> set[str]:
        rel = Path(d).relative_to(root).parts
        return {
            n
            for n in names
            if n.endswith(_SKIP_FILE_SUFFIXES) or ((Path(d) / n).is_dir() and _skip_dir((*rel, n)))
        }

    shutil.copytree(root, dest, symlinks=True, ignore=ignore)


def copy_file(src: Path, dst: Path) -> None:
    """Copy one file (a symlink as a symlink), making parent directories."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def unpack_archive(archive: Path, dest: Path) -> None:
    """Unpack a source archive and move the llama.cpp root in it to `dest`."""
    staging = dest.with_name(dest.name + ".unpack")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        if archive.name.lower().endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    target = Path(zf.extract(info, staging))
                    mode = (info.external_attr >> 16) & 0o777
                    if mode and not info.is_dir():
                        target.chmod(mode | 0o600)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(staging, filter="data")
        root = find_llama_root(staging)
        if root is None:
            raise BuildError(
                f"{archive.name} does not contain a llama.cpp source tree",
                hint='Expected a CMakeLists.txt declaring project("llama.cpp") at its top, '
                "in one top-level folder, or under llama.cpp/ (PyPI sdists).",
            )
        root.rename(dest)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
        raise BuildError(f"Cannot unpack {archive.name}: {e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
