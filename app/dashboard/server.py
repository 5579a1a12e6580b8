"""Server: state, argv, fit plan, build info, runs and restarts, the live log tail,
and a llama-server build's progress with cancel."""

from __future__ import annotations

import shlex
from typing import Any

from app import fmt
from app.charts import tone
from app.dashboard.base import Request, Tab, ViewContext, fill, table
from app.qt import Qt, QtGui, QtWidgets
from core.events import BuildProgress, LogLine
from core.models.backends import backend_lines
from core.status import Status
from core.status.server import ExitInfo, ServerStatus
from core.telemetry.rows import ServerRunRow

LOG_BLOCKS = 2000
LEVEL_TONES = {"error": "error", "warn": "warn", "warning": "warn"}  # app.charts.TONES


def placement_text(plan: dict[str, Any] | None) -> str:
    """One line on who places the layers and tensors of the launched server."""
    if not plan:
        return ""
    place = plan.get("placement")
    if not isinstance(place, dict):
        if any(d.get("kind") == "gpu" for d in plan.get("devices", [])):
            return f"Layers: Warmslot's estimate, -ngl {plan.get('n_gpu_layers')} (RPC workers)"
        return "Layers: no GPU — everything runs on the CPU"
    if place.get("source") == "llama-fit-params":
        experts = place.get("cpu_expert_layers") or []
        moe = f"; MoE experts of {len(experts)} layer(s) in host RAM" if experts else ""
        return (
            f"Layers: placed by llama.cpp (llama-fit-params): -ngl {place.get('ngl')}"
            f"{moe}. Warmslot's own estimate was -ngl {plan.get('n_gpu_layers')}."
        )
    return (
        "Layers: placed by llama-server's --fit as it loads (this build has no "
        f"llama-fit-params), leaving {place.get('target_mib')} MiB free per device"
    )


