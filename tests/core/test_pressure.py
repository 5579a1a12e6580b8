"""Memory pressure: readings from fake psutil/NVML, levels, events, gates, downsampling."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.cache import warmup
from core.cache.fingerprint import state_filename
from core.clock import FakeClock
from core.config import PressureSettings
from core.events import CacheEvent, Event, PressureChanged, PressureSample
from core.machine.devices import GpuInfo
from core.machine.pressure import PressureMonitor, Reading, Sampler, assess, downsample
from core.telemetry import Telemetry
from tests.core.bg_support import add_state, make_manager, prefix

GB = 1 << 30


class FakePsutil:
    """The three psutil calls the sampler makes, with numbers a test sets."""

    def __init__(self, total: int = 16 * GB, available: int = 8 * GB) -> None:
        self.total, self.available = total, available
        self.swap_total, self.swap_used = 4 * GB, 1 * GB
        self.rss: dict[int, int] = {4242: 3 * GB}

    def virtual_memory(self) -> Any:
        return SimpleNamespace(total=self.total, available=self.available)

    def swap_memory(self) -> Any:
        return SimpleNamespace(total=self.swap_total, used=self.swap_used)

    def Process(self, pid: int) -> Any:
        if pid not in self.rss:
            raise ProcessLookupError(pid)
        return SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=self.rss[pid]))


class FakeNvml:
    """pynvml's few functions over a list of (total, free) per GPU."""

    def __init__(self, gpus: list[tuple[int, int]] | None = None, fail: bool = False) -> None:
        self.gpus = gpus or []
        self.fail = fail
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"Fake GPU"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        total, free = self.gpus[h]
        return SimpleNamespace(total=total, free=free, used=total - free)


def disk(total: int = 100 * GB, free: int = 50 * GB) -> Any:
    return lambda path: SimpleNamespace(total=total, used=total - free, free=free)


def reading(
    ram_pct: float = 50.0, disk_pct: float = 50.0, gpus: tuple[GpuInfo, ...] = ()
) -> Reading:
    return Reading(
        ram_total=1000,
        ram_available=int(ram_pct * 10),
        swap_total=0,
        swap_used=0,
        server_rss=None,
        disk_total=1000,
        disk_free=int(disk_pct * 10),
        gpus=gpus,
    )


@pytest.mark.parametrize(
    "ram,level",
    [(50, "nominal"), (15.1, "nominal"), (14.9, "low"), (5.1, "low"), (4.9, "critical")],
)
def test_ram_thresholds(ram: float, level: str) -> None:
    got, causes = assess(reading(ram), PressureSettings())
    assert got == level
    if level != "nominal":
        assert causes[0].label == f"RAM {level}"


def test_vram_and_disk_thresholds_and_worst_wins() -> None:
    s = PressureSettings()
    gpu_low = GpuInfo(0, "g", 100, 9)  # 9 % free < 10 %
    gpu_crit = GpuInfo(1, "g", 100, 2)
    assert assess(reading(gpus=(gpu_low,)), s)[0] == "low"
    level, causes = assess(reading(disk_pct=9, gpus=(gpu_low, gpu_crit)), s)
    assert level == "critical"
    assert [c.label for c in causes] == ["GPU 1 VRAM critical", "disk low", "GPU 0 VRAM low"]
    assert causes[0].detail == "GPU 1 VRAM critical: 2.0 % free (< 3 %)"


def test_sampler_reads_fake_psutil_nvml_and_disk(tmp_path: Path) -> None:
    ps = FakePsutil(total=16 * GB, available=2 * GB)
    nvml = FakeNvml([(24 * GB, 6 * GB)])
    pid: list[int | None] = [4242]
    sampler = Sampler(
        tmp_path / "state" / "not-yet", lambda: pid[0], ps=ps, nvml=nvml, disk_usage=disk()
    )
    r = sampler.read()
    assert r.ram_available_pct == 12.5 and r.swap_used_pct == 25.0
    assert r.server_rss == 3 * GB and r.disk_free_pct == 50.0
    assert r.gpus == (GpuInfo(0, "Fake GPU", 24 * GB, 6 * GB),)
    pid[0] = 999  # the server went away between the check and the read
    assert sampler.read().server_rss is None
    pid[0] = None
    assert sampler.read().server_rss is None


