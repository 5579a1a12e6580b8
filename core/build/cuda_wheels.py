"""A CUDA toolkit from PyPI wheels: ``nvcc`` and the libraries llama.cpp's CUDA backend needs,
installed into Warmslot's own environment (``pip install warmslot[cuda]``), no system CUDA.

NVIDIA's CUDA 13 wheels share one tree, ``site-packages/nvidia/cu13`` (``bin/nvcc``,
``include``, ``lib``, ``nvvm``). `find_wheel_toolkit` finds it and `missing_pieces` names the
package of each piece that is not there, so a build fails before cmake with "pip install
nvidia-cublas" instead of cmake's "CUDA Toolkit not found". The wheels ship versioned
libraries only (``libcublas.so.13``) and no driver stub, so `wheel_cmake_args` hands cmake's
FindCUDAToolkit the library files by name, builds without the driver API's virtual memory
pool (``GGML_CUDA_NO_VMM``: nothing links ``libcuda.so`` at build time; the driver's library is
loaded at run time) and puts the wheel's ``lib`` on the binary's run path.

`cuda_architecture` picks the one GPU architecture to compile for (``CMAKE_CUDA_ARCHITECTURES``):
the compute capability NVML reports for the first GPU, else `DEFAULT_ARCH`.
"""

from __future__ import annotations

import contextlib
import importlib
import site
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_ARCH",
    "PACKAGES",
    "WheelToolkit",
    "cuda_architecture",
    "find_wheel_toolkit",
    "missing_pieces",
    "wheel_cmake_args",
]

# The oldest architecture CUDA 13 compiles for (Turing): its PTX also runs, JIT-compiled, on
# every newer GPU, so a build made without a GPU in sight works on any CUDA 13 machine.
DEFAULT_ARCH = "75"
PACKAGES = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-cccl")
# piece (relative to the toolkit root, a glob) → the package that brings it
_PIECES: tuple[tuple[str, str], ...] = (
    ("bin/nvcc", "nvidia-cuda-nvcc"),
    ("nvvm/bin/cicc", "nvidia-nvvm"),  # a dependency of nvidia-cuda-nvcc
    ("include/crt/host_defines.h", "nvidia-cuda-crt"),  # likewise
    ("include/cuda_runtime.h", "nvidia-cuda-runtime"),
    ("lib/libcudart.so.*", "nvidia-cuda-runtime"),
    ("include/cublas_v2.h", "nvidia-cublas"),
    ("lib/libcublas.so.*", "nvidia-cublas"),
    ("lib/libcublasLt.so.*", "nvidia-cublas"),
    ("include/cccl/cuda/std", "nvidia-cuda-cccl"),
)


@dataclass(frozen=True)
class WheelToolkit:
    """The ``nvidia/cu13`` tree of the wheels."""

    root: Path

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"

    def library(self, name: str) -> Path | None:
        """``lib/lib<name>.so.<N>`` (the newest when several), or None."""
        found = sorted((self.root / "lib").glob(f"lib{name}.so.*"))
        return found[-1] if found else None


def _site_dirs() -> list[Path]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    with contextlib.suppress(AttributeError):  # some virtualenvs' site module lacks it
        dirs += site.getsitepackages()
    return [Path(d) for d in dict.fromkeys(dirs)]


def find_wheel_toolkit(site_dirs: Sequence[Path] | None = None) -> WheelToolkit | None:
    """The CUDA 13 wheels' tree in Warmslot's environment, if any of them is installed."""
    for d in _site_dirs() if site_dirs is None else site_dirs:
        root = d / "nvidia" / "cu13"
        if root.is_dir():
            return WheelToolkit(root)
    return None


def missing_pieces(tk: WheelToolkit) -> list[str]:
    """The packages whose pieces are missing from `tk` (empty: complete)."""
    out: list[str] = []
    for pattern, package in _PIECES:
        if not any(tk.root.glob(pattern)) and package not in out:
            out.append(package)
    return out


def wheel_cmake_args(tk: WheelToolkit, arch: str) -> list[str]:
    """cmake flags that build llama.cpp's CUDA backend with the wheels' toolkit."""
    args = [
        f"-DCMAKE_CUDA_COMPILER={tk.nvcc}",
        f"-DCUDAToolkit_ROOT={tk.root}",
        f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
        "-DGGML_CUDA_NO_VMM=ON",
        f"-DCMAKE_BUILD_RPATH={tk.root / 'lib'}",
    ]
    # FindCUDAToolkit looks for the unversioned names (libcublas.so) the wheels do not ship.
    libs = (
        ("CUDA_CUDART", "cudart"),
        ("CUDA_cudart_LIBRARY", "cudart"),
        ("CUDA_cublas_LIBRARY", "cublas"),
        ("CUDA_cublasLt_LIBRARY", "cublasLt"),
    )
    for var, name in libs:
        lib = tk.library(name)
        if lib is not None:
            args.append(f"-D{var}={lib}")
    return args


def cuda_architecture(nvml: Any = None) -> str:
    """The first GPU's compute capability as cmake writes it (9.0 → ``90``), else
    `DEFAULT_ARCH`. `nvml` is pynvml or a stand-in (tests)."""
    try:
        lib = nvml if nvml is not None else importlib.import_module("pynvml")
        lib.nvmlInit()
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(0)
            major, minor = lib.nvmlDeviceGetCudaComputeCapability(handle)
            return f"{int(major)}{int(minor)}"
        finally:
            lib.nvmlShutdown()
    except Exception:  # no library, no driver, no GPU: build for the default
        return DEFAULT_ARCH
