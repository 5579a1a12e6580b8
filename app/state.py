"""What the tray shows, derived by plain functions from the core's status.

`derive_state` turns a `Core.status()` value (`core.status.Status`, plus what the
bridge knows: the last pressure level and a running build) into an `AppState`: one of seven tray
states, the words for it and the numbers for the tooltip. No Qt here, so every
state can be built and tested without a tray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from core.events import BuildProgress
from core.status import Status, cache_error, cache_of


class TrayState(StrEnum):
    STOPPED = "stopped"
    BUILDING = "building"
    STARTING = "starting"
    WARM = "warm"
    COLD = "cold"  # ready, but the cache is cold or only partly warm
    DEGRADED = "degraded"
    ERROR = "error"


LABELS = {
    TrayState.STOPPED: "Stopped",
    TrayState.BUILDING: "Building llama-server",
    TrayState.STARTING: "Starting",
    TrayState.WARM: "Warm",
    TrayState.COLD: "Ready — cache cold or partly warm",
    TrayState.DEGRADED: "Degraded",
    TrayState.ERROR: "Error",
}

RUNNING = (TrayState.STARTING, TrayState.WARM, TrayState.COLD, TrayState.DEGRADED)


@dataclass(frozen=True)
class AppState:
    """Everything the tray icon, tooltip and menu depend on."""

    tray: TrayState = TrayState.STOPPED
    detail: str = ""
    server_state: str = "stopped"
    model: str = ""
    hit_rate_hour: float | None = None
    requests_hour: int = 0
    pressure: str = ""  # ok / low / critical; "" = no samples yet
    build_percent: float | None = None
    build_step: str = ""
    core_running: bool = False
    proxy_url: str = ""
    progress: tuple[float, str] | None = None  # one-click start: (0..100, step)
    can_cancel_build: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        return LABELS[self.tray]

    @property
    def running(self) -> bool:
        return self.tray in RUNNING

    def tooltip(self) -> str:
        lines = [f"Warmslot — {self.label}"]
        if self.progress is not None and self.tray in (TrayState.STARTING, TrayState.BUILDING):
            lines.append(f"{self.progress[1]} ({self.progress[0]:.0f} %)")
        elif self.detail and self.tray in (TrayState.ERROR, TrayState.DEGRADED):
            lines.append(self.detail)
        lines.append(f"Model: {self.model or '—'}")
        if self.hit_rate_hour is None:
            lines.append("Hit rate (last hour): — (no requests)")
        else:
            lines.append(
                f"Hit rate (last hour): {self.hit_rate_hour * 100:.0f} % "
                f"of {self.requests_hour} requests"
            )
        lines.append(f"Memory pressure: {self.pressure or '— (no samples yet)'}")
        return "\n".join(lines)


def model_name(status: Status | None, configured: str = "") -> str:
    """The served model's file name (the configured one before a server resolved it)."""
    mdl = status["server"]["model"] if status is not None else None
    path = mdl["path"] if mdl is not None else configured
    return Path(path).name if path else ""


def cache_warmth(status: Status) -> tuple[bool, str]:
    """(warm?, why) for a ready server: the core's own verdict (`core.cache.inventory.warmth`)."""
    if error := cache_error(status):
        return False, f"cache status failed: {error}"
    cache = cache_of(status)
    if cache is None:
        return True, "no cache manager attached: plain proxy"
    verdict = cache.get("warmth")
    if verdict is None:
        return False, "the cache has not said yet"
    return verdict["warm"], verdict["why"]


def derive_state(
    status: Status | None,
    *,
    core_running: bool = True,
    core_error: str = "",
    pressure: str = "",
    build: BuildProgress | None = None,
    configured_model: str = "",
    progress: tuple[float, str] | None = None,
    can_cancel_build: bool = False,
) -> AppState:
    """The tray state from a status snapshot (None: no core answered yet). `build` is the
    last BuildProgress, if any."""
    srv = status["server"] if status is not None else None
    server_state = srv["state"] if srv is not None else "stopped"
    last_hour = status["last_hour"] if status is not None else None
    common: dict[str, Any] = {
        "server_state": server_state,
        "model": model_name(status, configured_model),
        "hit_rate_hour": last_hour["hit_ratio"] if last_hour is not None else None,
        "requests_hour": last_hour["requests"] if last_hour is not None else 0,
        "pressure": pressure,
        "core_running": core_running,
        "proxy_url": status["warmslot"]["proxy"] if status is not None else "",
        "progress": progress,
        "can_cancel_build": can_cancel_build,
    }
    background = ""
    if build is not None and not build.done:
        common["build_percent"] = float(build.percent)
        common["build_step"] = build.describe()
        if not build.background:
            return AppState(tray=TrayState.BUILDING, detail=build.step, **common)
        # The patched build for the disk tier runs while the stock server serves.
        background = f"{build.purpose or 'building llama-server'}: {build.percent:.0f} %"
    if core_error:
        return AppState(tray=TrayState.ERROR, detail=core_error, **common)
    if not core_running:
        return AppState(tray=TrayState.STOPPED, detail="", **common)
    reason = srv["reason"] if srv is not None else ""
    if server_state == "failed":
        return AppState(tray=TrayState.ERROR, detail=reason or "llama-server failed", **common)
    if server_state in ("starting", "stopping"):
        return AppState(tray=TrayState.STARTING, detail=reason, **common)
    if status is None or srv is None or server_state != "ready":
        return AppState(tray=TrayState.STOPPED, detail=reason, **common)
    warnings: list[str] = []
    if pressure in ("low", "critical"):
        warnings.append(f"memory pressure is {pressure}")
    # The core says for how long a crash restart still counts: until llama-server has
    # run steadily for server.degraded_clear_s (Supervisor.recent_restarts).
    if srv["recent_restarts"] > 0:
        warnings.append(f"llama-server restarted {srv['recent_restarts']}× after crashes")
    for worker in status["workers"]["workers"] if status["workers"] is not None else []:
        if worker["state"] == "left out" and "not answering" in worker["note"]:
            warnings.append(f"RPC worker {worker['label']} is gone: running without it")
    backends = status.get("backends")  # several backends (docs/scale.md#several-backends)
    for b in backends["backends"] if backends is not None else []:
        if not b["ready"] and b["name"] != "main":  # main's state is the server's own
            state = " — ".join(filter(None, (b["state"], b["reason"])))
            warnings.append(f"backend {b['name']} is not ready ({state}): sessions go elsewhere")
    if error := cache_error(status):
        warnings.append(f"cache status failed: {error}")
    if warnings:
        return AppState(
            tray=TrayState.DEGRADED, detail="; ".join(warnings), warnings=tuple(warnings), **common
        )
    warm, why = cache_warmth(status)
    if background:
        why = f"{why}; {background}" if why else background
    return AppState(tray=TrayState.WARM if warm else TrayState.COLD, detail=why, **common)
