"""The machine side of a llama-server build: which backend, which cmake flags, which tools.

`detect_backend` picks the GPU backend this machine can build for (else CPU) and
`cmake_args` turns it into cmake flags; `check_toolchain` says before anything is
downloaded whether the compilers, cmake and git are there (`compiler_hint` says what to
install); `toolchain_versions` reads each compiler's ``--version`` (cached by the file's
size and mtime) because the versions go into the build id. `tool_path` is the PATH the
build runs with: Warmslot's own environment first, where pip puts cmake and ninja.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.build.cuda_wheels import PACKAGES as CUDA_PACKAGES
from core.build.cuda_wheels import (
    WheelToolkit,
    find_wheel_toolkit,
    missing_pieces,
    wheel_cmake_args,
)
from core.errors import BuildError
from core.machine.syslibs import os_release_ids

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "ToolchainCheck",
    "check_toolchain",
    "cmake_args",
    "compiler_hint",
    "cuda_toolkit",
    "detect_backend",
    "nvml_gpu_count",
    "tool_path",
    "toolchain_versions",
    "tools_for",
    "vulkan_compat_args",
    "vulkan_header_version",
]

BACKENDS = ("cpu", "cuda", "hip", "vulkan", "metal")


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


def cuda_toolkit(
    which: Callable[[str], str | None] = shutil.which,
    env: Mapping[str, str] | None = None,
    exists: Callable[[str], bool] = os.path.exists,
    wheels: WheelToolkit | bool | None = True,
) -> tuple[str, WheelToolkit | None]:
    """The nvcc a CUDA build uses, and the wheels' toolkit when it is theirs.

    A complete toolkit from PyPI wheels in Warmslot's environment comes first (it was
    installed for this: ``pip install warmslot[cuda]``), then a system nvcc (PATH,
    $CUDA_PATH, $CUDA_HOME, /usr/local/cuda). Raises BuildError naming the packages to
    install when there is neither, or the wheels are incomplete and no system nvcc is
    there. `wheels`: True finds them, None/False means none, or pass one (tests).
    """
    env = os.environ if env is None else env
    tk = find_wheel_toolkit() if wheels is True else wheels or None
    missing = missing_pieces(tk) if tk is not None else list(CUDA_PACKAGES)
    if tk is not None and not missing:
        return str(tk.nvcc), tk
    nvcc = _find_nvcc(which, env, exists)
    if nvcc:
        return nvcc, None
    raise BuildError(
        "No CUDA compiler (nvcc) for a CUDA build"
        + (f": the CUDA wheels in {tk.root} lack {', '.join(missing)}" if tk else ""),
        hint=f"pip install {' '.join(missing)} (into Warmslot's environment), install the "
        "CUDA toolkit, or choose another backend (--backend vulkan or cpu).",
    )


def _vulkan_roots(env: Mapping[str, str]) -> list[str]:
    return [r for r in (env.get("VULKAN_SDK", ""), "/usr", "/usr/local", "/opt/homebrew") if r]


def _vulkan_headers(env: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
    roots = _vulkan_roots(env)
    return any(exists(os.path.join(r, "include", "vulkan", "vulkan.h")) for r in roots)


# Vulkan headers before 1.3.261 lack VK_EXT_layer_settings, which llama.cpp's Vulkan
# backend names unconditionally (Debian 12 and Ubuntu 22.04 ship 1.3.239 / 1.3.204).
VULKAN_LAYER_SETTINGS_HEADER = 261
VULKAN_COMPAT_HEADER = "warmslot-vulkan-compat.h"  # copied into the build dir (compile.py)
VULKAN_COMPAT_VAR = "WARMSLOT_VULKAN_COMPAT"


def vulkan_header_version(env: Mapping[str, str] | None = None) -> int | None:
    """VK_HEADER_VERSION of the Vulkan headers cmake will find (None: no headers)."""
    env = os.environ if env is None else env
    for root in _vulkan_roots(env):
        core = Path(root) / "include" / "vulkan" / "vulkan_core.h"
        with contextlib.suppress(OSError):
            m = re.search(r"#define VK_HEADER_VERSION (\d+)", core.read_text("utf-8", "replace"))
            if m:
                return int(m.group(1))
    return None


def vulkan_compat_source() -> Path:
    """The definitions of VK_EXT_layer_settings' C++ types for older headers."""
    from core.paths import resources_dir

    return resources_dir() / "build" / "vulkan_layer_settings_compat.h"


