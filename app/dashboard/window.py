"""The dashboard window: tabs, live refresh, geometry kept in QSettings."""

from __future__ import annotations

import contextlib

from app.dashboard.base import Tab, ViewContext
from app.dashboard.cache import CacheTab
from app.dashboard.events import EventsTab
from app.dashboard.memory import MemoryTab
from app.dashboard.overview import OverviewTab
from app.dashboard.requests import RequestsTab
from app.dashboard.reuse import ReuseTab
from app.dashboard.server import ServerTab
from app.dashboard.sessions import SessionsTab
from app.icons import state_icon
from app.qt import QtCore, QtGui, QTimer, QtWidgets, Signal
from app.state import AppState, TrayState

REFRESH_MS = 5000  # periodic refresh of the visible tab
SOON_MS = 1000  # at most one event-driven refresh per second
TAB_CLASSES: tuple[type[Tab], ...] = (
    OverviewTab,
    ReuseTab,
    MemoryTab,
    SessionsTab,
    RequestsTab,
    CacheTab,
    EventsTab,
    ServerTab,
)


class Dashboard(QtWidgets.QMainWindow):
    """Warmslot's main window. Closing it hides it (the tray keeps running)."""

    settingsRequested = Signal()
    closed = Signal()

    def __init__(
        self,
        ctx: ViewContext,
        gui_settings: QtCore.QSettings | None = None,
        parent: QtWidgets.QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.gui_settings = gui_settings
        self.setWindowTitle("Warmslot")
        self.setWindowIcon(state_icon(TrayState.WARM))
        self.tabs = QtWidgets.QTabWidget()
        self.tabs.setDocumentMode(True)
        self.pages: dict[str, Tab] = {}
        self._order: list[Tab] = []
        for cls in TAB_CLASSES:
            page = cls(ctx)
            self.pages[cls.title.lower()] = page
            self._order.append(page)
            # Scrolls when the window is smaller than the tab's minimum size.
            scroll = QtWidgets.QScrollArea()
            scroll.setWidgetResizable(True)
            scroll.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
            scroll.setWidget(page)
            self.tabs.addTab(scroll, cls.title)
        settings_button = QtWidgets.QPushButton("Settings…")
        settings_button.setFlat(True)
        settings_button.clicked.connect(self.settingsRequested.emit)
        self.tabs.setCornerWidget(settings_button, QtCore.Qt.Corner.TopRightCorner)
        self.setCentralWidget(self.tabs)
        self.statusBar().setSizeGripEnabled(True)
        self.resize(1200, 820)

        self._timer = QTimer(self)
        self._timer.setInterval(REFRESH_MS)
        self._timer.timeout.connect(self.refresh_current)
        self._soon = QTimer(self)
        self._soon.setSingleShot(True)
        self._soon.setInterval(SOON_MS)
        self._soon.timeout.connect(self.refresh_current)
        self.tabs.currentChanged.connect(lambda _i: self._tab_changed())
        if ctx.bridge is not None:
            for sig in (
                ctx.bridge.request,
                ctx.bridge.cache,
                ctx.bridge.serverState,
                ctx.bridge.serverExited,
                ctx.bridge.pressure,
                ctx.bridge.notice,
            ):
                sig.connect(self._on_event)
        if ctx.controller is not None:
            ctx.controller.stateChanged.connect(self._on_state)
            ctx.controller.notify.connect(self.show_notice)
            self._on_state(ctx.controller.state)
        self.restore_geometry()

    # ------------------------------------------------------------ refresh
    def page(self, name: str) -> Tab:
        return self.pages[name]

    def current_page(self) -> Tab:
        return self._order[self.tabs.currentIndex()]

    def refresh_current(self) -> None:
        """Timers and events: refresh the visible tab unless it is still refreshing."""
        if self.isVisible():
            self.current_page().refresh_if_idle()

    def _tab_changed(self) -> None:
        if self.isVisible():
            self.current_page().refresh()

    def refresh_all(self) -> None:
        for page in self.pages.values():
            page.refresh()

    def _on_event(self, _ev: object) -> None:
        if not self._soon.isActive():
            self._soon.start()

    def _on_state(self, st: AppState) -> None:
        self.setWindowIcon(state_icon(st.tray))
        self.setWindowTitle(f"Warmslot — {st.label}")

    def show_notice(self, title: str, text: str, level: str = "info") -> None:
        self.statusBar().showMessage(f"{title}: {text}".replace("\n", " "), 30000)

    # ------------------------------------------------------------ window
    def showEvent(self, event: QtGui.QShowEvent) -> None:
        super().showEvent(event)
        self._timer.start()
        self.refresh_current()

    def hideEvent(self, event: QtGui.QHideEvent) -> None:
        self._timer.stop()
        super().hideEvent(event)

    def closeEvent(self, event: QtGui.QCloseEvent) -> None:
        self.save_geometry()
        self._timer.stop()
        super().closeEvent(event)
        self.closed.emit()

    def restore_geometry(self) -> None:
        s = self.gui_settings
        if s is None:
            return
        geom = s.value("dashboard/geometry")
        if isinstance(geom, QtCore.QByteArray) and not geom.isEmpty():
            self.restoreGeometry(geom)
        tab = s.value("dashboard/tab")
        if tab is not None:
            with contextlib.suppress(TypeError, ValueError):
                self.tabs.setCurrentIndex(int(tab))

    def save_geometry(self) -> None:
        s = self.gui_settings
        if s is None:
            return
        s.setValue("dashboard/geometry", self.saveGeometry())
        s.setValue("dashboard/tab", self.tabs.currentIndex())
        s.sync()

    def bring_to_front(self) -> None:
        self.show()
        if self.isMinimized():
            self.showNormal()
        self.raise_()
        self.activateWindow()
