"""Memory pressure: sampling, levels, and what each level pauses.

Every `pressure.sample_interval_s` (default 5 s) the pressure sweep reads
available RAM and swap (psutil), each GPU's free memory (NVML through
`core.machine.devices.read_gpus`; no GPU or no driver is not an error; a GPU NVML
cannot see — Vulkan, ROCm, Metal — from the running llama-server binary's own device
list, `core.machine.devices.read_llama_devices`, at most every `LLAMA_DEVICES_EVERY_S`
because each read starts a process that opens the devices), the
llama-server process's RSS and the free space of the filesystems that hold the
slot files (llama-server's ``--slot-save-path``, where a full disk breaks saves)
and the state directory (the database), the fuller of the two counting. Each
sample is a `PressureSample` event (the telemetry keeps them; samples older
than an hour are thinned to the worst one per minute, and uneventful sweep runs
to one per sweep per 10 minutes).

Levels, from the thresholds in `PressureSettings` (defaults: available RAM
< 15 % → low, < 5 % → critical; free VRAM < 10 % / 3 %; free disk < 10 % / 3 %):

- ``nominal``: everything runs.
- ``low``: no prewarm or restore of prefixes that are not pinned; keep-alive
  only for pinned prefixes.
- ``critical``: also no new state is persisted to disk, and idle sessions are
  released first (at the short TTL instead of their class's).

A level is left only once the reading is `HYSTERESIS_PCT` points clear of the
threshold, so a reading hovering at a threshold does not flap. Level changes
are `PressureChanged` events; `paused()` says in words what is paused and why
("keep-alive paused except for pinned prefixes: RAM critical").
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]  # stubs: types-psutil

from core.clock import Clock
from core.config import PressureSettings
from core.events import Event, PressureChanged, PressureSample
from core.machine.devices import GpuInfo, read_gpus
from core.machine.sweeps import thin_runs
from core.status import PressureSnapshot

__all__ = [
    "LEVELS",
    "Cause",
    "PressureMonitor",
    "Reading",
    "Sampler",
    "assess",
    "downsample",
]

log = logging.getLogger("warmslot.pressure")

LEVELS = ("nominal", "low", "critical")
HYSTERESIS_PCT = 1.0
DOWNSAMPLE_AFTER_S = 3600.0  # samples older than this …
DOWNSAMPLE_BUCKET_S = 60.0  # … keep one (the worst) per bucket
DOWNSAMPLE_EVERY_S = 600.0
GPU_RECHECK_S = 3600.0  # after NVML found no GPU, ask again this often
LLAMA_DEVICES_EVERY_S = 60.0  # llama.cpp's device list: a process per read, so not every sample


@dataclass(frozen=True)
class Reading:
    """One look at the machine; sizes in bytes."""

    ram_total: int
    ram_available: int
    swap_total: int
    swap_used: int
    server_rss: int | None
    disk_total: int
    disk_free: int
    gpus: tuple[GpuInfo, ...] = ()
    disk_path: str = ""  # the watched directory whose filesystem is the fullest

    @property
    def ram_available_pct(self) -> float:
        return 100.0 * self.ram_available / self.ram_total if self.ram_total else 100.0

    @property
    def swap_used_pct(self) -> float:
        return 100.0 * self.swap_used / self.swap_total if self.swap_total else 0.0

    @property
    def disk_free_pct(self) -> float:
        return 100.0 * self.disk_free / self.disk_total if self.disk_total else 100.0


@dataclass(frozen=True)
class Cause:
    """One resource below a threshold."""

    resource: str  # "RAM", "disk", "GPU 0 VRAM"
    level: str
    pct: float
    threshold: float
    what: str  # "available" / "free"

    @property
    def label(self) -> str:
        return f"{self.resource} {self.level}"

    @property
    def detail(self) -> str:
        return f"{self.label}: {self.pct:.1f} % {self.what} (< {self.threshold:g} %)"


def _rank(level: str) -> int:
    return LEVELS.index(level)


def assess(r: Reading, s: PressureSettings, margin: float = 0.0) -> tuple[str, tuple[Cause, ...]]:
    """The level a reading implies and the resources that cause it (worst first).

    `margin` raises every threshold by that many points (used for hysteresis).
    """
    checks: list[tuple[str, float, float, float, str]] = [
        ("RAM", r.ram_available_pct, s.ram_low_pct, s.ram_critical_pct, "available"),
        ("disk", r.disk_free_pct, s.disk_low_pct, s.disk_critical_pct, "free"),
    ]
    for g in r.gpus:
        pct = 100.0 * g.free_bytes / g.total_bytes if g.total_bytes else 100.0
        checks.append((f"GPU {g.index} VRAM", pct, s.vram_low_pct, s.vram_critical_pct, "free"))
    causes: list[Cause] = []
    for resource, pct, low, critical, what in checks:
        if pct < critical + margin:
            causes.append(Cause(resource, "critical", pct, critical, what))
        elif pct < low + margin:
            causes.append(Cause(resource, "low", pct, low, what))
    causes.sort(key=lambda c: -_rank(c.level))
    level = causes[0].level if causes else "nominal"
    return level, tuple(causes)


class Sampler:
    """Reads a `Reading`; every source is injectable for tests.

    `watch` is the directory whose filesystem's free space counts, or several (the slot
    directory first, then the state directory), or a callable that names them at each
    sample (the engine's: the ``--slot-save-path`` of every running server, which moves
    with each server identity): each distinct filesystem is read and the one with the
    least free share is reported.

    `server_pid` gives the llama-server pid, or several (every server Warmslot
    runs: their RSS is summed), or None while none runs.
    `ps` is the psutil module or a stand-in with `virtual_memory()`,
    `swap_memory()` and `Process(pid).memory_info().rss`; `nvml` is passed to
    `read_gpus` (None: the real pynvml, if installed); `gpus=False` skips GPUs.
    `devices` lists the GPUs NVML cannot see (llama.cpp's device list of the running
    binary, `core.machine.devices.read_llama_devices`); it is asked only while NVML sees
    none, at most every `LLAMA_DEVICES_EVERY_S`, and its last answer is reused between.
    """

    def __init__(
        self,
        watch: Path | Sequence[Path] | Callable[[], Sequence[Path]],
        server_pid: Callable[[], int | Iterable[int] | None],
        *,
        ps: Any = psutil,
        nvml: Any = None,
        gpus: bool = True,
        devices: Callable[[], Sequence[GpuInfo]] | None = None,
        disk_usage: Callable[[Path], Any] = shutil.disk_usage,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._watch = watch
        self.server_pid = server_pid
        self.ps = ps
        self.nvml = nvml
        self.gpus_enabled = gpus
        self.disk_usage = disk_usage
        self._clock = clock
        self._no_gpu_since: float | None = None
        self.devices = devices
        self._llama_read_at: float | None = None
        self._llama_last: tuple[GpuInfo, ...] = ()

    @property
    def watch(self) -> tuple[Path, ...]:
        """The directories watched now."""
        w = self._watch
        if isinstance(w, Path):
            return (w,)
        return tuple(w() if callable(w) else w)

    def _existing_dirs(self) -> list[Path]:
        """Each watched directory (or its nearest existing parent), one per filesystem."""
        found: list[Path] = []
        devices: set[int] = set()
        for want in self.watch:
            path = want.expanduser().absolute()
            while not path.exists() and path.parent != path:
                path = path.parent
            try:
                dev = path.stat().st_dev
            except OSError:
                continue
            if dev not in devices:
                devices.add(dev)
                found.append(path)
        return found

    def _disk(self) -> tuple[int, int, str]:
        """(total, free, path) of the watched filesystem with the least free share."""
        worst: tuple[int, int, str] | None = None
        for path in self._existing_dirs():
            try:
                du = self.disk_usage(path)
            except OSError:
                continue
            total, free = int(du.total), int(du.free)
            share = free / total if total else 1.0
            if worst is None or share < (worst[1] / worst[0] if worst[0] else 1.0):
                worst = (total, free, str(path))
        return worst or (0, 0, "")

    def _server_rss(self) -> int | None:
        found = self.server_pid()
        pids = [found] if isinstance(found, int) else list(found or ())
        total: int | None = None
        for pid in pids:
            try:
                rss = int(self.ps.Process(pid).memory_info().rss)
            except Exception:  # gone between the check and the read, or not ours to read
                continue
            total = (total or 0) + rss
        return total

    def _gpus(self) -> tuple[GpuInfo, ...]:
        if not self.gpus_enabled:
            return ()
        now = self._clock() if self._clock is not None else 0.0
        if self._no_gpu_since is None or now - self._no_gpu_since >= GPU_RECHECK_S:
            found = tuple(read_gpus(self.nvml))
            self._no_gpu_since = None if found else now
            if found:
                return found
        return self._other_devices(now)

    def _other_devices(self, now: float) -> tuple[GpuInfo, ...]:
        if self.devices is None:
            return ()
        due = self._llama_read_at is None or now - self._llama_read_at >= LLAMA_DEVICES_EVERY_S
        if due:
            self._llama_read_at = now
            try:
                self._llama_last = tuple(self.devices())
            except Exception as e:  # a failed read is "no GPU seen", never a failed sample
                log.debug("llama.cpp device list failed: %s", e)
                self._llama_last = ()
        return self._llama_last

    def read(self) -> Reading:
        vm = self.ps.virtual_memory()
        sw = self.ps.swap_memory()
        disk_total, disk_free, disk_path = self._disk()
        return Reading(
            ram_total=int(vm.total),
            ram_available=int(vm.available),
            swap_total=int(sw.total),
            swap_used=int(sw.used),
            server_rss=self._server_rss(),
            disk_total=disk_total,
            disk_free=disk_free,
            gpus=self._gpus(),
            disk_path=disk_path,
        )


# What each level pauses, keyed by behaviour; the level's causes are appended.
_PAUSED = {
    "low": {
        "prewarm": "prewarm paused except for pinned prefixes",
        "keepalive": "keep-alive paused except for pinned prefixes",
    },
    "critical": {
        "prewarm": "prewarm paused except for pinned prefixes",
        "keepalive": "keep-alive paused except for pinned prefixes",
        "persist": "persisting new state paused",
        "idle": "idle sessions released first (at the short TTL)",
    },
}


class PressureMonitor:
    """The current pressure level, the gates it implies, and the sampling sweep."""

    def __init__(
        self,
        settings: Callable[[], PressureSettings],
        sampler: Sampler | None,
        emit: Callable[[Event], None],
        clock: Clock,
        *,
        telemetry: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.sampler = sampler
        self._emit = emit
        self.clock = clock
        self._telemetry = telemetry
        self.level = "nominal"
        self.causes: tuple[Cause, ...] = ()
        self.last: Reading | None = None
        self.last_at: float | None = None
        self._last_downsample = clock.time()

    # ------------------------------------------------------------ gates
    def allows_prewarm(self, pinned: bool) -> bool:
        """Prewarm or restore a prefix now? (under low/critical: pinned ones only)"""
        return pinned or self.level == "nominal"

    def allows_keepalive(self, pinned: bool) -> bool:
        return pinned or self.level == "nominal"

    def allows_persist(self) -> bool:
        """Write new state to disk now? (not under critical)"""
        return self.level != "critical"

    @property
    def release_idle_first(self) -> bool:
        return self.level == "critical"

    @property
    def why(self) -> str:
        """The short cause of the current level ("RAM critical, disk low"), or ""."""
        return ", ".join(c.label for c in self.causes)

    def paused(self) -> dict[str, str]:
        """Behaviour → what is paused and why, in words; empty when nominal."""
        texts = _PAUSED.get(self.level, {})
        return {k: f"{v}: {self.why}" for k, v in texts.items()}

    # ------------------------------------------------------------ sampling
    def update(self, reading: Reading) -> PressureSample:
        """Take a reading: new level (with hysteresis), sample event, change event."""
        s = self.settings()
        raw, causes = assess(reading, s)
        level = raw
        if _rank(raw) < _rank(self.level):  # stepping down: only when clear of the threshold
            held, held_causes = assess(reading, s, HYSTERESIS_PCT)
            if _rank(held) > _rank(raw):
                level = LEVELS[min(_rank(self.level), _rank(held))]
                causes = tuple(c for c in held_causes if _rank(c.level) <= _rank(level))
        previous = self.level
        self.level, self.causes = level, causes
        self.last, self.last_at = reading, self.clock.time()
        sample = PressureSample(
            level=level,
            ram_available_pct=round(reading.ram_available_pct, 3),
            swap_used_pct=round(reading.swap_used_pct, 3),
            server_rss_bytes=reading.server_rss,
            disk_free_pct=round(reading.disk_free_pct, 3),
            gpus=tuple((g.index, g.total_bytes, g.free_bytes) for g in reading.gpus),
            ts=self.clock.time(),
        )
        self._emit(sample)
        if level != previous:
            paused = tuple(self.paused().values())
            log.warning(
                "memory pressure %s → %s (%s)",
                previous,
                level,
                "; ".join(c.detail for c in causes) or "all clear",
            )
            self._emit(
                PressureChanged(
                    level=level,
                    previous=previous,
                    reasons=tuple(c.detail for c in causes),
                    paused=paused,
                    ts=self.clock.time(),
                )
            )
        return sample

    async def sample(self) -> int:
        """The sweep: read (off the loop: NVML and psutil may block), update, thin old rows."""
        if self.sampler is None:
            return 0
        loop = asyncio.get_running_loop()
        previous = self.level
        reading = await loop.run_in_executor(None, self.sampler.read)
        self.update(reading)
        actions = int(self.level != previous)
        now = self.clock.time()
        tel = self._telemetry() if self._telemetry is not None else None
        if tel is not None and now - self._last_downsample >= DOWNSAMPLE_EVERY_S:
            self._last_downsample = now
            downsample(tel, now)
            thin_runs(tel, now)  # this sweep's own (mostly uneventful) run records too
        return actions

    def snapshot(self) -> PressureSnapshot:
        """The last sample and what it caused, for status displays."""
        r = self.last
        return {
            "level": self.level,
            "causes": [c.detail for c in self.causes],
            "paused": self.paused(),
            "sampled_at": self.last_at,
            "ram_available_pct": round(r.ram_available_pct, 1) if r else None,
            "swap_used_pct": round(r.swap_used_pct, 1) if r else None,
            "disk_free_pct": round(r.disk_free_pct, 1) if r else None,
            "disk_free_bytes": r.disk_free if r else None,
            "disk_path": r.disk_path if r else None,
            "server_rss_bytes": r.server_rss if r else None,
            "gpus": [g.to_dict() for g in r.gpus] if r else [],
        }


def downsample(
    tel: Any,
    now: float,
    *,
    older_than: float = DOWNSAMPLE_AFTER_S,
    bucket: float = DOWNSAMPLE_BUCKET_S,
) -> int:
    """Thin pressure samples older than `older_than` to the worst one per `bucket` seconds.

    "Worst" is the lowest available RAM (ties: the earliest). `tel` is a
    `core.telemetry.Telemetry`. Returns the number of rows deleted.
    """
    tel.flush()
    cutoff = now - older_than
    cur = tel.db.execute(
        """DELETE FROM pressure WHERE ts < ? AND id NOT IN (
               SELECT id FROM (
                   SELECT id, ROW_NUMBER() OVER (
                       PARTITION BY CAST(ts / ? AS INTEGER)
                       ORDER BY ram_available_pct ASC, ts ASC, id ASC) AS rn
                   FROM pressure WHERE ts < ?)
               WHERE rn = 1)""",
        [cutoff, bucket, cutoff],
    )
    return int(cur.rowcount)
