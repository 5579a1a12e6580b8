"""The disk under a benchmark's slot files: the page cache and the read bandwidth.

A restore is timed once with its file dropped from the page cache (``fsync``, then
``posix_fadvise(DONTNEED)``; the share still cached is measured with ``mincore``) and
once with it cached; the disk's read bandwidth is measured on a scratch file beside
the slot files, so each restore can be compared with the time the file alone takes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
import uuid
from pathlib import Path

from core.bench.restore_report import Bandwidth, FileRead

__all__ = ["cached_fraction", "drop_cache", "file_read", "measure_bandwidth", "read_file_ms"]


def drop_cache(path: Path) -> None:
    """Write the file's dirty pages and drop it from the page cache (best effort: the
    kernel may keep pages another process maps; `cached_fraction` says what stayed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """The share of the file's pages in the page cache (``mincore``), or None where it
    cannot be asked."""
    size = path.stat().st_size
    if size == 0:
        return 1.0
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable: from_buffer needs it
        try:
            buf = (ctypes.c_char * size).from_buffer(mm)
            vec = (ctypes.c_ubyte * pages)()
            try:
                rc = libc.mincore(
                    ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec
                )
            finally:
                del buf  # the mmap cannot close while a buffer exports it
        finally:
            mm.close()
    if rc != 0:
        return None
    return sum(v & 1 for v in vec) / pages


def read_file_ms(path: Path) -> float:
    """Milliseconds to read the whole file sequentially (8 MiB reads, no hashing)."""
    t0 = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    return (time.perf_counter() - t0) * 1000


def measure_bandwidth(folder: Path, nbytes: int) -> Bandwidth:
    """Read bandwidth (MB/s) of the filesystem under `folder`: a scratch file of `nbytes`,
    written, synced, dropped from the page cache and read (cold), then read again
    (cached). The file is deleted afterwards."""
    path = folder / f"bench-bandwidth-{uuid.uuid4().hex}.tmp"
    chunk = os.urandom(8 << 20)
    try:
        with path.open("wb") as f:
            written = 0
            while written < nbytes:
                f.write(chunk)
                written += len(chunk)
        drop_cache(path)
        left = cached_fraction(path)
        cold_ms = read_file_ms(path)
        warm_ms = read_file_ms(path)
        size = path.stat().st_size
    finally:
        path.unlink(missing_ok=True)
    return {
        "bytes": size,
        "cold_cached_fraction": left,
        "cold_ms": round(cold_ms, 1),
        "cold_mb_s": round(size / 1e3 / cold_ms, 1),
        "warm_ms": round(warm_ms, 1),
        "warm_mb_s": round(size / 1e3 / warm_ms, 1),
    }


def file_read(path: Path, *, cold: bool) -> FileRead:
    """One sequential read of `path`, from the disk (`cold`: dropped from the page cache
    first) or from memory, with the share of it cached before."""
    if cold:
        drop_cache(path)
    left = cached_fraction(path)
    return {"ms": round(read_file_ms(path), 2), "cached_fraction_before": left}
