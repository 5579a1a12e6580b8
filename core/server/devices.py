"""What the machine offers: GPU memory via NVML, host RAM and swap, free disk.

`read_gpus` returns ``[]`` quietly when NVML is missing (no NVIDIA driver, a
CPU-only machine, macOS): the planner then plans for host memory only. Tests
pass a fake `nvml` object with the few pynvml functions used here.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]  # stubs: types-psutil

__all__ = ["GpuInfo", "HostInfo", "read_gpus", "read_host"]

log = logging.getLogger("warmslot.fit")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it, memory in bytes."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int

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