class ServerTab(Tab):
    title = "Server"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        split = QtWidgets.QSplitter(Qt.Orientation.Horizontal)
        left = QtWidgets.QWidget()
        lcol = QtWidgets.QVBoxLayout(left)
        lcol.setContentsMargins(0, 0, 4, 0)

        box = QtWidgets.QGroupBox("llama-server")
        form = QtWidgets.QFormLayout(box)
        self.facts: dict[str, QtWidgets.QLabel] = {}
        for key, label in (
            ("state", "State"),
            ("process", "Process"),
            ("binary", "Binary"),
            ("version", "Build"),
            ("model", "Model"),
            ("restarts", "Restarts"),
            ("backends", "Backends"),  # with [[backends]] (docs/scale.md#several-backends)
        ):
            w = QtWidgets.QLabel("—")
            w.setWordWrap(True)
            w.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.facts[key] = w
            form.addRow(label + ":", w)
        lcol.addWidget(box)

        lcol.addWidget(QtWidgets.QLabel("<b>Command line</b> (exactly as launched)"))
        self.argv = QtWidgets.QPlainTextEdit()
        self.argv.setReadOnly(True)
        self.argv.setMaximumHeight(80)
        self.argv.setFont(QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont))
        lcol.addWidget(self.argv)

        lcol.addWidget(QtWidgets.QLabel("<b>Fit plan</b>"))
        # Who placed the layers and tensors: llama.cpp (its answer is launched) or, with RPC
        # workers or no GPU, Warmslot's estimate (docs/gpu.md#placement).
        self.placement = QtWidgets.QLabel()
        self.placement.setWordWrap(True)
        lcol.addWidget(self.placement)
        # The plan is a table aligned with spaces (`warmslot fit` prints the same):
        # monospaced, not wrapped, scrollable — a label would clip or re-flow it.
        self.fit = QtWidgets.QPlainTextEdit()
        self.fit.setReadOnly(True)
        self.fit.setLineWrapMode(QtWidgets.QPlainTextEdit.LineWrapMode.NoWrap)
        self.fit.setFont(QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont))
        self.fit.setMinimumHeight(120)
        lcol.addWidget(self.fit, 1)

        build = QtWidgets.QGroupBox("Build from source")
        brow = QtWidgets.QGridLayout(build)
        self.build_bar = QtWidgets.QProgressBar()
        self.build_bar.setRange(0, 100)
        self.build_step = QtWidgets.QLabel("No build running.")
        self.build_step.setWordWrap(True)
        self.build_button = QtWidgets.QPushButton("Build llama-server")
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setObjectName("cancel_build")
        brow.addWidget(self.build_bar, 0, 0, 1, 3)
        brow.addWidget(self.build_step, 1, 0)
        brow.addWidget(self.build_button, 1, 1)
        brow.addWidget(self.cancel_button, 1, 2)
        lcol.addWidget(build)

        lcol.addWidget(QtWidgets.QLabel("<b>Runs</b> (newest first)"))
        self.runs = table(
            ["started", "ran for", "attempt", "outcome", "exit", "by", "pid", "port"], stretch=3
        )
        lcol.addWidget(self.runs, 1)
        split.addWidget(left)

        right = QtWidgets.QWidget()
        rcol = QtWidgets.QVBoxLayout(right)
        rcol.setContentsMargins(4, 0, 0, 0)
        head = QtWidgets.QHBoxLayout()
        head.addWidget(QtWidgets.QLabel("<b>Log</b> (llama-server output, live)"))
        head.addStretch(1)
        self.follow = QtWidgets.QCheckBox("Follow")
        self.follow.setChecked(True)
        head.addWidget(self.follow)
        rcol.addLayout(head)
        self.log = QtWidgets.QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(LOG_BLOCKS)
        self.log.setLineWrapMode(QtWidgets.QPlainTextEdit.LineWrapMode.NoWrap)
        self.log.setFont(QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont))
        self.log.setPlaceholderText("llama-server's output appears here once it runs.")
        rcol.addWidget(self.log, 1)
        split.addWidget(right)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 4)
        self.outer.addWidget(split, 1)

        backend = ctx.backend
        c = ctx.controller
        can_build = backend.supports("build_server") and c is not None
        self._can_build = can_build
        self.build_button.setEnabled(can_build)
        if not can_build:
            self.build_button.setToolTip(
                "Needs Core.build_server() → Future; meanwhile run `warmslot build` in a terminal"
            )
        self.cancel_button.setEnabled(False)
        if not backend.supports("cancel_build"):
            self.cancel_button.setToolTip("Needs Core.cancel_build() → Future")
        if c is not None:
            self.build_button.clicked.connect(c.build)
            self.cancel_button.clicked.connect(c.cancel_build)
        bridge = ctx.bridge
        if bridge is not None:
            for line in bridge.log_lines():
                self.append_log(line)
            if bridge.build_state is not None:
                self.show_build(bridge.build_state)
            bridge.log.connect(self.append_log)
            bridge.build.connect(self.show_build)

    def requests(self) -> dict[str, Request]:
        return {"status": ("server_status", {}), "runs": ("server_runs", {"limit": 20})}

    def apply(self, results: dict[str, Any]) -> None:
        if "status" in results:
            status: Status = results["status"]
            self.apply_status(status["server"])
            backends = status.get("backends")
            self.facts["backends"].setText(
                "\n".join(line.strip() for line in backend_lines(backends)[1:])
                if backends is not None
                else "one (the llama-server above)"
            )
        if "runs" in results:
            self.apply_runs(results["runs"])

    def apply_status(self, srv: ServerStatus) -> None:
        self.facts["state"].setText(
            f"<b>{srv['state']}</b>" + (f" — {srv['reason']}" if srv["reason"] else "")
        )
        self.facts["process"].setText(
            f"pid {srv['pid']}, port {srv['port']}, run {srv['run_id']}"
            if srv["pid"]
            else "not running"
        )
        b = srv["binary"]
        self.facts["binary"].setText(f"{b['path']} ({b['source']})" if b else "—")
        self.facts["version"].setText(
            f"{b['version']}, commit {b['commit'] or '?'}"
            + (", --no-repack active" if srv["no_repack"] else "")
            if b
            else "—"
        )
        m = srv["model"]
        self.facts["model"].setText(f"{m['path']} ({fmt.size(m['size'])})" if m else "—")
        self.facts["restarts"].setText(
            f"{srv['restarts']} in a row now; " + exits_summary(srv["exits"])
        )
        self.argv.setPlainText(shlex.join(srv["argv"]) if srv["argv"] else "")
        fit = srv["fit"]
        text = fit["text"] if fit is not None else ""
        if text != self.fit.toPlainText():
            self.fit.setPlainText(text)
        self.placement.setText(placement_text(fit["plan"] if fit is not None else None))
        self.fit.setPlaceholderText(
            "No fit plan yet: it is made when llama-server starts (`warmslot fit` shows it "
            "before). The flags are in the command line above."
        )

    def apply_runs(self, runs: list[ServerRunRow]) -> None:
        fill(
            self.runs,
            [
                [
                    fmt.clock(r["started"], with_date=True),
                    fmt.duration(ended - r["started"]) if (ended := r["ended"]) else "running",
                    r["attempt"] or "",
                    r["outcome"] or ("running" if not r["ended"] else "?"),
                    f"signal {r['signal']}" if r["signal"] else r["returncode"],
                    r["requested_by"] or "",
                    r["pid"],
                    r["port"],
                ]
                for r in runs
            ],
        )

    def append_log(self, line: LogLine) -> None:
        bar = self.log.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 2
        doc = self.log.document()
        cursor = QtGui.QTextCursor(doc)
        cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
        if doc.characterCount() > 1:
            cursor.insertBlock()
        style = QtGui.QTextCharFormat()
        level = LEVEL_TONES.get(line.level)
        if level:
            style.setForeground(tone(level, self.palette()))
        cursor.insertText(line.raw, style)
        if self.follow.isChecked() and at_end:
            bar.setValue(bar.maximum())

    def show_build(self, ev: BuildProgress) -> None:
        self.build_bar.setValue(int(ev.percent))
        if ev.done:
            self.build_step.setText(f"{'Finished' if ev.ok else 'Failed'}: {ev.step}")
            self.cancel_button.setEnabled(False)
            self.build_button.setEnabled(self._can_build)
        else:
            # "what: 45 % (94/208), 4 min so far, about 5 min left" — then the current step.
            self.build_step.setText(f"{ev.describe()}\n{ev.step}")
            self.cancel_button.setEnabled(self.ctx.backend.supports("cancel_build"))
            self.build_button.setEnabled(False)  # one build at a time: this one is running


# Exit outcomes as the supervisor records them, in the words a user reads.
_OUTCOMES = {
    "crashed": ("crash", "crashes"),
    "start_failed": ("failed start", "failed starts"),
    "requested": ("requested stop", "requested stops"),
}


def exits_summary(exits: list[ExitInfo]) -> str:
    """ "2 exits since Warmslot started: 2 failed starts" — every exit counted by kind."""
    if not exits:
        return "no exits since Warmslot started"
    kinds: dict[tuple[str, str], int] = {}
    for e in exits:
        outcome = e["outcome"] or "unknown"
        words = _OUTCOMES.get(outcome, (outcome, outcome))
        kinds[words] = kinds.get(words, 0) + 1
    parts = ", ".join(f"{n} {one if n == 1 else many}" for (one, many), n in kinds.items())
    return f"{len(exits)} exit{'' if len(exits) == 1 else 's'} since Warmslot started: {parts}"
