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
from app.controller import error_text
from app.qt import QtWidgets, Signal
from app.tasks import Tasks, gather

if TYPE_CHECKING:
    from app.controller import Controller

Request = tuple[str, dict[str, Any]]


@dataclass
class ViewContext:
    """What the views talk to. `controller` is absent in offline renders."""

    backend: Backend
    tasks: Tasks
    bridge: Bridge | None = None
    controller: Controller | None = None
    clock: Callable[[], float] = field(default=time.time)


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
        self.banner.setStyleSheet(
            "background: #fff4e6; color: #873800; border: 1px solid #ffc078;"
            " border-radius: 3px; padding: 4px 8px;"
        )
        self.banner.hide()
        self.outer = QtWidgets.QVBoxLayout(self)
        self.outer.setContentsMargins(8, 8, 8, 8)
        self.outer.addWidget(self.banner)

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

    t.setUpdatesEnabled(False)
    t.setRowCount(len(rows))
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            item = QtWidgets.QTableWidgetItem("" if value is None else str(value))
            if isinstance(value, int | float) and not isinstance(value, bool):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            if c == 0 and keys is not None:
                item.setData(Qt.ItemDataRole.UserRole, keys[r])
            t.setItem(r, c, item)
    t.setUpdatesEnabled(True)


def cell_texts(t: QtWidgets.QTableWidget) -> list[list[str]]:
    """Every cell's text (tests and scripts)."""
    return [
        [(t.item(r, c).text() if t.item(r, c) else "") for c in range(t.columnCount())]
        for r in range(t.rowCount())
    ]
