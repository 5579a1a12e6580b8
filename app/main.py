"""`warmslot-tray`: the tray app (or, without a system tray, the dashboard window).

Startup: QApplication → single instance (a second launch asks the first to open
its dashboard and exits; one that finds the first stopping waits for it to exit and
then starts) → settings → Core with the prefix-cache manager → bridge, controller,
tray or dashboard → the core thread starts in the background. Quitting shows
"Stopping…" (the tray icon stays; without a tray a small window says it), stops the
core on a worker thread — requests under way finish, sessions are saved — and only
then gives up the single-instance socket and leaves the loop.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from app.backend import CoreBackend
from app.bridge import Bridge
from app.client_setup import ClientSetupDialog
from app.controller import Controller
from app.dashboard import Dashboard, ViewContext
from app.dashboard.overview import OverviewTab
from app.dialogs import text_box
from app.gc_guard import GuiThreadCollector, reference_leaks
from app.menu import (
    CANCEL_BUILD,
    CHOOSE_MODEL,
    CLIENT_SETUP,
    COPY_DETAIL,
    COPY_URL,
    DASHBOARD,
    LOGS,
    QUIT,
    RESTART,
    SETTINGS,
    START,
    STOP,
    client_url,
)
from app.model_chooser import ModelChooser
from app.qt import QObject, QtCore, QtGui, QTimer, QtWidgets
from app.settings_dialog import SettingsDialog
from app.single import SingleInstance, server_name
from app.tasks import Tasks
from app.tray import Tray
from core import config as config_mod
from core.clients import slot_context
from core.config.keys import key_required
from core.errors import ConfigError
from core.paths import Paths

log = logging.getLogger("warmslot.gui")
APP_NAME = "Warmslot"
STOPPING_TEXT = "Warmslot is stopping: finishing requests and saving sessions"


def stopping_window(text: str) -> QtWidgets.QProgressDialog:
    """Without a tray, the one sign of a Warmslot that is quitting: a small busy window
    with no buttons (closing it changes nothing; the process ends when the core has)."""
    dlg = QtWidgets.QProgressDialog(text, "", 0, 0)
    dlg.setWindowTitle(f"{APP_NAME} — Stopping…")
    dlg.setCancelButton(None)
    dlg.setMinimumDuration(0)
    dlg.setAutoClose(False)
    dlg.setAutoReset(False)
    dlg.show()
    return dlg


def policy_factory() -> Any:
    """The prefix-cache manager, when this core has one."""
    try:
        from core.cache.manager import policy_factory as factory
    except ImportError:  # pragma: no cover - a core without the cache manager
        return None
    return factory


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="warmslot-tray", description="Warmslot's tray app.")
    p.add_argument(
        "--dev-dir",
        help="keep config, data, cache and state under this folder (also: $WARMSLOT_HOME)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--dashboard", action="store_true", help="open the dashboard at start even with a tray"
    )
    return p


class App(QObject):
    """One running tray app: the core, its bridge and controller, tray and windows."""

    def __init__(
        self,
        qapp: QtWidgets.QApplication,
        paths: Paths,
        single: SingleInstance,
        *,
        tray_available: bool,
        open_dashboard: bool = False,
        core_factory: Callable[..., Any] | None = None,
        exit_loop: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        from core.engine import Core

        self.qapp = qapp
        self.paths = paths
        self.single = single
        self.finished = False
        self.stopping = False  # Quit was chosen: nothing but the shutdown runs any more
        self.stopping_window: QtWidgets.QProgressDialog | None = None
        self._exit_loop = exit_loop or qapp.quit
        paths.ensure()
        config_mod.ensure_file(paths.config_file)
        self.config_error = ""
        try:
            settings = config_mod.load(paths.config_file)
        except ConfigError as e:
            self.config_error = e.user_message()
            settings = config_mod.Settings()
        make = core_factory or Core
        self.core = make(paths, settings, policy_factory=policy_factory())
        self.tasks = Tasks(self)
        self.backend = CoreBackend(self.core)
        self.bridge = Bridge(self.core, self)
        self.controller = Controller(self.core, self.backend, self.bridge, self.tasks, self)
        self.gui_settings = QtCore.QSettings(
            str(paths.config_dir / "tray-gui.ini"), QtCore.QSettings.Format.IniFormat
        )
        self.dashboard: Dashboard | None = None
        self.settings_dialog: SettingsDialog | None = None
        self.logs_box: QtWidgets.QMessageBox | None = None
        self.model_chooser: ModelChooser | None = None
        self.client_setup: ClientSetupDialog | None = None
        actions: dict[str, Callable[[], object]] = {
            START: self.controller.start_all,
            STOP: self.controller.stop,
            RESTART: self.controller.restart,
            CANCEL_BUILD: self.controller.cancel_build,
            DASHBOARD: self.open_dashboard,
            SETTINGS: self.open_settings,
            LOGS: self.open_logs,
            COPY_DETAIL: self.copy_detail,
            CHOOSE_MODEL: self.open_model_chooser,
            COPY_URL: self.copy_client_url,
            CLIENT_SETUP: self.open_client_setup,
            QUIT: self.quit,
        }
        self.handlers: dict[str, Callable[[], object]] = {
            name: self._unless_stopping(fn) for name, fn in actions.items()
        }
        self.tray: Tray | None = None
        # Quitting always goes through `quit` (the core must stop first), never Qt's
        # "last window closed".
        qapp.setQuitOnLastWindowClosed(False)
        if tray_available:
            self.tray = Tray(self.controller, self.handlers, self)
        single.messageReceived.connect(self._message)
        single.relaunchWaiting.connect(self._relaunch_waiting)
        if self.tray is None or open_dashboard:
            self.open_dashboard()
        if self.config_error:
            self.controller.core_error = f"Settings file is invalid: {self.config_error}"
            self.controller.notify.emit("Settings file is invalid", self.config_error, "error")
            self.controller.refresh_status()
        else:
            self.controller.start_core()

    # ------------------------------------------------------------ windows
    def open_dashboard(self) -> Dashboard:
        if self.dashboard is None:
            ctx = ViewContext(
                backend=self.backend,
                tasks=self.tasks,
                bridge=self.bridge,
                controller=self.controller,
                paths=self.paths,
            )
            self.dashboard = Dashboard(ctx, self.gui_settings)
            self.dashboard.settingsRequested.connect(self.open_settings)
            self.dashboard.quitRequested.connect(self.handlers[QUIT])  # Ctrl+Q
            overview = self.dashboard.page("overview")
            assert isinstance(overview, OverviewTab)
            overview.modelRequested.connect(self.open_model_chooser)
            if self.tray is None:  # the window is the app: closing it quits
                self.dashboard.closed.connect(self.quit)
                self.dashboard.esc_closes = False  # Ctrl+W and Ctrl+Q still do
        self.dashboard.bring_to_front()
        return self.dashboard

    def open_settings(self) -> SettingsDialog:
        if self.settings_dialog is None:
            dlg = SettingsDialog(
                self.backend,
                self.tasks,
                restart=self.controller.restart,
                server_running=lambda: self.controller.state.running,
                parent=self.dashboard,
            )
            dlg.finished.connect(lambda _r: self._settings_closed())
            self.settings_dialog = dlg
        self.settings_dialog.show()
        self.settings_dialog.raise_()
        self.settings_dialog.activateWindow()
        return self.settings_dialog

    def _settings_closed(self) -> None:
        dlg, self.settings_dialog = self.settings_dialog, None
        if dlg is not None:
            dlg.deleteLater()
        self.controller.settings_closed()  # starts a core the file held back, once valid

    def open_model_chooser(self) -> ModelChooser:
        """The model chooser (one at a time); it saves server.model through the core."""
        if self.model_chooser is None:
            dlg = ModelChooser(
                self.backend,
                self.tasks,
                self.paths,
                restart=self.controller.restart,
                server_running=lambda: self.controller.state.running,
                parent=self.dashboard,
            )
            dlg.finished.connect(lambda _r: self._model_chooser_closed())
            self.model_chooser = dlg
        self.model_chooser.show()
        self.model_chooser.raise_()
        self.model_chooser.activateWindow()
        return self.model_chooser

    def _model_chooser_closed(self) -> None:
        dlg, self.model_chooser = self.model_chooser, None
        if dlg is not None:
            dlg.deleteLater()

    def copy_client_url(self) -> str:
        """Put the proxy's OpenAI base URL (``…/v1``) on the clipboard."""
        url = client_url(self.controller.state.proxy_url)
        if url:
            QtWidgets.QApplication.clipboard().setText(url)
        return url

    def open_client_setup(self) -> ClientSetupDialog:
        """Copyable setup snippets for opencode, aider, Claude Code and Codex CLI."""
        if self.client_setup is None:
            settings = self.backend.settings
            dlg = ClientSetupDialog(
                self.controller.state.proxy_url,
                settings,
                parent=self.dashboard,
                key_required=key_required(self.paths.config_file, settings.proxy.api_key),
                context=slot_context(self.controller.status, settings),
            )
            dlg.finished.connect(lambda _r: self._client_setup_closed())
            self.client_setup = dlg
        self.client_setup.show()
        self.client_setup.raise_()
        self.client_setup.activateWindow()
        return self.client_setup

    def _client_setup_closed(self) -> None:
        dlg, self.client_setup = self.client_setup, None
        if dlg is not None:
            dlg.deleteLater()

    def copy_detail(self) -> None:
        """Put the whole state message (the menu shows three lines of it) on the clipboard."""
        QtWidgets.QApplication.clipboard().setText(self.controller.state.detail)

    def open_logs(self) -> bool:
        """Open the log folder in the file manager; without one, show where it is."""
        folder = str(self.paths.log_dir)
        if QtGui.QDesktopServices.openUrl(QtCore.QUrl.fromLocalFile(folder)):
            return True
        box = text_box("Warmslot logs", "No file manager could open the log folder:", folder)
        self.logs_box = box  # kept for tests and so it is not collected
        return False

    def _message(self, text: str) -> None:
        if text.strip() == "open-dashboard" and not self.stopping:
            self.open_dashboard()

    def _unless_stopping(self, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            return None if self.stopping else fn()

        return run

    # ------------------------------------------------------------ quitting
    def quit(self) -> None:
        """Say "Stopping…", stop the core off the GUI thread, then leave the event loop.

        Until the core has stopped the tray icon stays (it says Stopping…, its menu
        offers nothing), the windows are gone, and a new launch is told to wait for this
        process instead of being handed its dashboard (`SingleInstance.set_stopping`)."""
        if self.stopping:
            return
        self.stopping = True
        self.single.set_stopping()
        if self.dashboard is not None:
            self.dashboard.save_geometry()
        for win in (self.settings_dialog, self.model_chooser, self.client_setup, self.dashboard):
            if win is not None:
                win.hide()
        if self.tray is not None:
            self.tray.show_stopping()
        else:
            self.stopping_window = stopping_window(STOPPING_TEXT)
        self.controller.shutdown(self._finish)

    def _relaunch_waiting(self) -> None:
        text = f"{STOPPING_TEXT}; Warmslot starts again once this has stopped"
        if self.tray is not None:
            self.tray.show_stopping(text)
        elif self.stopping_window is not None:
            self.stopping_window.setLabelText(text)

    def _finish(self) -> None:
        self.finished = True
        self.single.release()  # the core has stopped: a waiting launch may start now
        if self.tray is not None:
            self.tray.hide()
        if self.stopping_window is not None:
            self.stopping_window.hide()
        self.tasks.shutdown()
        self._exit_loop()

    def dispose(self) -> None:
        """Delete every window and Qt object of this app (after it finished)."""
        windows = (
            self.settings_dialog,
            self.model_chooser,
            self.client_setup,
            self.dashboard,
            self.stopping_window,
        )
        for obj in windows:
            if obj is not None:
                obj.close()
                obj.deleteLater()
        self.settings_dialog = self.dashboard = self.model_chooser = self.client_setup = None
        self.stopping_window = None
        if self.tray is not None:
            self.tray.dispose()
            self.tray = None
        self.deleteLater()


def launch(
    argv: list[str] | None = None,
    *,
    qapp: QtWidgets.QApplication | None = None,
    tray_available: bool | None = None,
    core_factory: Callable[..., Any] | None = None,
    exit_loop: Callable[[], None] | None = None,
) -> App | None:
    """Build the app (no event loop yet). None when another instance took over."""
    args = build_parser().parse_args(argv)
    app = qapp or QtWidgets.QApplication.instance() or QtWidgets.QApplication([APP_NAME])
    assert isinstance(app, QtWidgets.QApplication)
    paths = Paths.default(args.dev_dir)
    single = SingleInstance(server_name(paths.config_dir))
    if not single.claim():
        return None
    if tray_available is None:
        tray_available = QtWidgets.QSystemTrayIcon.isSystemTrayAvailable()
    return App(
        app,
        paths,
        single,
        tray_available=tray_available,
        open_dashboard=args.dashboard,
        core_factory=core_factory,
        exit_loop=exit_loop,
    )


def missing_xcb_libraries() -> str:
    """Why Qt's X11 plugin cannot start here ("" when it can, or when Qt will not use it).

    Checked before QApplication exists: once Qt fails to load its platform plugin it
    aborts the process, naming the wrong library.
    """
    from core.machine.syslibs import check_tray_libraries, qt_will_use_xcb

    if not qt_will_use_xcb():
        return ""
    libs = check_tray_libraries()
    return "" if libs.ok else libs.message()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if missing := missing_xcb_libraries():
        print(f"warmslot-tray: {missing}", file=sys.stderr)
        return 2
    qapp = QtWidgets.QApplication([sys.argv[0]])
    collector = GuiThreadCollector(qapp)
    collector.start()
    qapp.setApplicationName(APP_NAME)
    qapp.setOrganizationName(APP_NAME)
    qapp.setDesktopFileName("warmslot")
    paths = Paths.default(args.dev_dir)
    from core.logs import setup_logging

    setup_logging(paths, args.verbose)
    if leaks := reference_leaks():  # the binding's own bug: say so before it bites
        log.error("%s", leaks)
    app = launch(argv, qapp=qapp)
    if app is None:
        collector.stop()
        return 0
    # Let Ctrl-C reach Python while Qt's loop runs: quit cleanly, like the menu's Quit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: QTimer.singleShot(0, app.quit))
    tick = QTimer()
    tick.start(300)
    tick.timeout.connect(lambda: None)
    code = int(qapp.exec())
    if app.core.running:  # the loop ended some other way (session logout): stop in stages
        app.core.stop()
    # Tear Qt down here, in order, while Python is whole: left to interpreter exit, Qt
    # objects are destroyed in whatever order the garbage collector meets them.
    tick.stop()
    app.dispose()
    QtCore.QCoreApplication.sendPostedEvents(None, QtCore.QEvent.Type.DeferredDelete)
    collector.stop()
    qapp.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
