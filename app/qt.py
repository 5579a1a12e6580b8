"""The one place that imports PySide6.

Every other module of `app/` imports Qt from here (``from app.qt import QtCore,
QtWidgets``), so the binding, its version checks and any compatibility shims
live in one file — the seam qutebrowser keeps in ``qutebrowser/qt/``. `core/`
never imports this module (or Qt at all).
"""

from __future__ import annotations

import PySide6
from PySide6 import QtCharts, QtCore, QtGui, QtNetwork, QtSvg, QtWidgets
from shiboken6 import isValid

Qt = QtCore.Qt
Signal = QtCore.Signal
Slot = QtCore.Slot
QObject = QtCore.QObject
QTimer = QtCore.QTimer

QT_VERSION = QtCore.qVersion()  # the Qt libraries
PYSIDE_VERSION: str = PySide6.__version__  # the binding


def is_alive(obj: object) -> bool:
    """False once the C++ side of a Qt object has been deleted."""
    return obj is not None and bool(isValid(obj))


__all__ = [
    "PYSIDE_VERSION",
    "QT_VERSION",
    "QObject",
    "QTimer",
    "Qt",
    "QtCharts",
    "QtCore",
    "QtGui",
    "QtNetwork",
    "QtSvg",
    "QtWidgets",
    "Signal",
    "Slot",
    "is_alive",
]
