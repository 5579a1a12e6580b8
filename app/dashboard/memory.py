"""Memory: RAM, swap, VRAM per GPU and llama-server's RSS over time with the
pressure level bands; disk used by saved states against its cap."""

from __future__ import annotations

from typing import Any

from app import fmt
from app.charts import SERIES_COLORS, TimeChart
from app.dashboard.base import Request, Tab, ViewContext
from app.qt import QtWidgets
from core.status import Status, cache_of

WINDOWS = {"15 minutes": 900, "1 hour": 3600, "6 hours": 6 * 3600, "24 hours": 86400}
MAX_POINTS = 1200
LEVEL_RANK = {"nominal": 0, "ok": 0, "": 0, "low": 1, "critical": 2}
CALM = ("nominal", "ok", "")
NO_SAMPLES = (
    "No memory samples in this window. Warmslot's pressure sampler records RAM, swap, "
    "VRAM and llama-server's RSS every few seconds (pressure.sample_interval_s) while "
    "the core runs; this chart fills in once it has samples."
)


def downsample(rows: list[dict[str, Any]], max_points: int = MAX_POINTS) -> list[dict[str, Any]]:
    """Average consecutive samples down to at most `max_points`; keep the worst level."""
    if len(rows) <= max_points:
        return rows
    step = -(-len(rows) // max_points)
    out = []
    for i in range(0, len(rows), step):
        chunk = rows[i : i + step]
        merged: dict[str, Any] = {"ts": chunk[0]["ts"]}
        for key in ("ram_available_pct", "swap_used_pct", "server_rss", "disk_free_pct"):
            vals = [r[key] for r in chunk if r.get(key) is not None]
            merged[key] = sum(vals) / len(vals) if vals else None
        merged["level"] = max((r.get("level") or "nominal" for r in chunk), key=_rank)
        merged["gpus"] = chunk[-1].get("gpus") or []
        gpu_used: dict[int, list[float]] = {}
        for r in chunk:
            for idx, pct in gpu_used_pct(r).items():
                gpu_used.setdefault(idx, []).append(pct)
        merged["gpu_used_pct"] = {k: sum(v) / len(v) for k, v in gpu_used.items()}
        out.append(merged)
    return out


def _rank(level: str) -> int:
    return LEVEL_RANK.get(level, 1)


def gpu_used_pct(row: dict[str, Any]) -> dict[int, float]:
    if "gpu_used_pct" in row:
        got: dict[int, float] = row["gpu_used_pct"]
        return got
    out: dict[int, float] = {}
    for g in row.get("gpus") or []:
        idx, total, free = int(g[0]), float(g[1]), float(g[2])
        if total > 0:
            out[idx] = (total - free) / total * 100.0
    return out


def rss_points(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """llama-server's RSS in bytes per sample; 0 where no server ran, so the line drops
    to the axis across a stop instead of joining the runs on either side."""
    return [(r["ts"], float(r.get("server_rss") or 0)) for r in rows]


def level_runs(rows: list[dict[str, Any]], until: float) -> list[tuple[float, float, str]]:
    """Spans (start, end, level) where the level was not nominal."""
    runs: list[tuple[float, float, str]] = []
    cur: tuple[float, str] | None = None
    for i, r in enumerate(rows):
        level = r.get("level") or "nominal"
        if cur is not None and level != cur[1]:
            runs.append((cur[0], r["ts"], cur[1]))
            cur = None
        if cur is None and level not in CALM:
            cur = (r["ts"], level)
        if i == len(rows) - 1 and cur is not None:
            runs.append((cur[0], until, cur[1]))
    return runs


class MemoryTab(Tab):
    title = "Memory"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        row = QtWidgets.QHBoxLayout()
        row.addWidget(QtWidgets.QLabel("Window:"))
        self.period = QtWidgets.QComboBox()
        for label, secs in WINDOWS.items():
            self.period.addItem(label, secs)
        self.period.setCurrentIndex(1)
        self.period.currentIndexChanged.connect(lambda _i: self.refresh())
        row.addWidget(self.period)
        row.addStretch(1)
        self.level_label = QtWidgets.QLabel("")
        row.addWidget(self.level_label)
        self.outer.addLayout(row)

        self.percent = TimeChart("Memory", "%", y_range=(0, 100))
        self.percent.add_line("RAM available", "blue")
        self.percent.add_line("swap used", "orange")
        self.rss = TimeChart("llama-server resident memory (RSS)", "MiB")
        self.rss_scale = fmt.size_scale(0)  # MiB, or GiB once the server is that large
        self.rss.add_line("RSS", "violet")
        self.rss.chart.legend().setVisible(False)
        self.outer.addWidget(self.percent, 3)
        self.outer.addWidget(self.rss, 2)

        disk = QtWidgets.QGroupBox("Disk used by saved states")
        lay = QtWidgets.QVBoxLayout(disk)
        self.disk_bar = QtWidgets.QProgressBar()
        self.disk_bar.setRange(0, 1000)
        self.disk_label = QtWidgets.QLabel("—")
        lay.addWidget(self.disk_bar)
        lay.addWidget(self.disk_label)
        self.outer.addWidget(disk)
        self._gpu_lines: list[int] = []

    def requests(self) -> dict[str, Request]:
        span = int(self.period.currentData())
        return {
            "series": ("pressure_series", {"since": self.ctx.clock() - span}),
            "status": ("server_status", {}),
        }

    def apply(self, results: dict[str, Any]) -> None:
        if "series" in results:
            since = self.last_requests["series"][1]["since"]
            self.apply_series(results["series"], since, self.ctx.clock())
        if "status" in results:
            self.apply_disk(results["status"])

    def _ensure_gpu_lines(self, indices: list[int]) -> None:
        for idx in indices:
            if idx not in self._gpu_lines:
                col = SERIES_COLORS[(2 + len(self._gpu_lines)) % len(SERIES_COLORS)]
                self.percent.add_line(f"VRAM used GPU {idx}", col)
                self._gpu_lines.append(idx)

    def apply_series(self, rows: list[dict[str, Any]], since: float, until: float) -> None:
        self.percent.set_x_range(since, until)
        self.rss.set_x_range(since, until)
        if not rows:
            self.percent.show_message(NO_SAMPLES)
            self.rss.show_message(NO_SAMPLES)
            self.level_label.setText("")
            return
        self.percent.show_chart()
        self.rss.show_chart()
        pts = downsample(rows)
        ram = [(r["ts"], r["ram_available_pct"]) for r in pts if r["ram_available_pct"] is not None]
        swap = [(r["ts"], r["swap_used_pct"]) for r in pts if r["swap_used_pct"] is not None]
        self.percent.set_line("RAM available", ram)
        self.percent.set_line("swap used", swap)
        gpu_series: dict[int, list[tuple[float, float]]] = {}
        for r in pts:
            for idx, pct in gpu_used_pct(r).items():
                gpu_series.setdefault(idx, []).append((r["ts"], pct))
        self._ensure_gpu_lines(sorted(gpu_series))
        for idx in self._gpu_lines:
            self.percent.set_line(f"VRAM used GPU {idx}", gpu_series.get(idx, []))
        rss = rss_points(pts)
        if any(y for _, y in rss):
            sc = self.rss_scale = fmt.size_scale(max(y for _, y in rss))
            self.rss.axis_y.setTitleText(sc.unit)
            self.rss.axis_y.setLabelFormat(sc.label_format)
            self.rss.set_line("RSS", [(x, sc(y)) for x, y in rss])
            self.rss.fit_y(minimum_top=1.0)
        else:
            self.rss.show_message("llama-server did not run in this window.")
        runs = level_runs(rows, until)
        self.percent.set_bands(runs)
        self.rss.set_bands(runs)
        last = rows[-1]
        self.level_label.setText(
            f"Pressure now: <b>{last.get('level') or '?'}</b> · RAM available "
            f"{last['ram_available_pct']:.0f} % · swap {last['swap_used_pct']:.0f} %"
        )

    def apply_disk(self, status: Status) -> None:
        cache = cache_of(status)
        if cache is None:
            self.disk_bar.setValue(0)
            self.disk_label.setText("No cache inventory (the cache manager is not running).")
            return
        n = len(cache["saved"])
        disk = cache.get("disk")  # absent without the index database
        used = disk["used_bytes"] if disk else sum(s["bytes"] for s in cache["saved"])
        cap: int | None = disk["cap_bytes"] if disk else None
        source = disk["cap_source"] if disk else ""
        if cap is None:
            mb = self.ctx.backend.settings.cache.disk_cap_mb
            cap = mb * 2**20 if mb else None
            source = "cache.disk_cap_mb" if mb else ""
        if cap:
            self.disk_bar.setValue(min(1000, int(used / cap * 1000)))
            self.disk_bar.setFormat(f"{used / cap * 100:.1f} %")
            self.disk_label.setText(
                f"{fmt.size(used)} in {n} saved states, cap {fmt.size(cap)}"
                + (f" ({source})" if source else "")
            )
        else:
            self.disk_bar.setValue(0)
            self.disk_bar.setFormat("")
            self.disk_label.setText(
                f"{fmt.size(used)} in {n} saved states; cap: automatic "
                "(10 % of the free disk at start, cache.disk_cap_mb = 0)"
            )
