"""What the machine offers: GPU memory via NVML or llama.cpp, host RAM and swap, free disk.

`read_gpus` returns ``[]`` quietly when NVML is missing (no NVIDIA driver, a
CPU-only machine, macOS). Tests pass a fake `nvml` object with the few pynvml
functions used here. `read_llama_devices` asks a llama-server binary for its own
device list (``--list-devices``: any backend — Vulkan, ROCm, Metal, CUDA — with the
free memory its allocator sees, the numbers llama.cpp's ``--fit`` plans with);
`parse_device_list` reads that output. `gpus_for` is the one place that picks: NVML
when it sees a GPU, else the binary's list, else none (plan for host memory only).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]  # stubs: types-psutil

__all__ = [
    "GpuInfo",
    "HostInfo",
    "gpus_for",
    "parse_device_list",
    "read_gpus",
    "read_host",
    "read_llama_devices",
]

log = logging.getLogger("warmslot.fit")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML (or llama.cpp's device list) reports it, memory in bytes."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    source: str = "nvml"
    """``nvml``, or ``llama.cpp`` for a device from ``llama-server --list-devices``."""
    device: str = ""
    """llama.cpp's name for it (``CUDA0``, ``Vulkan0``, ``ROCm0``, ``MTL0``) when known."""

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able form (the fields by name)."""
        return asdict(self)


@dataclass(frozen=True)
class HostInfo:
    """Host memory and the free disk space of the state directory, in bytes."""

    ram_total: int
    ram_available: int
    swap_total: int
    swap_free: int
    disk_free_state: int

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able form (the fields by name)."""
        return asdict(self)


def read_gpus(nvml: Any = None) -> list[GpuInfo]:
    """Every NVIDIA GPU's total and free memory; ``[]`` when NVML is unavailable.

    `nvml` is the `pynvml` module (package nvidia-ml-py) or a stand-in with
    `nvmlInit`, `nvmlShutdown`, `nvmlDeviceGetCount`, `nvmlDeviceGetHandleByIndex`,
    `nvmlDeviceGetName` and `nvmlDeviceGetMemoryInfo`.
    """
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            log.debug("pynvml is not installed: planning without GPUs")
            return []
        nvml = pynvml
    # Any failure means "no usable NVIDIA GPU" (no driver, no device, a driver
    # and library that disagree); planning for host memory is the safe fallback.
    try:
        nvml.nvmlInit()
    except Exception as e:
        log.debug("NVML unavailable (%s): planning without GPUs", e)
        return []
    gpus: list[GpuInfo] = []
    try:
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):  # older pynvml returns bytes
                name = name.decode("utf-8", errors="replace")
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(i, str(name), int(mem.total), int(mem.free)))
    except Exception as e:
        log.warning("reading GPU memory through NVML failed (%s): planning without GPUs", e)
        return []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as e:
            log.debug("nvmlShutdown failed: %s", e)
    return gpus


# "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (23105 MiB, 23105 MiB free)" (common/arg.cpp)
_DEVICE_LINE = re.compile(
    r"^\s+(?P<dev>[A-Za-z][\w-]*?\d+): (?P<desc>.*) "
    r"\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)
_MIB = 1 << 20
# CUDA or Vulkan start within seconds; a hung binary must not stall a launch for long.
DEVICE_LIST_TIMEOUT_S = 20.0
_DEVICELESS: set[tuple[str, int, int]] = set()  # binaries (path, size, mtime) that list none


def parse_device_list(text: str) -> list[GpuInfo]:
    """The devices of ``llama-server --list-devices`` output (``(none)``: ``[]``).

    RPC devices (``RPC0`` …) are left out: they are workers, planned for by
    `core.server.rpc_fit`, not memory of this machine.
    """
    out: list[GpuInfo] = []
    for line in text.splitlines():
        m = _DEVICE_LINE.match(line)
        if m is None or m["dev"].upper().startswith("RPC"):
            continue
        out.append(
            GpuInfo(
                index=len(out),
                name=m["desc"].strip(),
                total_bytes=int(m["total"]) * _MIB,
                free_bytes=int(m["free"]) * _MIB,
                source="llama.cpp",
                device=m["dev"],
            )
        )
    return out


def read_llama_devices(
    binary: Path, env: Mapping[str, str] | None = None, *, timeout: float = DEVICE_LIST_TIMEOUT_S
) -> list[GpuInfo]:
    """The devices `binary` would offload to, with their free memory (blocking).

    ``[]`` for a CPU-only build, or when the binary does not answer: planning then
    treats the machine as having no GPU, which is what such a server would use. A binary
    that listed none is not asked again (the same file never grows a backend): the pressure
    monitor asks every minute, and a CPU build is the common case.
    """
    try:
        st = binary.stat()
        key = (str(binary), st.st_size, st.st_mtime_ns)
    except OSError:
        return []
    if key in _DEVICELESS:
        return []
    try:
        proc = subprocess.run(
            [str(binary), "--list-devices"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("%s --list-devices failed (%s): planning without GPUs", binary, e)
        return []
    found = parse_device_list(proc.stdout)
    if not found and proc.returncode == 0:
        _DEVICELESS.add(key)
    return found


def gpus_for(
    binary: Path | None, env: Mapping[str, str] | None = None, *, nvml: Any = None
) -> list[GpuInfo]:
    """The GPUs to plan with: NVML's when it sees one (cheap, and what CUDA uses), else
    the devices `binary` reports (Vulkan, ROCm, Metal — devices NVML cannot see), else
    none."""
    found = read_gpus(nvml)
    if found or binary is None:
        return found
    return read_llama_devices(binary, env)


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (the state dir may not exist yet)."""
    path = path.expanduser().absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def read_host(state_dir: Path) -> HostInfo:
    """RAM and swap from psutil, and the free space where slot files will go."""
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    disk = shutil.disk_usage(_existing(Path(state_dir)))
    return HostInfo(
        ram_total=int(vm.total),
        ram_available=int(vm.available),
        swap_total=int(sw.total),
        swap_free=int(sw.free),
        disk_free_state=int(disk.free),
    )
