"""What every dashboard tab shares: its context and the refresh cycle.

A tab declares the data it needs (`requests()`: telemetry query names and
arguments, or ``"status"``), the base class submits them all, gathers the futures
and calls `apply(results)` on the GUI thread. One refresh runs at a time; a
refresh asked for meanwhile runs right after. Failures are shown in a banner at
the top of the tab while the last good data stays on screen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.backend import Backend
from app.bridge import Bridge
from app.charts import box_style, muted, tone
from app.controller import error_text
from app.qt import QtCore, QtWidgets, Signal
from app.tasks import Tasks, gather
from core.paths import Paths

if TYPE_CHECKING:
    from app.controller import Controller

Request = tuple[str, dict[str, Any]]
LONG_CELL = 60  # characters: a cell longer than this gets its text as a tooltip


@dataclass
class ViewContext:
    """What the views talk to. `controller` is absent in offline renders."""

    backend: Backend
    tasks: Tasks
    bridge: Bridge | None = None
    controller: Controller | None = None
    clock: Callable[[], float] = field(default=time.time)
    paths: Paths | None = None  # the core's folders: what a start would launch (Overview)


class Tab(QtWidgets.QWidget):
    """Base of the dashboard tabs."""

    refreshed = Signal()
    title = "Tab"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.refresh_count = 0
        self.last_requests: dict[str, Request] = {}
        self.last_results: dict[str, Any] = {}
        self.last_errors: dict[str, BaseException] = {}
        self._inflight = False
        self._again = False
        self.banner = QtWidgets.QLabel()
        self.banner.setObjectName("banner")
        self.banner.setWordWrap(True)
        self.banner.hide()
        self.outer = QtWidgets.QVBoxLayout(self)
        self.outer.setContentsMargins(8, 8, 8, 8)
        self.outer.addWidget(self.banner)
        self.follow_palette()

    def follow_palette(self) -> None:
        """Secondary labels (property ``role``: ``muted`` or ``warning``) and the banner
        take their colors from the palette."""
        p = self.palette()
        self.setStyleSheet(
            f'QLabel[role="muted"] {{ color: {muted(p).name()}; }}\n'
            f'QLabel[role="warning"] {{ color: {tone("warning", p).name()}; }}\n'
            + box_style("warning", "QLabel#banner", p, "padding: 4px 8px;")
        )

    def changeEvent(self, event: QtCore.QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QtCore.QEvent.Type.ApplicationPaletteChange:
            self.follow_palette()

    def heightForWidth(self, width: int) -> int:
        """The tab's minimum height. A word-wrapped label (the banner, a summary) gives
        the tab a height-for-width, and the scroll area it sits in would then make it as
        tall as every table's and chart's *preferred* height: a scroll bar on a screen
        where the tab fits. The layout still gives a wrapped label its lines."""
        del width
        return self.minimumSizeHint().height()

    # ------------------------------------------------------------ to implement
    def requests(self) -> dict[str, Request]:
        """key → (telemetry query name, "status" or "server_status"; keyword arguments)."""
        return {}

    def apply(self, results: dict[str, Any]) -> None:
        """Draw `results` (only the requests that succeeded)."""

    # ------------------------------------------------------------ machinery
    @property
    def busy(self) -> bool:
        return self._inflight

    def refresh(self) -> None:
        """Refresh now; if one is running, once more right after it (user-initiated)."""
        if self._inflight:
            self._again = True
            return
        reqs = self.requests()
        self.last_requests = reqs
        futures = {key: self._submit(name, kwargs) for key, (name, kwargs) in reqs.items()}
        self._inflight = True
        self.ctx.tasks.watch(gather(futures), self._got, owner=self)

    def refresh_if_idle(self) -> None:
        """Refresh unless one is running (timers and events: never queue up work)."""
        if not self._inflight:
            self.refresh()

    def _submit(self, name: str, kwargs: dict[str, Any]) -> Any:
        backend = self.ctx.backend
        if name == "status":
            return backend.status()
        if name == "server_status":
            return backend.server_status()
        return backend.query(name, **kwargs)

    def _got(self, results: dict[str, Any]) -> None:
        self._inflight = False
        errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        ok = {k: v for k, v in results.items() if not isinstance(v, BaseException)}
        self.last_errors = errors
        self.last_results = ok
        self.show_errors(errors)
        self.apply(ok)
        self.refresh_count += 1
        self.refreshed.emit()
        if self._again:
            self._again = False
            self.refresh()

    def show_errors(self, errors: dict[str, BaseException]) -> None:
        if not errors:
            self.banner.hide()
            return
        first = next(iter(errors.values()))
        text = error_text(first)
        if "not running" in text:
            text = "The Warmslot core is not running: start it with “Start model + cache”."
        self.banner.setText(text)
        self.banner.show()


def table(headers: list[str], *, stretch: int | None = None) -> QtWidgets.QTableWidget:
    """A read-only, row-selecting table with the given column headers."""
    t = QtWidgets.QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(headers)
    t.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
    t.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
    t.setAlternatingRowColors(True)
    t.verticalHeader().setVisible(False)
    t.verticalHeader().setDefaultSectionSize(22)
    h = t.horizontalHeader()
    h.setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
    if stretch is not None:
        h.setSectionResizeMode(stretch, QtWidgets.QHeaderView.ResizeMode.Stretch)
    else:
        h.setStretchLastSection(True)
    return t


def fill(
    t: QtWidgets.QTableWidget, rows: list[list[Any]], *, keys: list[Any] | None = None
) -> None:
    """Replace a table's rows; `keys` are stored on the first cell (Qt.UserRole)."""
    from app.qt import Qt

    # Columns that fit their contents are measured once, after the rows are in: measured
    # on every replaced item of a table with a current row, 200 rows of 13 columns took
    # 80 s here (0.1 s this way), and the Requests tab refreshes every 5 s.
    header = t.horizontalHeader()
    modes = [header.sectionResizeMode(c) for c in range(t.columnCount())]
    header.setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Interactive)
    t.setUpdatesEnabled(False)
    try:
        t.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, value in enumerate(row):
                text = "" if value is None else str(value)
                item = QtWidgets.QTableWidgetItem(text)
                if len(text) > LONG_CELL:  # elided in its column: the whole text on hover
                    item.setToolTip(text)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    item.setTextAlignment(
                        Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
                    )
                if c == 0 and keys is not None:
                    item.setData(Qt.ItemDataRole.UserRole, keys[r])
                t.setItem(r, c, item)
    finally:
        for c, mode in enumerate(modes):
            header.setSectionResizeMode(c, mode)
        t.setUpdatesEnabled(True)


