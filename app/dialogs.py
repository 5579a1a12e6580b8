"""Small windows that show a long text the user may want to copy (an error, a path)."""

from __future__ import annotations

from app.qt import Qt, QtWidgets

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
