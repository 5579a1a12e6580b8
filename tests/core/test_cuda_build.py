"""CUDA builds from PyPI wheels: the toolkit is found in Warmslot's environment, a missing
piece is an error naming its package, cmake gets the wheels' libraries by name and one GPU
architecture (NVML's, else a default). Old Vulkan headers get the compat pre-include.

The configure and compile against the real wheels are tests/integration/test_cuda_build.py
(opt-in, slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.build import toolchain as tc
from core.build.cuda_wheels import (
    DEFAULT_ARCH,
    WheelToolkit,
    cuda_architecture,
    find_wheel_toolkit,
    missing_pieces,
)
from core.errors import BuildError

_PIECES = (
    "bin/nvcc", "nvvm/bin/cicc", "include/crt/host_defines.h", "include/cuda_runtime.h",
    "lib/libcudart.so.13", "include/cublas_v2.h", "lib/libcublas.so.13",
    "lib/libcublasLt.so.13", "include/cccl/cuda/std/version",
)  # fmt: skip


def wheel_tree(site: Path, without: tuple[str, ...] = ()) -> WheelToolkit:
    root = site / "nvidia" / "cu13"
    for piece in _PIECES:
        if not any(piece.startswith(w) for w in without):
            (root / piece).parent.mkdir(parents=True, exist_ok=True)
            (root / piece).write_text("")
    return WheelToolkit(root)


def no_nvcc(_: str) -> None:
    return None


def test_a_complete_wheel_toolkit_is_found_and_used(tmp_path: Path) -> None:
    tk = wheel_tree(tmp_path)
    assert find_wheel_toolkit([tmp_path / "elsewhere", tmp_path]) == tk
    assert missing_pieces(tk) == []
    nvcc, found = tc.cuda_toolkit(no_nvcc, {}, lambda p: False, tk)
    assert nvcc == str(tk.nvcc) and found == tk
    args = tc.cmake_args("cuda", system="Linux", cuda_wheels=tk, cuda_arch="90")
    for flag in (
        "-DGGML_CUDA=ON",
        "-DCMAKE_CUDA_ARCHITECTURES=90",
        "-DGGML_CUDA_NO_VMM=ON",
        f"-DCMAKE_CUDA_COMPILER={tk.nvcc}",
        f"-DCUDAToolkit_ROOT={tk.root}",
        f"-DCUDA_cublas_LIBRARY={tk.root / 'lib' / 'libcublas.so.13'}",
        f"-DCUDA_cudart_LIBRARY={tk.root / 'lib' / 'libcudart.so.13'}",
    ):
        assert flag in args, flag


@pytest.mark.parametrize(
    ("without", "package"),
    [
        (("lib/libcublas", "include/cublas"), "nvidia-cublas"),
        (("include/cccl",), "nvidia-cuda-cccl"),
        (("lib/libcudart", "include/cuda_runtime"), "nvidia-cuda-runtime"),
        (("bin/nvcc",), "nvidia-cuda-nvcc"),
    ],
)
def test_a_missing_piece_names_its_package(
    tmp_path: Path, without: tuple[str, ...], package: str
) -> None:
    tk = wheel_tree(tmp_path, without)
    assert missing_pieces(tk) == [package]
    with pytest.raises(BuildError) as e:
        tc.cuda_toolkit(no_nvcc, {}, lambda p: False, tk)
    assert package in str(e.value) and f"pip install {package}" in e.value.hint


def test_no_toolkit_at_all_names_every_package() -> None:
    with pytest.raises(BuildError) as e:
        tc.cuda_toolkit(no_nvcc, {}, lambda p: False, None)
    assert "pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cublas" in e.value.hint


def test_incomplete_wheels_fall_back_to_a_system_nvcc(tmp_path: Path) -> None:
    tk = wheel_tree(tmp_path, ("lib/libcublas",))
    nvcc, found = tc.cuda_toolkit(lambda n: "/usr/bin/nvcc", {}, lambda p: False, tk)
    assert (nvcc, found) == ("/usr/bin/nvcc", None)
    args = tc.cmake_args("cuda", system="Linux", cuda_compiler=nvcc, cuda_arch="86")
    assert "-DCMAKE_CUDA_ARCHITECTURES=86" in args and "-DGGML_CUDA_NO_VMM=ON" not in args


def test_the_wheel_nvcc_with_a_gpu_picks_cuda(tmp_path: Path) -> None:
    tk = wheel_tree(tmp_path)
    choice = tc.detect_backend(
        which=no_nvcc, env={}, system="Linux", exists=lambda p: False,
        gpu_count=lambda: 1, wheels=tk,
    )  # fmt: skip
    assert choice.backend == "cuda" and str(tk.nvcc) in choice.reason


class FakeNvml:
    def __init__(self, cc: tuple[int, int] | None) -> None:
        self.cc = cc

    def nvmlInit(self) -> None:
        if self.cc is None:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return i

    def nvmlDeviceGetCudaComputeCapability(self, h: Any) -> tuple[int, int]:
        assert self.cc is not None
        return self.cc


def test_architecture_from_nvml_else_the_default() -> None:
    assert cuda_architecture(FakeNvml((9, 0))) == "90"  # H100/H200
    assert cuda_architecture(FakeNvml((8, 9))) == "89"
    assert cuda_architecture(FakeNvml(None)) == DEFAULT_ARCH == "75"


def test_old_vulkan_headers_get_the_compat_pre_include(tmp_path: Path) -> None:
    inc = tmp_path / "include" / "vulkan"
    inc.mkdir(parents=True)
    (inc / "vulkan_core.h").write_text("#define VK_HEADER_VERSION 239\n")
    assert tc.vulkan_header_version({"VULKAN_SDK": str(tmp_path)}) == 239
    args = tc.cmake_args("vulkan", system="Linux", vulkan_headers=239)
    assert f"-DCMAKE_CXX_FLAGS=-include {tc.VULKAN_COMPAT_HEADER}" in args
    assert any(a.startswith(f"-D{tc.VULKAN_COMPAT_VAR}=") for a in args)
    assert tc.vulkan_compat_source().is_file()
    # No absolute path in the flags: the build id does not depend on the install location.
    assert not any(str(tc.vulkan_compat_source().parent) in a for a in args)
    assert tc.cmake_args("vulkan", system="Linux", vulkan_headers=290) == tc.cmake_args(
        "vulkan", system="Linux"
    )