def test_absent_gpus_are_quiet_and_not_asked_every_sample(tmp_path: Path, caplog: Any) -> None:
    clock = FakeClock()
    nvml = FakeNvml(fail=True)
    sampler = Sampler(
        tmp_path, lambda: None, ps=FakePsutil(), nvml=nvml, disk_usage=disk(), clock=clock.monotonic
    )
    caplog.set_level("WARNING")
    assert sampler.read().gpus == ()
    assert sampler.read().gpus == ()
    assert nvml.inits == 1  # not again until GPU_RECHECK_S has passed
    assert not caplog.records


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, e: Event) -> None:
        self.events.append(e)

    def of(self, t: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, t)]


async def test_level_changes_are_events_with_hysteresis(tmp_path: Path) -> None:
    clock = FakeClock()
    ps = FakePsutil(total=1000, available=500)
    rec = Recorder()
    sampler = Sampler(tmp_path, lambda: None, ps=ps, gpus=False, disk_usage=disk())
    mon = PressureMonitor(PressureSettings, sampler, rec, clock)
    levels = []
    for avail in (500, 140, 40, 55, 62, 155, 165, 170):  # per mille of RAM available
        ps.available = avail
        await mon.sample()
        levels.append(mon.level)
    # 5.5 % stays critical (within 1 point of 5 %); 15.5 % stays low; 16.5 % clears.
    assert levels == ["nominal", "low", "critical", "critical", "low", "low", "nominal", "nominal"]
    changes = rec.of(PressureChanged)
    assert [(c.previous, c.level) for c in changes] == [
        ("nominal", "low"),
        ("low", "critical"),
        ("critical", "low"),
        ("low", "nominal"),
    ]
    assert changes[1].reasons == ("RAM critical: 4.0 % available (< 5 %)",)
    assert "keep-alive paused except for pinned prefixes: RAM critical" in changes[1].paused
    samples = rec.of(PressureSample)
    assert len(samples) == 8 and samples[2].level == "critical"
    assert samples[0].ts == clock.time()


def test_gates_per_level() -> None:
    mon = PressureMonitor(PressureSettings, None, lambda e: None, FakeClock())
    table = {}
    for avail in (50.0, 10.0, 2.0):
        mon.update(reading(avail))
        table[mon.level] = (
            mon.allows_prewarm(False),
            mon.allows_prewarm(True),
            mon.allows_keepalive(False),
            mon.allows_keepalive(True),
            mon.allows_persist(),
            mon.release_idle_first,
        )
    assert table == {
        "nominal": (True, True, True, True, True, False),
        "low": (False, True, False, True, True, False),
        "critical": (False, True, False, True, False, True),
    }
    assert mon.paused() == {
        "prewarm": "prewarm paused except for pinned prefixes: RAM critical",
        "keepalive": "keep-alive paused except for pinned prefixes: RAM critical",
        "persist": "persisting new state paused: RAM critical",
        "idle": "idle sessions released first (at the short TTL): RAM critical",
    }


