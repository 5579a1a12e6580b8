"""Finished builds: the build id, the ``build.json`` record and the cache listing.

`compute_build_id` hashes everything that determines the binary (source identity, patch
names and bytes, cmake flags, compiler versions, backend, GGML_NATIVE); a build lives in
``<builds_dir>/<first ID_LENGTH hex chars>/`` with a ``build.json`` that `BuildRecord.load`
reads back. `list_builds`, `latest_build` and `find_cached_build` only read files; they
never build.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.build.patches import Patch
from core.paths import Paths

__all__ = [
    "ID_LENGTH",
    "LOG_NAME",
    "MANIFEST",
    "SCHEMA",
    "BuildRecord",
    "compute_build_id",
    "find_cached_build",
    "latest_build",
    "list_builds",
]

MANIFEST = "build.json"
LOG_NAME = "build.log"
SCHEMA = 1
ID_LENGTH = 16  # hex chars of the sha256 used as directory name (64 bits)


# ---------------------------------------------------------------------------- identity


def compute_build_id(
    *,
    source_identity: str,
    patches: Sequence[Patch],
    cmake_args: Sequence[str],
    toolchain: Mapping[str, str],
    backend: str,
    native: bool,
) -> str:
    """Full sha256 (hex) over everything that determines the binary.

    The cache directory uses its first `ID_LENGTH` characters. Patch names and bytes count
    in order; the generator and job count do not (they do not change the output).
    """
    inputs = {
        "schema": SCHEMA,
        "source": source_identity,
        "patches": [[p.name, p.sha256] for p in patches],
        "cmake_args": list(cmake_args),
        "toolchain": dict(sorted(toolchain.items())),
        "backend": backend,
        "native": native,
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class BuildRecord:
    """A finished build in the cache (read from its ``build.json``)."""

    build_id: str
    path: Path
    binary: Path
    created: float
    duration_s: float
    backend: str
    native: bool
    source: str
    source_identity: str
    llama_cpp_version: str
    build_number: int | None
    patches: tuple[str, ...]
    cmake_args: tuple[str, ...]
    toolchain: Mapping[str, str]
    backend_reason: str = ""
    """Why the backend was chosen, in words (``chosen by the user``, what auto detected)."""
    cached: bool = False
    """True when this call found the build in the cache instead of building it."""

    @property
    def log_path(self) -> Path:
        return self.path / LOG_NAME

    @classmethod
    def load(cls, build_dir: Path) -> BuildRecord | None:
        """The record of `build_dir`, or None unless it is a complete, runnable build."""
        try:
            m = json.loads((build_dir / MANIFEST).read_text("utf-8"))
            if m.get("schema") != SCHEMA or m.get("build_id") != build_dir.name:
                return None
            binary = build_dir / m["binary"]
            if not binary.is_file() or not os.access(binary, os.X_OK):
                return None
            return cls(
                build_id=m["build_id"],
                path=build_dir,
                binary=binary,
                created=float(m["created"]),
                duration_s=float(m["duration_s"]),
                backend=str(m["backend"]),
                native=bool(m["native"]),
                source=str(m["source"]["spec"]),
                source_identity=str(m["source"]["identity"]),
                llama_cpp_version=str(m.get("llama_cpp_version", "")),
                build_number=m.get("build_number"),
                patches=tuple(p["name"] for p in m.get("patches", [])),
                cmake_args=tuple(m["cmake_args"]),
                toolchain=dict(m.get("toolchain", {})),
                backend_reason=str(m.get("backend_reason", "")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def list_builds(paths: Paths) -> list[BuildRecord]:
    """Every valid build in the cache, newest first."""
    return _list_builds(paths.builds_dir)


def _list_builds(builds_dir: Path) -> list[BuildRecord]:
    try:
        dirs = [d for d in builds_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
    except OSError:
        return []
    records = [r for r in (BuildRecord.load(d) for d in dirs) if r is not None]
    return sorted(records, key=lambda r: r.created, reverse=True)


def latest_build(builds_dir: Path) -> BuildRecord | None:
    """The newest complete build under `builds_dir` (``Paths.builds_dir``), or None.

    For server discovery: ``latest_build(paths.builds_dir).binary`` is a runnable
    llama-server. Only reads files; never builds. Check ``record.native`` to know whether
    the binary was optimised for this CPU (then ``--no-repack`` may be needed, see
    docs/llama-server-facts.md#amx-repack-crash).
    """
    builds = _list_builds(builds_dir)
    return builds[0] if builds else None


def find_cached_build(paths: Paths) -> Path | None:
    """The binary of the newest valid cached build, or None."""
    rec = latest_build(paths.builds_dir)
    return rec.binary if rec else None
