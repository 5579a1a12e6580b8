"""CUDA builds that compile: llama.cpp's CUDA backend configured and compiled with the toolkit
from PyPI wheels (nvidia-cuda-nvcc, -runtime, -cublas, -cccl in Warmslot's environment), for the
one architecture Warmslot chooses (NVML's compute capability, else 75), without a GPU.

Slow and opt-in: set ``WARMSLOT_SLOW_TESTS=1``; skips, naming the packages, when the wheels are
not installed (``pip install warmslot[cuda]``). The configure step and one CUDA object of
ggml-cuda run by default here (a few minutes on 2 cores); ``WARMSLOT_CUDA_FULL_BUILD=1``
compiles and links the whole llama-server instead (hours on 2 cores; docs/gpu.md).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from core.build import BuildRequest, build_sync
from core.build.compile import generator_args
from core.build.cuda_wheels import PACKAGES, find_wheel_toolkit, missing_pieces
from core.build.plan import make_plan
from core.build.toolchain import tool_path
from core.paths import Paths
from tests.conftest import test_cache as cache_dir

pytestmark = [
    pytest.mark.slow("configures and compiles llama.cpp's CUDA backend"),
    pytest.mark.integration,
    pytest.mark.timeout(14400),
]

GPU_HOME = "gpu-home"
# A small CUDA translation unit of ggml-cuda: proves nvcc, the headers and the architecture.
ONE_OBJECT = "ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/acc.cu.o"


@pytest.fixture(scope="module")
def home() -> Paths:
    tk = find_wheel_toolkit()
    missing = list(PACKAGES) if tk is None else missing_pieces(tk)
    if missing:
        pytest.skip(f"no complete CUDA toolkit from PyPI wheels: pip install {' '.join(missing)}")
    return Paths.under(cache_dir() / GPU_HOME)


def test_cuda_configure_and_one_object_compile(home: Paths, tmp_path: Path) -> None:
    notes: list[str] = []
    plan = make_plan(BuildRequest(backend="cuda", patches=False), home, notes.append)
    assert plan.backend.backend == "cuda"
    assert any("PyPI wheels" in n for n in notes), notes
    args = plan.cmake_args
    arch = next(a.split("=", 1)[1] for a in args if a.startswith("-DCMAKE_CUDA_ARCHITECTURES="))
    src, build = tmp_path / "src", tmp_path / "build"
    plan.resolved.export(src)
    env = {**os.environ, "PATH": tool_path()}
    t0 = time.monotonic()
    cfg = subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build), *generator_args(), *args],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    configured = time.monotonic() - t0
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    assert "Including CUDA backend" in cfg.stdout
    assert f"CMAKE_CUDA_ARCHITECTURES={arch}" in cfg.stdout
    t1 = time.monotonic()
    obj = subprocess.run(
        ["nice", "-n", "19", "cmake", "--build", str(build), "--target", ONE_OBJECT],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert obj.returncode == 0, obj.stdout[-3000:] + obj.stderr[-3000:]
    out = build / ONE_OBJECT
    assert out.is_file() and out.stat().st_size > 0
    print(
        f"\nCUDA from wheels, sm_{arch}: configure {configured:.0f} s, "
        f"{ONE_OBJECT.rsplit('/', 1)[1]} {time.monotonic() - t1:.0f} s ({out.stat().st_size:,} B)"
    )


def test_cuda_full_build(home: Paths) -> None:
    if os.environ.get("WARMSLOT_CUDA_FULL_BUILD") != "1":
        pytest.skip(
            "the whole CUDA llama-server takes hours on 2 cores: WARMSLOT_CUDA_FULL_BUILD=1"
        )
    rec = build_sync(BuildRequest(backend="cuda", purpose="CUDA build test"), home)
    assert rec.backend == "cuda" and rec.binary.is_file()
    ver = subprocess.run([str(rec.binary), "--version"], capture_output=True, text=True)
    assert ver.returncode == 0, ver.stderr