async def test_manager_honours_the_gates_and_status_says_why(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    info = prefix(list(range(1, 41)))
    mgr.state.by_fp[info.fingerprint] = info
    mgr.state.pressure.update(reading(ram_pct=10))  # low
    rec = add_state(core, mgr, name_seed="x", fp=info.fingerprint)
    await warmup.restore_or_prewarm(mgr.state, mgr.ops, mgr.conversations, rec, 0)
    (skip,) = core.cache_events("prewarm_skipped")
    assert skip.reason == "prewarm paused except for pinned prefixes: RAM low"
    assert mgr.fake is not None and mgr.fake.calls == []
    mgr.state.pressure.update(reading(ram_pct=3))  # critical
    mgr.state.store.delete(rec)
    await mgr.ops.persist_now(info)
    (skip2,) = core.cache_events("persist_skipped")
    assert skip2.reason == "persisting new state paused: RAM critical"
    assert mgr.state.store.get(state_filename(info.fingerprint)) is None
    assert info.fingerprint not in mgr.ops.persisting
    mgr.fake = None
    st = await mgr.status()
    assert st["pressure"]["level"] == "critical"
    assert "keep-alive paused except for pinned prefixes: RAM critical" in st["paused"]
    assert "pressure: critical (RAM critical: 3.0 % available (< 5 %))" in st["text"]
    assert "    persisting new state paused: RAM critical" in st["text"]


def test_samples_are_recorded_and_old_ones_downsampled(tmp_path: Path) -> None:
    t0 = 1_800_000_000.0
    now = [t0]
    tel = Telemetry(tmp_path / "t.sqlite3", clock=lambda: now[0])
    try:
        # Two hours of samples every 5 s; RAM dips in one sample per minute.
        for i in range(2 * 3600 // 5):
            ts = t0 + i * 5
            ram = 20.0 if i % 12 == 7 else 50.0
            tel.record(
                PressureSample(
                    level="nominal",
                    ram_available_pct=ram,
                    swap_used_pct=0.0,
                    server_rss_bytes=None,
                    disk_free_pct=50.0,
                    ts=ts,
                )
            )
        now[0] = t0 + 2 * 3600
        deleted = downsample(tel, now[0])
        rows = tel.pressure_series(since=0)
        old = [r for r in rows if r["ts"] < now[0] - 3600]
        recent = [r for r in rows if r["ts"] >= now[0] - 3600]
        assert len(old) == 60 and len(recent) == 720
        assert deleted == 720 - 60
        assert all(r["ram_available_pct"] == 20.0 for r in old)  # the worst of each minute
        assert downsample(tel, now[0]) == 0  # idempotent
    finally:
        tel.close()


async def test_pressure_sweep_downsamples_every_ten_minutes(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    ps = FakePsutil()
    mgr.state.pressure.sampler = Sampler(
        tmp_path, lambda: None, ps=ps, gpus=False, disk_usage=disk()
    )
    for _ in range(3):
        await mgr.state.pressure.sample()
    assert core.telemetry is not None
    assert len(core.telemetry.pressure_series(since=0)) == 3
    await core.clock.advance(2 * 3600)
    await mgr.state.pressure.sample()  # thins everything older than an hour to 1/min
    assert len(core.telemetry.pressure_series(since=0)) == 2
    assert any(isinstance(e, CacheEvent) for e in core.events) is False


def test_gpus_nvml_cannot_see_come_from_llama_devices_at_most_once_a_minute(
    tmp_path: Path,
) -> None:
    """A Vulkan/ROCm/Metal GPU: NVML sees none, the binary's device list is read instead —
    not on every 5 s sample (each read starts a process that opens the devices)."""
    now = [0.0]
    calls: list[float] = []
    vk = GpuInfo(0, "llvmpipe", 8 * GB, 500 * 1024**2, source="llama.cpp", device="Vulkan0")

    def devices() -> list[GpuInfo]:
        calls.append(now[0])
        return [vk]

    sampler = Sampler(
        tmp_path,
        lambda: None,
        ps=FakePsutil(total=16 * GB, available=8 * GB),
        nvml=FakeNvml([]),
        devices=devices,
        disk_usage=disk(),
        clock=lambda: now[0],
    )
    assert sampler.read().gpus == (vk,)
    now[0] = 30.0
    assert sampler.read().gpus == (vk,)  # the last answer, reused
    now[0] = 61.0
    level, causes = assess(sampler.read(), PressureSettings())
    assert calls == [0.0, 61.0]
    assert level == "low" and causes[0].label == "GPU 0 VRAM low"


def test_nvml_gpus_win_over_the_llama_device_list(tmp_path: Path) -> None:
    asked: list[int] = []
    sampler = Sampler(
        tmp_path,
        lambda: None,
        ps=FakePsutil(total=16 * GB, available=8 * GB),
        nvml=FakeNvml([(24 * GB, 6 * GB)]),
        devices=lambda: asked.append(1) or [],
        disk_usage=disk(),
        clock=lambda: 0.0,
    )
    assert sampler.read().gpus == (GpuInfo(0, "Fake GPU", 24 * GB, 6 * GB),)
    assert asked == []
