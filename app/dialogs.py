"""Small windows that show a long text the user may want to copy (an error, a path)."""

from __future__ import annotations

from collections.abc import Callable

from app.charts import box_style
from app.qt import Qt, QtCore, QtWidgets

COPY = "Copy"


def text_box(
    title: str, intro: str, text: str, parent: QtWidgets.QWidget | None = None
) -> QtWidgets.QMessageBox:
    """A non-modal box with `intro`, the whole `text` (selectable) and a Copy button.

    Opened, not exec'd: a tray app must keep its event loop (and the core's events)
    running while the box is up. The caller keeps a reference until it closes.
    """
    box = QtWidgets.QMessageBox(
        QtWidgets.QMessageBox.Icon.Information, title, f"{intro}\n\n{text}", parent=parent
    )
    box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    copy = box.addButton(COPY, QtWidgets.QMessageBox.ButtonRole.ActionRole)
    # An ActionRole button would close the box; copying should not.
    copy.clicked.disconnect()
    copy.clicked.connect(lambda: QtWidgets.QApplication.clipboard().setText(text))
    box.addButton(QtWidgets.QMessageBox.StandardButton.Close)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    box.open()
    return box


def confirm(
    title: str,
    text: str,
    action: str,
    on_yes: Callable[[], None],
    parent: QtWidgets.QWidget | None = None,
) -> QtWidgets.QMessageBox:
    """Ask before something that cannot be undone: `action` (the button's words) runs
    `on_yes`; Cancel, Esc and closing do nothing. Cancel is the default button.

    Opened window-modal, not exec'd, for the same reason as `text_box`. The caller
    keeps a reference until it closes.
    """
    box = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Warning, title, text, parent=parent)
    yes = box.addButton(action, QtWidgets.QMessageBox.ButtonRole.DestructiveRole)
    cancel = box.addButton(QtWidgets.QMessageBox.StandardButton.Cancel)
    box.setDefaultButton(cancel)
    box.setEscapeButton(cancel)
    box.setWindowModality(Qt.WindowModality.WindowModal)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)

    def done(_result: int) -> None:
        if box.clickedButton() is yes:
            on_yes()

    box.finished.connect(done)
    box.open()
    return box


class RestartOffer(QtWidgets.QFrame):
    """ "Saved. … take effect when llama-server restarts" with Restart now / Later
    (hidden until shown): the settings dialog and the model chooser offer the same."""

    def __init__(self, restart: Callable[[], None], later: Callable[[], None]) -> None:
        super().__init__()
        self.setObjectName("restart_box")
        self._follow_palette()
        row = QtWidgets.QHBoxLayout(self)
        self.text = QtWidgets.QLabel()
        self.text.setWordWrap(True)
        self.now = QtWidgets.QPushButton("Restart llama-server now")
        self.now.setObjectName("restart_now")
        self.later = QtWidgets.QPushButton("Later")
        row.addWidget(self.text, 1)
        row.addWidget(self.now)
        row.addWidget(self.later)
        self.now.clicked.connect(restart)
        self.later.clicked.connect(later)
        self.hide()

    def _follow_palette(self) -> None:
        self.setStyleSheet(box_style("info", "#restart_box", self.palette()))

    def changeEvent(self, event: QtCore.QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QtCore.QEvent.Type.ApplicationPaletteChange:
            self._follow_palette()
