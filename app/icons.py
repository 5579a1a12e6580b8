"""Tray icons: one SVG per state in ``resources/icons/tray-<state>.svg``.

If an SVG cannot be loaded (a bundle without the SVG image plugin), a plain
colored disc is drawn instead so every state still has a distinct icon.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from app.qt import Qt, QtCore, QtGui
from app.state import TrayState
from core.paths import resources_dir

COLORS = {
    TrayState.STOPPED: "#868e96",
    TrayState.BUILDING: "#7048e8",
    TrayState.STARTING: "#1098ad",
    TrayState.WARM: "#e8590c",
    TrayState.COLD: "#4dabf7",
    TrayState.DEGRADED: "#fab005",
    TrayState.ERROR: "#e03131",
}


def icon_path(state: TrayState) -> Path:
    return resources_dir() / "icons" / f"tray-{state.value}.svg"


def _fallback(state: TrayState, size: int = 64) -> QtGui.QIcon:
    pix = QtGui.QPixmap(size, size)
    pix.fill(Qt.GlobalColor.transparent)
    p = QtGui.QPainter(pix)
    p.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
    p.setBrush(QtGui.QColor(COLORS[state]))
    p.setPen(Qt.PenStyle.NoPen)
    p.drawEllipse(QtCore.QRectF(2, 2, size - 4, size - 4))
    p.end()
    return QtGui.QIcon(pix)


@cache
def state_icon(state: TrayState) -> QtGui.QIcon:
    """The icon for a tray state (cached; call after the QApplication exists)."""
    path = icon_path(state)
    if path.is_file():
        pix = QtGui.QPixmap(str(path))
        if not pix.isNull():
            return QtGui.QIcon(str(path))
    return _fallback(state)
