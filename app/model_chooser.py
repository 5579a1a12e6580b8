""" "Choose model…": the models the user already has, or any GGUF file, and use one.

The list comes from `core.models.catalog` (LM Studio, llama.cpp, Hugging Face,
Ollama, Warmslot's folder, ``server.model_dirs``) with size, architecture, trained
context, sliding-window/hybrid and whether the model fits with the configured
slots and context. Scanning and reading headers run on a worker thread
(`Tasks.run`). "Use this model" hands ``server.model`` alone to the core's
`update_settings` (running or not), which writes that one key into the settings
file and nothing else, and, when llama-server runs, offers to restart it so that it
loads the new model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from app import fmt
from app.backend import Backend
from app.controller import error_text
from app.dialogs import RestartOffer
from app.qt import Qt, QtGui, QtWidgets, Signal
from app.tasks import Tasks
from core.config import Applies, Settings, SettingsUpdate
from core.models.catalog import (
    Catalog,
    ModelEntry,
    describe_file,
    for_settings,
    profile_note,
)
from core.paths import Paths

COLUMNS = ("Name", "Source", "Size", "Architecture", "Context", "SWA / hybrid", "Fits")
PATH_ROLE = Qt.ItemDataRole.UserRole


def _cells(e: ModelEntry) -> list[str]:
    fits = "—" if e.fits is None else ("yes" if e.fits else "no")
    kind = "" if e.kind in ("", "dense") else e.kind
    return [
        ("● " if e.current else "") + e.name,
        e.source_label,
        fmt.size(e.size) if e.size > 0 else "",
        e.architecture,
        f"{e.n_ctx_train:,}" if e.n_ctx_train else "",
        kind,
        "error" if e.error else fits,
    ]


def details(e: ModelEntry) -> str:
    """Everything about one row, for its tooltip and the line under the list."""
    lines = [e.path]
    if e.parts > 1:
        lines.append(f"split model: {e.parts} parts, {fmt.size(e.size)} in all")
    if e.aliases:
        lines.append("also named: " + ", ".join(e.aliases))
    if e.error:
        lines.append(f"cannot use it: {e.error}")
        return "\n".join(lines)
    if e.kind_text:
        lines.append(e.kind_text)
    if e.fit:
        lines.append(e.fit)
    return "\n".join(lines)


class ModelChooser(QtWidgets.QDialog):
    """The model list, Browse…, and "Use this model"."""

    saved = Signal(str)  # the new server.model

    def __init__(
        self,
        backend: Backend,
        tasks: Tasks,
        paths: Paths,
        *,
        restart: Callable[[], None] | None = None,
        server_running: Callable[[], bool] = lambda: False,
        scan: Callable[[Settings], Catalog] | None = None,
        describe: Callable[[Path, Settings], ModelEntry] | None = None,
        parent: QtWidgets.QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.backend = backend
        self.tasks = tasks
        self.paths = paths
        self._restart = restart
        self._server_running = server_running
        self._scan = scan or (lambda s: for_settings(paths, s))
        self._describe = describe or (lambda p, s: describe_file(p, paths, s))
        self.entries: list[ModelEntry] = []
        self.scans = 0  # finished scans (tests wait on it)
        self.last_catalog: Catalog | None = None
        self.setWindowTitle("Warmslot — Choose model")
        self.resize(1000, 520)

        self.table = QtWidgets.QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QtWidgets.QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(COLUMNS)):
            header.setSectionResizeMode(col, QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.cellDoubleClicked.connect(lambda _r, _c: self.use_selected())

        self.status = QtWidgets.QLabel("Looking for models…")
        self.status.setWordWrap(True)
        self.detail = QtWidgets.QLabel("")
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.detail.setStyleSheet("color: #555;")

        self.restart_box = RestartOffer(self._do_restart, self.accept)
        self.restart_text = self.restart_box.text
        self.restart_now = self.restart_box.now

        self.browse_button = QtWidgets.QPushButton("Browse…")
        self.browse_button.setToolTip("Choose any .gguf file")
        self.browse_button.clicked.connect(self.browse)
        self.rescan_button = QtWidgets.QPushButton("Look again")
        self.rescan_button.clicked.connect(self.rescan)
        self.use_button = QtWidgets.QPushButton("Use this model")
        self.use_button.setObjectName("use")
        self.use_button.setDefault(True)
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self.use_selected)
        close = QtWidgets.QPushButton("Close")
        close.clicked.connect(self.reject)
        buttons = QtWidgets.QHBoxLayout()
        buttons.addWidget(self.browse_button)
        buttons.addWidget(self.rescan_button)
        buttons.addStretch(1)
        buttons.addWidget(self.use_button)
        buttons.addWidget(close)

        lay = QtWidgets.QVBoxLayout(self)
        intro = QtWidgets.QLabel(
            "GGUF models found in LM Studio's, llama.cpp's, Hugging Face's and Ollama's "
            "folders, Warmslot's own and server.model_dirs. Fits = with the configured slots "
            "and context per slot on this machine. Sliding-window and hybrid models need "
            "the patched llama-server for the disk tier (server.build = auto builds it)."
        )
        intro.setWordWrap(True)
        lay.addWidget(intro)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.detail)
        lay.addWidget(self.status)
        lay.addWidget(self.restart_box)
        lay.addLayout(buttons)
        self.rescan()

    # ------------------------------------------------------------ listing
    def rescan(self) -> None:
        """Look for models again (off the GUI thread)."""
        self.rescan_button.setEnabled(False)
        self.status.setText("Looking for models…")
        settings = self.backend.settings
        self.tasks.run(
            lambda: self._scan(settings), self._show_catalog, self._scan_failed, owner=self
        )

    def _show_catalog(self, cat: Catalog) -> None:
        self.scans += 1
        self.last_catalog = cat
        self.rescan_button.setEnabled(True)
        browsed = [e for e in self.entries if e.source == "file"]
        known = {e.path for e in cat.entries}
        self.set_entries([*cat.entries, *(e for e in browsed if e.path not in known)])
        n = len(cat.entries)
        words = f"{n} model{'' if n == 1 else 's'} found." if n else "No models found."
        looked = sum(1 for r in cat.roots if r.path.is_dir())
        words += f" Looked in {len(cat.roots)} places ({looked} exist)."
        if cat.notes:
            words += " " + " ".join(cat.notes)
        self.status.setText(words)

    def _scan_failed(self, exc: BaseException) -> None:
        self.scans += 1
        self.rescan_button.setEnabled(True)
        self.status.setText(f"Could not look for models: {error_text(exc)}")

    def set_entries(self, entries: list[ModelEntry]) -> None:
        """Fill the table, keeping the selection (or selecting the current model)."""
        selected = self.selected()
        self.entries = list(entries)
        self.table.setRowCount(len(self.entries))
        bold = QtGui.QFont(self.table.font())
        bold.setBold(True)
        for row, e in enumerate(self.entries):
            tip = details(e)
            for col, text in enumerate(_cells(e)):
                item = QtWidgets.QTableWidgetItem(text)
                item.setData(PATH_ROLE, e.path)
                item.setToolTip(tip)
                if e.current:
                    item.setFont(bold)
                if e.error or (col == len(COLUMNS) - 1 and e.fits is False):
                    item.setForeground(QtGui.QBrush(QtGui.QColor("#c92a2a")))
                if col in (2, 4):
                    item.setTextAlignment(
                        Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
                    )
                self.table.setItem(row, col, item)
        want = selected.path if selected else next((e.path for e in entries if e.current), "")
        if want:
            self.select_path(want)
        self._selection_changed()

    def select_path(self, path: str) -> bool:
        """Select the row of `path`; False when it is not listed."""
        for row, e in enumerate(self.entries):
            if e.path == path:
                self.table.selectRow(row)
                return True
        return False

    def selected(self) -> ModelEntry | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows or rows[0].row() >= len(self.entries):
            return None
        return self.entries[rows[0].row()]

    def _selection_changed(self) -> None:
        e = self.selected()
        self.detail.setText(details(e) if e else "")
        self.use_button.setEnabled(e is not None and not e.error and not e.current)
        if e is not None and e.current:
            self.use_button.setToolTip("This is the model Warmslot serves")
        else:
            self.use_button.setToolTip("")

    # ------------------------------------------------------------ browsing
    def browse(self) -> None:
        """Pick any .gguf file; it joins the list and is selected."""
        start = (
            str(Path(self.backend.settings.server.model).parent)
            if (self.backend.settings.server.model)
            else str(Path.home())
        )
        path, _ = QtWidgets.QFileDialog.getOpenFileName(
            self, "Choose a GGUF model", start, "GGUF models (*.gguf);;All files (*)"
        )
        if path:
            self.add_file(Path(path))

    def add_file(self, path: Path) -> None:
        """Describe `path` off the GUI thread, then list and select it."""
        settings = self.backend.settings
        self.status.setText(f"Reading {path.name}…")
        self.tasks.run(
            lambda: self._describe(path, settings), self._add_entry, self._scan_failed,
            owner=self,
        )  # fmt: skip

    def _add_entry(self, entry: ModelEntry) -> None:
        if not any(e.path == entry.path for e in self.entries):
            self.set_entries([*self.entries, entry])
        self.select_path(entry.path)
        self.status.setText(
            f"{entry.name}: cannot use it — {entry.error}"
            if entry.error
            else f"Added {entry.name}."
        )

    # ------------------------------------------------------------ using
    def use_selected(self) -> None:
        """Save the selected model as server.model (through the core when it runs)."""
        e = self.selected()
        if e is None or e.error or e.current:
            return
        self.use_button.setEnabled(False)
        self.status.setText("Saving…")
        self.tasks.watch(
            self.backend.update_settings({"server.model": e.path}),
            lambda update: self._saved(e, update),
            self._save_failed,
            owner=self,
        )

    def _saved(self, chosen: ModelEntry, update: SettingsUpdate) -> None:
        self.set_entries([dataclasses.replace(x, current=x.path == chosen.path)
                          for x in self.entries])  # fmt: skip
        self.saved.emit(chosen.path)
        if not update.applied:  # written; the file has other problems (Settings… shows them)
            wrong = "; ".join(p.text for p in update.problems[:2])
            self.status.setText(
                f"Saved server.model, but the settings file still has problems, so the "
                f"running Warmslot keeps its settings (see Settings…): {wrong}"
            )
            return
        if note := profile_note(self.backend.settings):
            self.status.setText(f"Saved, but: {note}")
            return
        if "server.model" in update.waiting_for(Applies.SERVER) and self._server_running():
            self.status.setText(f"Saved: server.model = {chosen.path}")
            self.restart_text.setText(
                f"llama-server keeps serving the old model until it restarts. Restart now to "
                f"load {chosen.name} (saved prefixes of the old model stay on disk)."
            )
            self.restart_now.setEnabled(self._restart is not None)
            self.restart_box.show()
            return
        self.status.setText(f"Saved: {chosen.name} is served from the next start.")
        self.accept()

    def _save_failed(self, exc: BaseException) -> None:
        self.use_button.setEnabled(True)
        self.status.setText(f"Could not save: {error_text(exc)}")

    def _do_restart(self) -> None:
        if self._restart is not None:
            self._restart()
        self.accept()
