"""Build llama-server from source: source → patches → cmake → cached binary.

One call, `build`, does everything and is cheap when nothing changed:

1. resolve the source (`core.server.source`) to an identity (git commit, archive sha256
   or tree hash);
2. pick the backend (`detect_backend`, or the request's override) and the cmake flags;
3. hash source identity, patch names and bytes, cmake flags, compiler versions, backend and
   GGML_NATIVE into the **build id**; if ``<builds_dir>/<id>/`` holds a valid build, return it
   at once (no subprocess runs: compiler versions are cached by the compiler file's
   size and mtime);
4. otherwise export a fresh copy of the tree into a temp dir under the builds dir, apply
   ``patches/*.patch`` in name order with ``git apply``, configure with cmake, build only
   the ``llama-server`` target with all cores, check that the binary answers ``--version``,
   write ``build.json`` and rename the result into place. A failed or cancelled build
   leaves nothing in the cache (its log goes to ``<log_dir>/builds/``).

The binary is linked statically against llama/ggml (``-DBUILD_SHARED_LIBS=OFF``): the result
is one relocatable file that can be renamed into the cache and run from there without an
rpath pointing into a build tree that no longer exists.

Progress goes to an ``on_progress`` callback as `BuildProgress` events (on the event-loop
thread), cancellation through an `asyncio.Event` (or cancelling the task): cmake runs in
its own process group and the whole group is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import re
import secrets
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from core.errors import BuildError
from core.events import BuildProgress
from core.paths import Paths
from core.server.buildlog import (
    BuildCancelled,
    BuildLog,
    ProgressTracker,
    estimate_eta,
    run_step,
)
from core.server.source import (
    DEFAULT_SOURCE,
    PYPI_INDEX,
    BuildSource,
    Patch,
    PatchFailed,
    ResolvedSource,
    apply_patches,
    default_patches_dir,
    load_patches,
    resolve_source,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_SOURCE",
    "BackendChoice",
    "BuildCancelled",
    "BuildFailed",
    "BuildRecord",
    "BuildRequest",
    "Patch",
    "PatchFailed",
    "apply_patches",
    "build",
    "build_sync",
    "check_toolchain",
    "cmake_args",
    "compiler_hint",
    "compute_build_id",
    "default_patches_dir",
    "detect_backend",
    "find_cached_build",
    "latest_build",
    "list_builds",
    "load_patches",
    "toolchain_versions",
]

log = logging.getLogger("warmslot.build")

BACKENDS = ("cpu", "cuda", "hip", "vulkan", "metal")
MANIFEST = "build.json"
LOG_NAME = "build.log"
SCHEMA = 1
ID_LENGTH = 16  # hex chars of the sha256 used as directory name (64 bits)
_TMP_PREFIX = ".tmp-"
_TOOLCHAIN_CACHE = ".toolchain.json"
_EXE = "llama-server.exe" if os.name == "nt" else "llama-server"
_VERSION_TIMEOUT_S = 60.0

ProgressCallback = Callable[[BuildProgress], None]
RecordHook = Callable[[dict[str, Any]], None]
_T = TypeVar("_T")


class BuildFailed(BuildError):
    """cmake or the compiler failed. Carries the saved log and its last lines."""

    def __init__(
        self, message: str, *, hint: str = "", log_path: Path | None = None, tail: str = ""
    ) -> None:
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.tail = tail


# ---------------------------------------------------------------------------- backend


@dataclass(frozen=True)
class BackendChoice:
    """The backend to build for and, in words, why."""

    backend: str
    reason: str


def nvml_gpu_count() -> int:
    """Number of NVIDIA GPUs NVML sees; 0 when there is no driver or no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no device: all mean "no CUDA GPU here"
        return 0


