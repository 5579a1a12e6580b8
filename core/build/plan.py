"""What to build (`BuildRequest`) and the resolved inputs of one build (`Plan`).

`make_plan` resolves the source, picks the backend, loads the patches, reads the
compiler versions and computes the build id; it is blocking and runs in a worker thread.
`default_jobs` and `low_priority_prefix` say how a (background) build is run; neither
changes the binary.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.build.cuda_wheels import cuda_architecture
from core.build.patches import Patch, default_patches_dir, load_patches
from core.build.records import ID_LENGTH, compute_build_id
from core.build.source import (
    DEFAULT_SOURCE,
    PYPI_INDEX,
    BuildSource,
    ResolvedSource,
    resolve_source,
)
from core.build.toolchain import (
    BACKENDS,
    BackendChoice,
    cmake_args,
    cuda_toolkit,
    detect_backend,
    toolchain_versions,
    tools_for,
    vulkan_header_version,
)
from core.errors import BuildError
from core.paths import Paths

__all__ = ["BuildRequest", "Plan", "default_jobs", "low_priority_prefix", "make_plan"]

_TOOLCHAIN_CACHE = ".toolchain.json"


@dataclass(frozen=True)
class BuildRequest:
    """What to build. The defaults build the pinned llama.cpp for this machine."""

    source: str = DEFAULT_SOURCE
    """A path, archive, URL, git URL or ``pypi:NAME==VERSION`` (see `BuildSource.parse`)."""
    ref: str | None = None
    backend: str = "auto"
    native: bool = True
    """GGML_NATIVE: optimise for this CPU. Native builds can crash in AMX weight repacking
    on some CPUs; the supervisor retries with ``--no-repack``."""
    patches: bool = True
    patches_dir: Path | None = None
    """Defaults to `default_patches_dir()`."""
    extra_cmake_args: tuple[str, ...] = ()
    jobs: int | None = None
    """Parallel compile jobs; default: all cores."""
    index_url: str = PYPI_INDEX
    purpose: str = ""
    """Why this build runs, in words, for progress and status (does not change the binary)."""
    background: bool = False
    """Build at idle priority (nice, idle I/O class) with one core left free, because a
    server keeps serving meanwhile. Does not change the binary."""


def low_priority_prefix(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """Command prefix that runs a build at idle CPU and I/O priority where the OS has the
    tools (``nice``, Linux ``ionice``); children (compilers) inherit it."""
    prefix: list[str] = []
    if which("nice"):
        prefix += ["nice", "-n", "19"]
    if which("ionice"):
        prefix += ["ionice", "-c", "3"]
    return prefix


def default_jobs(background: bool, cpus: int | None = None) -> int:
    """Compile jobs: every core, or in the background all but one (at least one)."""
    n = cpus if cpus is not None else os.cpu_count() or 1
    return max(1, n - 1) if background else n


@dataclass
class Plan:
    request: BuildRequest
    resolved: ResolvedSource
    backend: BackendChoice
    patches: list[Patch]
    cmake_args: list[str]
    toolchain: dict[str, str]
    build_hash: str
    env: dict[str, str]

    @property
    def build_id(self) -> str:
        return self.build_hash[:ID_LENGTH]


def make_plan(request: BuildRequest, paths: Paths, emit: Callable[[str], None]) -> Plan:
    """Resolve every input and the build id (blocking; runs in a worker thread)."""
    source = BuildSource.parse(request.source, request.ref)
    resolved = resolve_source(source, paths.cache_dir, index_url=request.index_url, emit=emit)
    emit(f"Source: {resolved.description} [{resolved.identity}]")
    env = dict(os.environ)
    if request.backend == "auto":
        choice = detect_backend()
    elif request.backend in BACKENDS:
        choice = BackendChoice(request.backend, "chosen by the user")
    else:
        raise BuildError(
            f"Unknown backend {request.backend!r}",
            hint=f"Use auto or one of {', '.join(BACKENDS)}.",
        )
    emit(f"Backend: {choice.backend} ({choice.reason})")
    patches: list[Patch] = []
    if request.patches:
        pdir = request.patches_dir or default_patches_dir()
        patches = load_patches(pdir)
        emit(f"Patches from {pdir}: {', '.join(p.name for p in patches) or 'none'}")
    else:
        emit("Patches disabled")
    tools = tools_for(choice.backend, env, shutil.which, os.path.exists)
    toolchain = toolchain_versions(tools, paths.builds_dir / _TOOLCHAIN_CACHE)
    wheels, arch = None, None
    if choice.backend == "cuda":
        wheels = cuda_toolkit(shutil.which, env, os.path.exists)[1]
        arch = cuda_architecture()
        emit(
            f"CUDA: nvcc {tools['nvcc']}"
            + (" (PyPI wheels)" if wheels else "")
            + f", architecture {arch} (CMAKE_CUDA_ARCHITECTURES)"
        )
    args = cmake_args(
        choice.backend,
        native=request.native,
        build_number=resolved.build_number,
        commit=resolved.commit,
        extra=request.extra_cmake_args,
        cuda_compiler=tools.get("nvcc"),
        cuda_wheels=wheels,
        cuda_arch=arch,
        vulkan_headers=vulkan_header_version(env) if choice.backend == "vulkan" else None,
    )
    build_hash = compute_build_id(
        source_identity=resolved.identity,
        patches=patches,
        cmake_args=args,
        toolchain=toolchain,
        backend=choice.backend,
        native=request.native,
    )
    return Plan(request, resolved, choice, patches, args, toolchain, build_hash, env)
