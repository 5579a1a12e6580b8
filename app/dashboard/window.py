"""The dashboard window: tabs, live refresh, geometry kept in QSettings.

The window fits the screen it opens on: its preferred size (`PREFERRED`) shrinks to
the screen's available geometry (what the panels leave), frame included, and a saved
geometry from a larger screen is brought back inside it. Esc and Ctrl+W close it,
Ctrl+Q quits Warmslot (`quitRequested`: the app's own Quit, which stops the core first).
"""

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
PREFERRED = QtCore.QSize(1200, 820)
# Before the window manager has framed the window its frame is unknown: assume a
# title bar this tall (openbox, GNOME, KDE: 24–38 px); `fit_frame` corrects it once shown.
FRAME_GUESS = QtCore.QMargins(1, 34, 1, 1)
REFIT_MS = 250  # after showing: wait this long for the window manager to frame it …
REFIT_TRIES = 8  # … this many times (a window manager that draws no frames never does)
ESC_KEY = "Esc"
CLOSE_KEY = "Ctrl+W"
QUIT_KEY = "Ctrl+Q"
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
    quitRequested = Signal()  # Ctrl+Q: the app quits the way its menu's Quit does

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
        # Without a tray the window is the app and closing it quits: Esc, pressed to
        # dismiss a popup or a field, must not stop llama-server there (main sets it).
        self.esc_closes = True
        self._auto_size = True
        self._refits_left = 0
        self.esc_shortcut = QtGui.QShortcut(QtGui.QKeySequence(ESC_KEY), self)
        self.esc_shortcut.activated.connect(self._escape)
        self.close_shortcut = QtGui.QShortcut(QtGui.QKeySequence(CLOSE_KEY), self)
        self.close_shortcut.activated.connect(self.close)
        self.quit_shortcut = QtGui.QShortcut(QtGui.QKeySequence(QUIT_KEY), self)
        self.quit_shortcut.activated.connect(self.quitRequested.emit)
        self.fit_to_screen()

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
    def _escape(self) -> None:
        if self.esc_closes:
            self.close()

    def available(self) -> QtCore.QRect:
        """The available geometry of the screen the window is on (or will open on)."""
        screen = self.screen() or QtGui.QGuiApplication.primaryScreen()
        return screen.availableGeometry()

    def frame_known(self) -> bool:
        """Whether the window manager has framed the window (so its frame is known)."""
        if not self.isVisible():
            return False
        if QtGui.QGuiApplication.platformName() in ("offscreen", "minimal"):
            return True  # what it reports is all the frame there is
        return self.frameGeometry() != self.geometry()

    def frame_margins(self) -> QtCore.QMargins:
        """The window frame's size on each side (a guess until the window is framed)."""
        if not self.frame_known():
            return FRAME_GUESS
        f, g = self.frameGeometry(), self.geometry()
        return QtCore.QMargins(
            g.left() - f.left(), g.top() - f.top(), f.right() - g.right(), f.bottom() - g.bottom()
        )

    def fit_to_screen(self) -> None:
        """The preferred size, or what the available geometry leaves, centered in it."""
        known = self.frame_known()
        self._auto_size = not known  # sized again once its real frame is known
        avail = self.available()
        m = self.frame_margins()
        w = max(self.minimumWidth(), min(PREFERRED.width(), avail.width() - m.left() - m.right()))
        h = max(
            self.minimumHeight(), min(PREFERRED.height(), avail.height() - m.top() - m.bottom())
        )
        x = avail.left() + (avail.width() - w - m.left() - m.right()) // 2
        y = avail.top() + (avail.height() - h - m.top() - m.bottom()) // 2
        if known:  # setGeometry places the inside: unambiguous once the frame is known
            self.setGeometry(x + m.left(), y + m.top(), w, h)
        else:
            self.resize(w, h)
            self.move(x, y)  # before it is framed: the frame's position

    def fit_frame(self) -> None:
        """Shrink and move the window so its frame lies inside the available geometry
        (the first time, a window that was not given a size takes the preferred size
        again with its real frame instead of the guessed one)."""
        if not self.frame_known():
            if self._refits_left > 0:
                self._refits_left -= 1
                QTimer.singleShot(REFIT_MS, self, self.fit_frame)
            return
        if self.isMaximized() or self.isFullScreen():
            return
        if self._auto_size:
            self.fit_to_screen()
            return
        inner = self.available().marginsRemoved(self.frame_margins())
        g = self.geometry()
        w, h = min(g.width(), inner.width()), min(g.height(), inner.height())
        x = min(max(g.left(), inner.left()), inner.right() - w + 1)
        y = min(max(g.top(), inner.top()), inner.bottom() - h + 1)
        if (x, y, w, h) != (g.left(), g.top(), g.width(), g.height()):
            self.setGeometry(x, y, w, h)

    def fits_screen(self) -> bool:
        """Whether the whole window, frame included, is inside the available geometry."""
        return self.available().contains(self.frameGeometry())

    def showEvent(self, event: QtGui.QShowEvent) -> None:
        super().showEvent(event)
        self._refits_left = REFIT_TRIES
        QTimer.singleShot(0, self, self.fit_frame)
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
            self.restoreGeometry(geom)  # fit_frame brings it inside this screen once shown
            self._auto_size = False
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