def _find_nvcc(
    which: Callable[[str], str | None], env: Mapping[str, str], exists: Callable[[str], bool]
) -> str | None:
    found = which("nvcc")
    if found:
        return found
    for root in (env.get("CUDA_PATH"), env.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            cand = os.path.join(root, "bin", "nvcc.exe" if os.name == "nt" else "nvcc")
            if exists(cand):
                return cand
    return None


def _vulkan_headers(env: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
    roots = [env.get("VULKAN_SDK", ""), "/usr", "/usr/local", "/opt/homebrew"]
    return any(r and exists(os.path.join(r, "include", "vulkan", "vulkan.h")) for r in roots)


def detect_backend(
    *,
    which: Callable[[str], str | None] = shutil.which,
    env: Mapping[str, str] | None = None,
    system: str | None = None,
    exists: Callable[[str], bool] = os.path.exists,
    gpu_count: Callable[[], int] = nvml_gpu_count,
) -> BackendChoice:
    """Pick the GPU backend this machine can build for, else CPU.

    Order: Metal (macOS), CUDA (nvcc on PATH or under $CUDA_PATH or /usr/local/cuda, and
    NVML sees a GPU), HIP (hipcc or rocminfo), Vulkan (vulkan/vulkan.h and glslc), CPU.
    Every probe is injectable so tests can fake a machine.
    """
    env = os.environ if env is None else env
    system = system or platform.system()
    if system == "Darwin":
        return BackendChoice("metal", "macOS: Metal is available on every supported Mac")
    nvcc = _find_nvcc(which, env, exists)
    if nvcc:
        n = gpu_count()
        if n > 0:
            return BackendChoice("cuda", f"nvcc at {nvcc} and NVML sees {n} GPU(s)")
        cuda_skipped = f"nvcc at {nvcc} but NVML sees no GPU; "
    else:
        cuda_skipped = ""
    hip = (
        which("hipcc")
        or which("rocminfo")
        or ("/opt/rocm/bin/hipcc" if exists("/opt/rocm/bin/hipcc") else None)
    )
    if hip:
        return BackendChoice("hip", f"{cuda_skipped}ROCm found ({hip})")
    glslc = which("glslc")
    if glslc and _vulkan_headers(env, exists):
        return BackendChoice("vulkan", f"{cuda_skipped}Vulkan headers and glslc ({glslc}) found")
    missing = "" if glslc or not _vulkan_headers(env, exists) else " (Vulkan headers but no glslc)"
    return BackendChoice("cpu", f"{cuda_skipped}no GPU toolchain found{missing}")


def cmake_args(
    backend: str,
    *,
    native: bool = True,
    build_number: int | None = None,
    commit: str | None = None,
    extra: Sequence[str] = (),
    system: str | None = None,
    cuda_compiler: str | None = None,
) -> list[str]:
    """The cmake configure flags for a llama-server build (checked against b11434).

    ``LLAMA_CURL`` is deprecated and ignored in that tree but defaults ON in older ones
    (where it needs libcurl), so it is still passed. ``LLAMA_OPENSSL`` is off because
    Warmslot always gives the server local model files (no ``-hf`` downloads), which keeps
    the binary free of libssl. The web UI is neither built (npm) nor downloaded from
    Hugging Face at build time, so a build needs no network and is reproducible.
    """
    if backend not in BACKENDS:
        raise BuildError(f"Unknown backend {backend!r}", hint=f"Use one of {', '.join(BACKENDS)}.")
    system = system or platform.system()
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
    ]
    if backend == "cuda":
        args.append("-DGGML_CUDA=ON")
        if cuda_compiler:
            args.append(f"-DCMAKE_CUDA_COMPILER={cuda_compiler}")
    elif backend == "hip":
        args.append("-DGGML_HIP=ON")
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    elif backend == "metal":
        args.append("-DGGML_METAL=ON")
    elif system == "Darwin":
        args.append("-DGGML_METAL=OFF")  # Metal is on by default on Apple
    # Without .git in the copied tree, cmake would report build 0 / commit "unknown".
    if build_number is not None:
        args.append(f"-DLLAMA_BUILD_NUMBER={build_number}")
    if commit:
        args.append(f"-DLLAMA_BUILD_COMMIT={commit[:12]}")
    args.extend(extra)
    return args


# ---------------------------------------------------------------------------- toolchain


def tool_path(env: Mapping[str, str] | None = None) -> str:
    """PATH for build tools: Warmslot's own environment first, where pip puts the
    ``cmake`` and ``ninja`` packages (``warmslot[server]``) even when that environment
    is not activated (``.venv/bin/warmslot serve``)."""
    env = os.environ if env is None else env
    scripts = sysconfig.get_path("scripts")
    rest = env.get("PATH", os.defpath)
    return os.pathsep.join(p for p in (scripts, rest) if p)


def compiler_hint(os_release: Path = Path("/etc/os-release"), system: str | None = None) -> str:
    """What to install for a C/C++ compiler on this OS (the one thing pip cannot bring)."""
    system = system or platform.system()
    alt = " Or set server.binary to a llama-server that works on this machine."
    if system == "Darwin":
        return "Install Apple's command line tools: xcode-select --install." + alt
    if system == "Windows":
        return (
            "Install Visual Studio Build Tools with the 'Desktop development with C++' "
            "workload (winget install Microsoft.VisualStudio.2022.BuildTools)." + alt
        )
    ids: set[str] = set()
    with contextlib.suppress(OSError):
        for line in os_release.read_text("utf-8", "replace").splitlines():
            key, _, value = line.partition("=")
            if key in ("ID", "ID_LIKE"):
                ids.update(value.strip().strip('"').lower().split())
    for names, cmd in (
        ({"debian", "ubuntu"}, "sudo apt install build-essential"),
        ({"fedora", "rhel", "centos"}, "sudo dnf install gcc-c++ make"),
        ({"arch"}, "sudo pacman -S base-devel"),
        ({"opensuse", "suse", "opensuse-tumbleweed"}, "sudo zypper install gcc-c++ make"),
        ({"alpine"}, "sudo apk add build-base linux-headers"),
    ):
        if ids & names:
            return f"Install a C/C++ compiler: {cmd}." + alt
    return "Install a C/C++ compiler (gcc and g++, or clang)." + alt


@dataclass(frozen=True)
class ToolchainCheck:
    """Whether this machine can build llama-server, and what is missing."""

    ok: bool
    problems: tuple[str, ...]
    hint: str


def check_toolchain(
    env: Mapping[str, str] | None = None,
    which: Callable[..., str | None] = shutil.which,
) -> ToolchainCheck:
    """Check the CPU build's tools before anything is downloaded: a C and a C++ compiler
    and git (from the OS), and cmake (from PyPI with ``warmslot[server]``, or the OS)."""
    env = os.environ if env is None else env
    path = tool_path(env)
    problems: list[str] = []
    hints: list[str] = []
    for role, exe in (
        ("C compiler", env.get("CC") or "cc"),
        ("C++ compiler", env.get("CXX") or "c++"),
    ):
        if os.name == "nt" and not which(exe, path=path) and which("cl", path=path):
            continue
        if not which(exe, path=path):
            problems.append(f"no {role} ({exe})")
    if problems:
        hints.append(compiler_hint())
    if not which("cmake", path=path):
        problems.append("no cmake")
        hints.append(
            "Install cmake and ninja into Warmslot's environment: pip install cmake ninja."
        )
    if not which("git", path=path):  # applies Warmslot's patches (`git apply`)
        problems.append("no git")
        hints.append("Install git (Debian/Ubuntu: sudo apt install git).")
    return ToolchainCheck(not problems, tuple(problems), " ".join(hints))


def _tools_for(
    backend: str,
    env: Mapping[str, str],
    which: Callable[[str], str | None],
    exists: Callable[[str], bool],
) -> dict[str, str]:
    tools = {
        "cc": env.get("CC") or "cc",
        "c++": env.get("CXX") or "c++",
    }
    if os.name == "nt" and not which(tools["cc"]):
        tools = {"cc": "cl", "c++": "cl"}
    if backend == "cuda":
        nvcc = _find_nvcc(which, env, exists)
        if nvcc:
            tools["nvcc"] = nvcc
    elif backend == "hip":
        tools["hipcc"] = which("hipcc") or "/opt/rocm/bin/hipcc"
    elif backend == "vulkan":
        tools["glslc"] = "glslc"
    return tools


def _version_line(tool: str, output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    if tool == "nvcc":
        # "Cuda compilation tools, release 12.4, V12.4.131" is the line that matters.
        for ln in lines:
            if "release" in ln:
                return ln
    return lines[0] if lines else ""


def toolchain_versions(tools: Mapping[str, str], cache_file: Path | None = None) -> dict[str, str]:
    """``role → "<path>: <first line of --version>"`` for each tool (blocking).

    Versions are cached in `cache_file` keyed by the tool's resolved path, size and mtime,
    so that a cache-hit build runs no subprocess at all. A missing tool raises BuildError.
    """
    cache: dict[str, Any] = {}
    if cache_file is not None:
        with contextlib.suppress(OSError, ValueError):
            cache = json.loads(cache_file.read_text("utf-8"))
    changed = False
    out: dict[str, str] = {}
    for role, exe in tools.items():
        found = shutil.which(exe, path=tool_path())
        if not found:
            hint = (
                compiler_hint()
                if role in ("cc", "c++")
                else f"Install {exe} or choose another backend (--backend cpu)."
            )
            raise BuildError(f"{role} compiler {exe!r} not found", hint=hint)
        real = os.path.realpath(found)
        st = os.stat(real)
        key = f"{real}|{st.st_size}|{st.st_mtime_ns}"
        entry = cache.get(key)
        if not isinstance(entry, str):
            try:
                proc = subprocess.run(
                    [found, "--version"],
                    capture_output=True,
                    text=True,
                    errors="replace",
                    timeout=60,
                    stdin=subprocess.DEVNULL,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BuildError(f"{exe} --version failed: {e}") from e
            entry = _version_line(role, proc.stdout + proc.stderr)
            cache[key] = entry
            changed = True
        out[role] = f"{real}: {entry}"
    if changed and cache_file is not None:
        with contextlib.suppress(OSError):
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(cache_file.name + f".{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True), "utf-8")
            tmp.replace(cache_file)
    return out


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


# ---------------------------------------------------------------------------- records


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


# ---------------------------------------------------------------------------- the build


@dataclass
class _Plan:
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


def _make_plan(request: BuildRequest, paths: Paths, emit: Callable[[str], None]) -> _Plan:
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
    tools = _tools_for(choice.backend, env, shutil.which, os.path.exists)
    toolchain = toolchain_versions(tools, paths.builds_dir / _TOOLCHAIN_CACHE)
    args = cmake_args(
        choice.backend,
        native=request.native,
        build_number=resolved.build_number,
        commit=resolved.commit,
        extra=request.extra_cmake_args,
        cuda_compiler=tools.get("nvcc"),
    )
    build_hash = compute_build_id(
        source_identity=resolved.identity,
        patches=patches,
        cmake_args=args,
        toolchain=toolchain,
        backend=choice.backend,
        native=request.native,
    )
    return _Plan(request, resolved, choice, patches, args, toolchain, build_hash, env)


async def _in_thread(fn: Callable[[], _T]) -> _T:
    """Run blocking work in a thread; on cancellation wait for it before re-raising, so the
    caller can clean up files the thread was still writing."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await fut
        raise


def _check_cancel(cancel: asyncio.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise BuildCancelled("Build cancelled")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours (EPERM), or Windows quirks: leave it alone
        return True
    return True


def _sweep_stale_temps(builds_dir: Path) -> None:
    """Remove temp dirs of builds whose process died (kill -9, power loss)."""
    with contextlib.suppress(OSError):
        for d in builds_dir.iterdir():
            m = re.match(re.escape(_TMP_PREFIX) + r"[0-9a-f]+-(\d+)-", d.name)
            if m and d.is_dir() and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)


def _find_built_binary(build_dir: Path) -> Path | None:
    for cand in (build_dir / "bin" / _EXE, build_dir / "bin" / "Release" / _EXE):
        if cand.is_file():
            return cand
    return None


def _stage_outputs(binary: Path, out: Path) -> Path:
    """Copy the built bin/ folder (the binary plus any shared libraries) into `out`/bin."""
    dest = out / "bin"
    dest.mkdir(parents=True, exist_ok=True)
    for f in binary.parent.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    return dest / binary.name


async def _probe_version(binary: Path, blog: BuildLog) -> str:
    """Run ``llama-server --version``: proves the binary starts, and gives its version."""
    blog.note(f"$ {binary} --version")
    try:
        proc = await asyncio.create_subprocess_exec(
            str(binary),
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), _VERSION_TIMEOUT_S)
    except (OSError, TimeoutError) as e:
        raise BuildFailed(f"The built llama-server does not run: {e}") from e
    text = out.decode("utf-8", "replace")
    for line in text.splitlines():
        blog.write(line)
    if proc.returncode != 0:
        raise BuildFailed(
            f"The built llama-server exited with {proc.returncode} on --version",
            tail=text[-2000:],
        )
    m = re.search(r"^version:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else text.strip().splitlines()[0] if text.strip() else ""


def _generator_args() -> list[str]:
    # Ninja when present: its "[done/total]" status gives an exact, smooth progress bar.
    return ["-G", "Ninja"] if shutil.which("ninja", path=tool_path()) else []


def _failed_log_path(paths: Paths, build_id: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return paths.log_dir / "builds" / f"{stamp}-{build_id or 'unknown'}-failed.log"


async def _compile(
    plan: _Plan,
    paths: Paths,
    blog: BuildLog,
    progress: ProgressCallback,
    cancel: asyncio.Event | None,
    started: float,
) -> BuildRecord:
    builds_dir = paths.builds_dir
    build_id = plan.build_id
    req = plan.request
    _sweep_stale_temps(builds_dir)
    tmp = builds_dir / f"{_TMP_PREFIX}{build_id}-{os.getpid()}-{secrets.token_hex(3)}"
    out = tmp / "out"
    src = tmp / "src"
    bdir = tmp / "build"

    def step(percent: float, text: str) -> None:
        blog.note(text)
        progress(BuildProgress(build_id=build_id, percent=percent, step=text))

    try:
        out.mkdir(parents=True)
        blog.open(out / LOG_NAME)
        step(0.0, "Preparing a fresh copy of the source")
        await _in_thread(functools.partial(plan.resolved.export, src))
        _check_cancel(cancel)
        if plan.patches:
            step(0.0, f"Applying {len(plan.patches)} patch(es)")
            await apply_patches(src, plan.patches, blog.note)
            _check_cancel(cancel)

        generator = _generator_args()
        env = dict(plan.env)
        env["PATH"] = tool_path(env)
        # Ninja's progress format is what the parser reads; a user's NINJA_STATUS would hide it.
        env["NINJA_STATUS"] = "[%f/%t] "
        # llama.cpp's cmake asks git for the commit and count of the source dir; our copy has
        # no .git, and git must not climb into a repo that happens to contain the builds dir.
        env["GIT_CEILING_DIRECTORIES"] = str(tmp)
        # ggml uses ccache when it is installed; each build works in a fresh temp dir, so
        # paths are made relative to it, or a rebuild (one patch changed) would miss.
        env.setdefault("CCACHE_BASEDIR", str(tmp))
        env.setdefault("CCACHE_NOHASHDIR", "1")
        step(0.0, "Configuring (cmake)")
        rc = await run_step(
            ["cmake", "-S", str(src), "-B", str(bdir), *generator, *plan.cmake_args],
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
        )
        if rc != 0:
            raise BuildFailed(
                f"cmake configure failed (exit {rc})",
                hint="See the log; a missing toolkit or library is the usual cause.",
            )
        _check_cancel(cancel)

        jobs = req.jobs or default_jobs(req.background)
        prefix = low_priority_prefix() if req.background else []
        tracker = ProgressTracker()
        step(0.0, f"Building llama-server ({jobs} jobs)")

        def on_line(line: str) -> None:
            moved = tracker.feed(line)
            if moved is not None:
                # The last percent is kept for "linking / checking" after the compile.
                progress(
                    BuildProgress(
                        build_id=build_id,
                        percent=min(moved.percent, 99.0),
                        step=moved.step,
                        steps_done=moved.done,
                        steps_total=moved.total,
                    )
                )

        rc = await run_step(
            [
                *prefix,
                "cmake",
                "--build",
                str(bdir),
                "--target",
                "llama-server",
                "--config",
                "Release",
                "-j",
                str(jobs),
            ],
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
            on_line=on_line,
        )
        if rc != 0:
            raise BuildFailed(
                f"Compiling llama-server failed (exit {rc})",
                hint="See the log; if a patch is involved try --no-patches.",
            )
        _check_cancel(cancel)
        built = _find_built_binary(bdir)
        if built is None:
            raise BuildFailed("The build finished but produced no llama-server binary")
        binary = await _in_thread(functools.partial(_stage_outputs, built, out))
        step(99.0, "Checking the binary (--version)")
        version = await _probe_version(binary, blog)
        duration = time.monotonic() - started
        created = time.time()
        manifest = {
            "schema": SCHEMA,
            "build_id": build_id,
            "build_hash": plan.build_hash,
            "created": created,
            "created_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(created)),
            "duration_s": round(duration, 3),
            "binary": binary.relative_to(out).as_posix(),
            "log": LOG_NAME,
            "llama_cpp_version": version,
            "build_number": plan.resolved.build_number,
            "commit": plan.resolved.commit,
            "source": {
                "spec": str(plan.resolved.source),
                "kind": plan.resolved.source.kind,
                "identity": plan.resolved.identity,
                "description": plan.resolved.description,
            },
            "backend": plan.backend.backend,
            "backend_reason": plan.backend.reason,
            "native": req.native,
            "patches_enabled": req.patches,
            "patches": [{"name": p.name, "sha256": p.sha256} for p in plan.patches],
            "cmake_args": plan.cmake_args,
            "generator": generator[1] if generator else "default",
            "jobs": jobs,
            "cpu_count": os.cpu_count(),
            "background": req.background,
            "toolchain": plan.toolchain,
            "platform": f"{platform.system()} {platform.machine()}",
        }
        blog.note(f"Build {build_id} done in {duration:.1f} s: {version}")
        blog.close()
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
        final = builds_dir / build_id
        try:
            os.rename(out, final)
        except OSError:
            # Another process finished the same build first: its result is identical.
            if BuildRecord.load(final) is None:
                raise
        rec = BuildRecord.load(final)
        if rec is None:
            raise BuildFailed(f"Build {build_id} finished but its cache entry is unreadable")
        return rec
    except BuildCancelled:
        raise
    except BuildError:
        # Save the log before the temp dir (where it lives) goes.
        blog.keep_at(_failed_log_path(paths, build_id))
        raise
    finally:
        blog.close()
        # Shielded from cancellation: a half-deleted temp dir would be swept later anyway,
        # but we want "cancel leaves nothing" to hold when the call returns.
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, tmp, True))


async def build(
    request: BuildRequest,
    paths: Paths,
    on_progress: ProgressCallback | None = None,
    cancel: asyncio.Event | None = None,
    record: RecordHook | None = None,
) -> BuildRecord:
    """Build llama-server for `request`, or return the cached build with the same inputs.

    `on_progress` gets `BuildProgress` events on the calling loop's thread (the last has
    ``done=True``). Setting `cancel` (or cancelling the task) kills cmake's process group
    and removes the temp dir; `BuildCancelled` is raised (or CancelledError re-raised).
    `record` (telemetry) is called once with inputs, outcome (``built``, ``cached``,
    ``failed``, ``cancelled``), duration and log path.

    Raises BuildError subclasses: `PatchFailed`, `BuildFailed` (with ``log_path`` and
    ``tail``), `BuildCancelled`; plain BuildError for source and toolchain problems.
    """
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    blog = BuildLog()
    state: dict[str, Any] = {"build_id": "", "percent": 0.0}
    last = latest_build(paths.builds_dir)
    previous_s = last.duration_s if last is not None else None

    def progress(ev: BuildProgress) -> None:
        state["percent"] = ev.percent
        if on_progress is None:
            return
        elapsed = time.monotonic() - started
        ev = replace(
            ev,
            elapsed_s=round(elapsed, 1),
            eta_s=None if ev.done else estimate_eta(elapsed, ev.percent, previous_s),
            purpose=request.purpose,
            background=request.background,
        )
        try:
            on_progress(ev)
        except Exception:  # a broken subscriber must not break the build
            log.exception("build progress callback failed")

    def emit_from_thread(msg: str) -> None:
        blog.note(msg)
        loop.call_soon_threadsafe(
            progress, BuildProgress(build_id=state["build_id"], percent=0.0, step=msg)
        )

    blog.note(f"warmslot build: {request}")
    plan: _Plan | None = None
    outcome = "failed"
    error = ""
    log_path: Path | None = None
    result: BuildRecord | None = None
    try:
        paths.builds_dir.mkdir(parents=True, exist_ok=True)
        plan = await _in_thread(lambda: _make_plan(request, paths, emit_from_thread))
        state["build_id"] = plan.build_id
        cached = BuildRecord.load(paths.builds_dir / plan.build_id)
        if cached is not None:
            outcome = "cached"
            result = replace(cached, cached=True)
        else:
            _check_cancel(cancel)
            result = await _compile(plan, paths, blog, progress, cancel, started)
            outcome = "built"
        log_path = result.log_path
        progress(
            BuildProgress(
                build_id=result.build_id,
                percent=100.0,
                step="Cached build" if result.cached else "Build complete",
                done=True,
                ok=True,
            )
        )
        return result
    except (BuildCancelled, asyncio.CancelledError, KeyboardInterrupt):
        outcome = "cancelled"
        progress(
            BuildProgress(
                build_id=state["build_id"],
                percent=state["percent"],
                step="Cancelled",
                done=True,
                ok=False,
            )
        )
        raise
    except BuildError as e:
        error = str(e)
        blog.note(f"FAILED: {e}")
        failed = blog.path if blog.path and blog.path.parent == paths.log_dir / "builds" else None
        log_path = blog.keep_at(failed or _failed_log_path(paths, state["build_id"]))
        if isinstance(e, BuildFailed):
            e.log_path = log_path
            e.tail = e.tail or blog.tail.text(25)
            first = blog.tail.first_error
            extra = f"\n  first error: {first}" if first else ""
            e.args = (
                f"{e.args[0]}{extra}\n--- last lines of the log ---\n{e.tail}"
                f"\n--- full log: {log_path} ---",
            )
        progress(
            BuildProgress(
                build_id=state["build_id"],
                percent=state["percent"],
                step=f"Failed: {error.splitlines()[0]}",
                done=True,
                ok=False,
            )
        )
        raise
    finally:
        blog.close()
        if record is not None:
            _call_record(
                record, request, plan, outcome, time.monotonic() - started, log_path, error, result
            )


def _call_record(
    hook: RecordHook,
    request: BuildRequest,
    plan: _Plan | None,
    outcome: str,
    duration: float,
    log_path: Path | None,
    error: str,
    result: BuildRecord | None,
) -> None:
    payload: dict[str, Any] = {
        "build_id": plan.build_id if plan else None,
        "outcome": outcome,
        "duration_s": round(duration, 3),
        "log_path": str(log_path) if log_path else None,
        "error": error,
        "source": request.source,
        "ref": request.ref,
        "requested_backend": request.backend,
        "native": request.native,
        "patches_enabled": request.patches,
        "purpose": request.purpose,
        "background": request.background,
        "jobs": request.jobs or default_jobs(request.background),
        "cpu_count": os.cpu_count(),
    }
    if plan is not None:
        payload.update(
            source_identity=plan.resolved.identity,
            backend=plan.backend.backend,
            patches=[p.name for p in plan.patches],
            cmake_args=list(plan.cmake_args),
            toolchain=dict(plan.toolchain),
        )
    if result is not None:
        payload.update(binary=str(result.binary), llama_cpp_version=result.llama_cpp_version)
    try:
        hook(payload)
    except Exception:
        log.exception("build telemetry hook failed")


def build_sync(
    request: BuildRequest,
    paths: Paths,
    on_progress: ProgressCallback | None = None,
    record: RecordHook | None = None,
) -> BuildRecord:
    """`build` for synchronous callers (the CLI). Ctrl-C cancels the build cleanly and
    surfaces as KeyboardInterrupt."""
    return asyncio.run(build(request, paths, on_progress, None, record))
