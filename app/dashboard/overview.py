"""Overview: state, model, server build, slots, hit rate, tokens and seconds saved today."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app import fmt
from app.charts import TimeChart, muted
from app.dashboard.base import Request, Tab, ViewContext
from app.dashboard.buckets import BucketCache
from app.dashboard.preview import LaunchPreview, preview, slots_text
from app.dashboard.reuse import window
from app.dialogs import text_box
from app.icons import state_icon
from app.qt import Qt, QtCore, QtGui, QtWidgets, Signal
from app.state import AppState, TrayState, derive_state
from core.status import Status, Totals, cache_of


class Card(QtWidgets.QFrame):
    """A big number with a caption."""

    def __init__(self, caption: str, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QtWidgets.QFrame.Shape.StyledPanel)
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(12, 8, 12, 8)
        self.value = QtWidgets.QLabel("—")
        f = self.value.font()
        f.setPointSizeF(f.pointSizeF() * 1.9)
        f.setBold(True)
        self.value.setFont(f)
        self.caption = QtWidgets.QLabel(caption)
        self.sub = QtWidgets.QLabel("")
        lay.addWidget(self.value)
        lay.addWidget(self.caption)
        lay.addWidget(self.sub)
        self.follow_palette()

    def follow_palette(self) -> None:
        """Captions in the palette's secondary text color (readable on light and dark)."""
        p = self.palette()
        border = QtGui.QColor(p.color(QtGui.QPalette.ColorRole.Mid))
        self.setStyleSheet(
            f"Card {{ background: palette(base); border: 1px solid {border.name()};"
            " border-radius: 6px; }"
        )
        caption = muted(p, "base").name()
        self.caption.setStyleSheet(f"color: {caption};")
        self.sub.setStyleSheet(f"color: {caption};")

    def changeEvent(self, event: QtCore.QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QtCore.QEvent.Type.ApplicationPaletteChange:
            self.follow_palette()

    def set(self, value: str, sub: str = "") -> None:
        self.value.setText(value)
        self.sub.setText(sub)


def saved_basis(totals: Totals) -> str:
    """How "prefill time saved" was priced, in words for the tile: each model at its own
    cold prefill rate (the headers' rule, core.telemetry.queries)."""
    priced = [m for m in totals.get("by_model", []) if m["cold_rate"]["ms_per_token"]]
    if len(priced) > 1:
        each = [
            f"{m['model'].removesuffix('.gguf') or 'earlier requests'} "
            f"{m['cold_rate']['ms_per_token'] or 0:.1f} ms/token"
            for m in priced[:3]
        ]
        return "cached tokens × each model's cold prefill rate: " + ", ".join(each)
    rate = priced[0]["cold_rate"] if len(priced) == 1 else totals["cold_rate"]
    ms = rate["ms_per_token"]
    if not ms:
        return "no cold prefill measured yet"
    n = rate["requests"]
    return (
        f"cached tokens × cold prefill rate {ms:.1f} ms/token "
        f"({n:,} cold request{'' if n == 1 else 's'})"
    )


# Server states in which the Overview tells what the next start launches.
NOT_RUNNING = ("stopped", "failed")
PREVIEW_S = 30.0  # free memory changes what the fit plan picks: look again this often


class OverviewTab(Tab):
    title = "Overview"
    modelRequested = Signal()  # "Choose model…": the app opens the model chooser

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        self.app_state: AppState | None = None
        self.buckets = BucketCache()
        self.day_window = (0.0, 0.0)
        self.launch_preview: LaunchPreview | None = None
        self._preview_key = ""
        self._preview_at = -PREVIEW_S
        self._preview_busy = False
        self._stopped_status: Status | None = None
        # State row: icon, words, buttons.
        top = QtWidgets.QHBoxLayout()
        self.icon = QtWidgets.QLabel()
        self.icon.setFixedSize(48, 48)
        self.state_label = QtWidgets.QLabel("—")
        f = self.state_label.font()
        f.setPointSizeF(f.pointSizeF() * 1.6)
        f.setBold(True)
        self.state_label.setFont(f)
        self.detail_label = QtWidgets.QLabel("")
        # No word wrap: a height-for-width label would make the scroll area use the
        # charts' preferred heights and show a needless scroll bar.
        self.detail_label.setSizePolicy(
            QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred
        )
        self.detail_label.setProperty("role", "muted")
        # The label shows what fits; the whole message (errors run long) is one click away.
        self.details_button = QtWidgets.QPushButton("Details…")
        self.details_button.setObjectName("details")
        self.details_button.setVisible(False)
        self.details_button.clicked.connect(self.show_details)
        self.details_box: QtWidgets.QMessageBox | None = None
        detail_row = QtWidgets.QHBoxLayout()
        detail_row.addWidget(self.detail_label, 1)
        detail_row.addWidget(self.details_button)
        words = QtWidgets.QVBoxLayout()
        words.addWidget(self.state_label)
        words.addLayout(detail_row)
        top.addWidget(self.icon)
        top.addLayout(words, 1)
        self.start_button = QtWidgets.QPushButton("Start model + cache")
        self.start_button.setObjectName("start")
        self.stop_button = QtWidgets.QPushButton("Stop")
        self.restart_button = QtWidgets.QPushButton("Restart server")
        self.model_button = QtWidgets.QPushButton("Choose model…")
        self.model_button.setObjectName("choose_model")
        self.model_button.setToolTip(
            "Models you already have (LM Studio, llama.cpp, Hugging Face, Ollama) or a GGUF file"
        )
        self.model_button.clicked.connect(self.modelRequested.emit)
        for b in (self.start_button, self.restart_button, self.stop_button, self.model_button):
            top.addWidget(b)
        self.outer.addLayout(top)
        self.progress = QtWidgets.QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setTextVisible(True)
        self.progress.hide()
        self.outer.addWidget(self.progress)

        # Cards.
        grid = QtWidgets.QGridLayout()
        self.cards = {
            "hit_hour": Card("hit rate, last hour"),
            "hit_today": Card("hit rate, today"),
            "cached_today": Card("prompt tokens served from cache today"),
            "saved_today": Card("prefill time saved today"),
            "requests_today": Card("requests today"),
            "errors_today": Card("failed requests today"),
        }
        for i, card in enumerate(self.cards.values()):
            grid.addWidget(card, i // 3, i % 3)
        self.outer.addLayout(grid)

        # Facts.
        box = QtWidgets.QGroupBox("Server")
        form = QtWidgets.QGridLayout(box)
        form.setColumnStretch(1, 1)
        self.facts: dict[str, QtWidgets.QLabel] = {}
        for i, (key, label) in enumerate(
            (
                ("model", "Model"),
                ("build", "Server build"),
                ("proxy", "Client base URL"),
                ("slots", "Slots"),
                ("server", "llama-server"),
                ("disk", "Disk tier"),
                ("pressure", "Memory pressure"),
            )
        ):
            w = QtWidgets.QLabel("—")
            w.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            w.setSizePolicy(
                QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred
            )
            self.facts[key] = w
            name = QtWidgets.QLabel(label + ":")
            name.setProperty("role", "muted")
            form.addWidget(name, i, 0, Qt.AlignmentFlag.AlignTop)
            form.addWidget(w, i, 1)
        self.outer.addWidget(box)
        self.day = TimeChart("Last 24 hours: hit rate per hour", "% cached", y_range=(0, 100))
        self.day.add_line("hit rate", "green", points=True)
        self.day.chart.legend().setVisible(False)
        self.outer.addWidget(self.day, 1)

        c = ctx.controller
        if c is not None:
            self.start_button.clicked.connect(c.start_all)
            self.stop_button.clicked.connect(c.stop)
            self.restart_button.clicked.connect(c.restart)
            c.stateChanged.connect(self.show_state)
            self.show_state(c.state)
        else:
            for b in (self.start_button, self.stop_button, self.restart_button, self.model_button):
                b.setEnabled(False)
                b.setToolTip("Not connected to a running Warmslot")

    def requests(self) -> dict[str, Request]:
        now = self.ctx.clock()
        since, until, _ = window("hour", now)
        self.day_window = (since, until)
        q_since = self.buckets.query_since("hour", since, now)
        return {
            "status": ("server_status", {}),
            "hour": ("totals", {"since": now - 3600}),
            "today": ("totals", {"since": fmt.start_of_day(now)}),
            "day": ("hit_rate", {"bucket": "hour", "since": q_since, "until": until}),
        }

    def show_details(self) -> None:
        """The whole state message in a box the user can copy from."""
        st = self.app_state
        if st is not None and st.detail:
            self.details_box = text_box(f"Warmslot — {st.label}", "Details:", st.detail, self)

    def show_state(self, st: AppState) -> None:
        self.app_state = st
        self.icon.setPixmap(state_icon(st.tray).pixmap(48, 48))
        self.state_label.setText(st.label)
        self.detail_label.setText(st.detail)
        self.detail_label.setToolTip(st.detail)
        # Errors and warnings run long; the ordinary state line needs no Details button.
        self.details_button.setVisible(
            bool(st.detail) and st.tray in (TrayState.ERROR, TrayState.DEGRADED, TrayState.COLD)
        )
        if self.ctx.controller is None:  # an offline view: nothing to command
            return
        running = st.running or st.tray is TrayState.BUILDING
        self.start_button.setEnabled(not running)
        self.stop_button.setEnabled(st.running and st.server_state != "stopping")
        self.restart_button.setEnabled(
            st.tray in (TrayState.WARM, TrayState.COLD, TrayState.DEGRADED)
        )
        if st.progress is not None:
            self.progress.setValue(int(st.progress[0]))
            self.progress.setFormat(f"{st.progress[1]} — %p%")
            self.progress.show()
        elif st.tray is TrayState.BUILDING and st.build_percent is not None:
            self.progress.setValue(int(st.build_percent))
            self.progress.setFormat(f"Building: {st.build_step} — %p%")
            self.progress.show()
        else:
            self.progress.hide()

    def apply(self, results: dict[str, Any]) -> None:
        st: Status | None = results.get("status")
        hour: Totals | None = results.get("hour")
        if st is not None:
            self._facts(st)
            if self.ctx.controller is None:
                self.show_state(derive_state({**st, "last_hour": hour}))
        if hour is not None:
            self.cards["hit_hour"].set(fmt.pct(hour["hit_ratio"]), f"{hour['requests']} requests")
        day = results.get("day")
        if day is not None:
            since, until = self.day_window
            q_since = self.last_requests["day"][1]["since"]
            day = self.buckets.merge("hour", since, q_since, day, self.ctx.clock())
            self.day.set_x_range(since, until)
            pts = [(r["bucket"], r["hit_ratio"] * 100) for r in day if r["hit_ratio"] is not None]
            if pts:
                self.day.show_chart()
                self.day.set_line("hit rate", pts)
            else:
                self.day.show_message("No requests in the last 24 hours.")
        today: Totals | None = results.get("today")
        if today is not None:
            self.cards["hit_today"].set(
                fmt.pct(today["hit_ratio"]),
                f"{fmt.count(today['cached_tokens'])} of "
                f"{fmt.count(today['cached_tokens'] + today['prompt_tokens'])} prompt tokens",
            )
            self.cards["cached_today"].set(
                fmt.count(today["cached_tokens"]), f"{today['cached_tokens']:,} tokens"
            )
            self.cards["saved_today"].set(fmt.duration(today["seconds_saved"]), saved_basis(today))
            self.cards["requests_today"].set(f"{today['requests']:,}")
            self.cards["errors_today"].set(f"{today['errors']:,}")

    # ------------------------------------------------------------ what a start launches
    def _ask_preview(self) -> None:
        """Work out what a start would launch (on a worker), unless that is known for
        these settings and not older than `PREVIEW_S`."""
        paths = self.ctx.paths
        if paths is None:
            return
        settings = self.ctx.backend.settings
        key = repr((settings.server, settings.models, settings.cache.aux_slot))
        now = self.ctx.clock()
        if self._preview_busy or (key == self._preview_key and now - self._preview_at < PREVIEW_S):
            return
        self._preview_busy = True

        def done(p: LaunchPreview | None) -> None:
            self._preview_busy = False
            self.launch_preview, self._preview_key, self._preview_at = p, key, now
            if self._stopped_status is not None:
                self._facts(self._stopped_status)

        self.ctx.tasks.run(
            lambda: preview(settings, paths), done, lambda _e: done(None), owner=self
        )

    def _model_text(self, st: Status) -> tuple[str, str]:
        """(text, tooltip) for the Model line: the model's file name, and its path."""
        srv = st["server"]
        mdl = srv["model"]
        if srv["state"] in NOT_RUNNING:
            p = self.launch_preview
            if p is None:
                name = (
                    Path(self.ctx.backend.settings.server.model).name
                    or "the demo model (Gemma 3 270M)"
                )
                return f"{name} — starts with “Start model + cache”", ""
            size = f"{fmt.size(p.size)}, " if p.size is not None else ""
            where = p.path or "set up from its package at the first start"
            text = f"{p.model}  ({size}{p.source}) — starts with “Start model + cache”"
            return (text + (f" — {p.problem}" if p.problem else "")), where
        if mdl is None:
            return "not resolved yet", ""
        path = Path(mdl["path"])
        return f"{path.name}  ({fmt.size(mdl['size'])}, {mdl['source']})", str(path)

    def _facts(self, st: Status) -> None:
        srv = st["server"]
        b = srv["binary"]
        stopped = srv["state"] in NOT_RUNNING
        self._stopped_status = st if stopped else None
        if stopped:
            self._ask_preview()
        text, tip = self._model_text(st)
        self.facts["model"].setText(text)
        self.facts["model"].setToolTip(tip)
        self.facts["build"].setText(
            f"{b['version']} · commit {b['commit'] or '?'} · {b['source']}\n{b['path']}"
            if b is not None
            else "not resolved yet"
        )
        proxy = st["warmslot"]["proxy"]
        self.facts["proxy"].setText(f"{proxy}/v1" if proxy else "—")
        cache = cache_of(st)
        slots = cache["slots"] if cache is not None else []
        if stopped and self.launch_preview is not None:
            self.facts["slots"].setText(f"starts with {slots_text(self.launch_preview)}")
        elif stopped and self.ctx.paths is not None:
            self.facts["slots"].setText("— (working out what the start launches…)")
        elif cache is not None and slots:
            warm = sum(1 for s in slots if s["prefix"])
            aux = cache["aux_slot"]
            self.facts["slots"].setText(
                f"{len(slots)} slots, {warm} holding a known prefix"
                + (f"; slot {aux} reserved for side calls" if aux is not None else "")
            )
        else:
            self.facts["slots"].setText("—")
        extra = f", pid {srv['pid']}, port {srv['port']}" if srv["pid"] else ""
        self.facts["server"].setText(
            f"{srv['state']}{extra}; restarts {srv['restarts']}"
            + (f" — {srv['reason']}" if srv["reason"] else "")
        )
        if cache is None:
            self.facts["disk"].setText("—")
            self.facts["pressure"].setText("— (no samples yet)")
            return
        disk = cache["disk_tier"]
        self.facts["disk"].setText(("on — " if disk["usable"] else "off — ") + disk["reason"])
        p, paused = cache["pressure"], cache["paused"]
        if p["sampled_at"] is None:
            self.facts["pressure"].setText("— (no samples yet)")
            return
        causes = "; ".join(p["causes"])
        self.facts["pressure"].setText(
            p["level"]
            + (f" ({causes})" if causes else "")
            + (f" — paused: {'; '.join(paused)}" if paused else "")
        )