def vulkan_compat_args(header_version: int | None) -> list[str]:
    """cmake flags that pre-include the compat header when the headers are too old.

    The flag names the header relative to the build dir (the compiler's working
    directory), so the build id does not depend on where Warmslot is installed; the
    header's hash joins the flags so that a changed header is a new build."""
    if header_version is None or header_version >= VULKAN_LAYER_SETTINGS_HEADER:
        return []
    digest = hashlib.sha256(vulkan_compat_source().read_bytes()).hexdigest()[:12]
    return [f"-DCMAKE_CXX_FLAGS=-include {VULKAN_COMPAT_HEADER}", f"-D{VULKAN_COMPAT_VAR}={digest}"]


def _has_render_node() -> bool:
    return any(Path("/dev/dri").glob("renderD*"))


def detect_backend(
    *,
    which: Callable[[str], str | None] = shutil.which,
    env: Mapping[str, str] | None = None,
    system: str | None = None,
    exists: Callable[[str], bool] = os.path.exists,
    gpu_count: Callable[[], int] = nvml_gpu_count,
    wheels: WheelToolkit | bool | None = True,
    render_node: Callable[[], bool] | None = None,
) -> BackendChoice:
    """Pick the GPU backend this machine can build for, else CPU.

    Order: Metal (macOS), CUDA (`cuda_toolkit` finds nvcc — PyPI wheels, PATH, $CUDA_PATH,
    /usr/local/cuda — and NVML sees a GPU), HIP (hipcc or rocminfo), Vulkan
    (vulkan/vulkan.h and glslc), CPU.
    Every probe is injectable so tests can fake a machine.
    """
    env = os.environ if env is None else env
    system = system or platform.system()
    if system == "Darwin":
        return BackendChoice("metal", "macOS: Metal is available on every supported Mac")
    try:
        nvcc: str | None = cuda_toolkit(which, env, exists, wheels)[0]
    except BuildError:
        nvcc = None
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
        # Mesa's lavapipe makes a Vulkan device of the CPU, which llama.cpp skips: without a
        # GPU (on Linux: a DRM render node) a Vulkan build only takes longer to compile.
        has_gpu = render_node() if render_node else system != "Linux" or _has_render_node()
        if has_gpu:
            return BackendChoice(
                "vulkan", f"{cuda_skipped}Vulkan headers and glslc ({glslc}) found"
            )
        return BackendChoice(
            "cpu",
            f"{cuda_skipped}Vulkan headers and glslc found, but no GPU (no /dev/dri/renderD*);"
            " --backend vulkan builds one anyway",
        )
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
    cuda_wheels: WheelToolkit | None = None,
    cuda_arch: str | None = None,
    vulkan_headers: int | None = None,
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
        # llama.cpp's RPC backend: `llama-server --rpc` and the ggml-rpc-server worker that
        # spread one model over several machines (docs/scale.md). Small: one backend file.
        "-DGGML_RPC=ON",
    ]
    if backend == "cuda":
        args.append("-DGGML_CUDA=ON")
        if cuda_wheels is not None:
            args += wheel_cmake_args(cuda_wheels, cuda_arch or "75")
        else:
            if cuda_compiler:
                args.append(f"-DCMAKE_CUDA_COMPILER={cuda_compiler}")
            if cuda_arch:  # one architecture: llama.cpp's default list compiles ~8
                args.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}")
    elif backend == "hip":
        args.append("-DGGML_HIP=ON")
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
        args += vulkan_compat_args(vulkan_headers)
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
    ids = os_release_ids(os_release)
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


def tools_for(
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
        tools["nvcc"] = cuda_toolkit(which, env, exists)[0]
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
    cache: dict[str, object] = {}
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