def selected_key(t: QtWidgets.QTableWidget) -> Any:
    """The key (see `fill`) of the selected row, or None."""
    from app.qt import Qt

    rows = t.selectionModel().selectedRows()
    item = t.item(rows[0].row(), 0) if rows else None
    return item.data(Qt.ItemDataRole.UserRole) if item is not None else None


def select_key(t: QtWidgets.QTableWidget, key: Any) -> bool:
    """Select the row whose key is `key` (its row may have moved: new rows came in above
    it); no selection when it is gone. False when nothing is selected after."""
    from app.qt import Qt

    if key is not None:
        for r in range(t.rowCount()):
            item = t.item(r, 0)
            if item is not None and item.data(Qt.ItemDataRole.UserRole) == key:
                flags = QtCore.QItemSelectionModel.SelectionFlag
                t.selectionModel().setCurrentIndex(
                    t.model().index(r, 0), flags.ClearAndSelect | flags.Rows
                )  # selectRow would add the row to the old selection
                return True
    if t.selectionModel().hasSelection():
        t.clearSelection()
    return False


def fill_keeping_selection(
    t: QtWidgets.QTableWidget, rows: list[list[Any]], keys: list[Any]
) -> None:
    """`fill`, and the row that was selected stays selected by its key, not its index:
    rows that arrive on top (the newest first) do not move the highlight to another row."""
    keep = selected_key(t)
    t.blockSignals(True)  # one selection change at most, after the rows are in
    try:
        fill(t, rows, keys=keys)
        select_key(t, keep)
    finally:
        t.blockSignals(False)
    if keep is not None:
        t.itemSelectionChanged.emit()


def cell_texts(t: QtWidgets.QTableWidget) -> list[list[str]]:
    """Every cell's text (tests and scripts)."""
    return [
        [(item.text() if (item := t.item(r, c)) else "") for c in range(t.columnCount())]
        for r in range(t.rowCount())
    ]
