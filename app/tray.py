"""The system tray icon: per-state icon, tooltip, menu and notifications."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from app.controller import Controller
from app.icons import state_icon
from app.menu import DASHBOARD, MenuEntry, menu_entries, populate
from app.qt import QObject, QtGui, QtWidgets
from app.state import AppState, TrayState

LEVEL_ICONS = {
    "info": QtWidgets.QSystemTrayIcon.MessageIcon.Information,
    "warning": QtWidgets.QSystemTrayIcon.MessageIcon.Warning,
    "error": QtWidgets.QSystemTrayIcon.MessageIcon.Critical,
}
MESSAGE_MS = 8000
STOPPING_LABEL = "Stopping…"
STOPPING_DETAIL = "finishing requests, saving sessions, stopping llama-server"


class Tray(QObject):
    """Shows the controller's state in the system tray."""

    def __init__(
        self,
        controller: Controller,
        handlers: Mapping[str, Callable[[], object]],
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.handlers = dict(handlers)
        self.icon = QtWidgets.QSystemTrayIcon(state_icon(controller.state.tray), self)
        self.menu = QtWidgets.QMenu()
        self.icon.setContextMenu(self.menu)
        self.actions: dict[str, QtGui.QAction] = {}
        self._entries: list[MenuEntry] = []
        self.stopping = False
        self.icon.activated.connect(self._activated)
        controller.stateChanged.connect(self.show_state)
        controller.notify.connect(self.notify)
        self.show_state(controller.state)
        self.icon.show()

    def show_state(self, state: AppState) -> None:
        if self.stopping:  # Quit was chosen: nothing else is shown until the process ends
            return
        self.icon.setIcon(state_icon(state.tray))
        self.icon.setToolTip(state.tooltip())
        entries = menu_entries(state)
        if entries != self._entries:
            self._entries = entries
            self.actions = populate(self.menu, entries, self.handlers)

    def notify(self, title: str, text: str, level: str = "info") -> None:
        if self.icon.supportsMessages():
            self.icon.showMessage(
                title, text, LEVEL_ICONS.get(level, LEVEL_ICONS["info"]), MESSAGE_MS
            )

    def show_stopping(self, detail: str = STOPPING_DETAIL) -> None:
        """After Quit: the icon stays, says Stopping… until the process is gone, and its
        menu offers nothing (one disabled line), so no action runs while the core stops."""
        self.stopping = True
        self.icon.setIcon(state_icon(TrayState.STOPPED))
        self.icon.setToolTip(f"Warmslot — {STOPPING_LABEL}\n{detail}")
        self.menu.clear()
        self.menu.addAction(f"{STOPPING_LABEL} ({detail})").setEnabled(False)
        self._entries = []
        self.actions = {}

    def _activated(self, reason: QtWidgets.QSystemTrayIcon.ActivationReason) -> None:
        if self.stopping:
            return
        if reason in (
            QtWidgets.QSystemTrayIcon.ActivationReason.Trigger,
            QtWidgets.QSystemTrayIcon.ActivationReason.DoubleClick,
        ):
            handler = self.handlers.get(DASHBOARD)
            if handler is not None:
                handler()

    def hide(self) -> None:
        self.icon.hide()

    def dispose(self) -> None:
        self.icon.hide()
        self.icon.setContextMenu(None)  # type: ignore[arg-type]
        self.menu.deleteLater()
        self.icon.deleteLater()
        self.deleteLater()
