"""The Qt binding keeps Python's reference counts.

PySide6 6.12.0 on CPython 3.11 releases a reference to None on every call of a method
that returns nothing and one to True on every ``Signal.emit()``; the counts run down
until one reaches zero and the process dies ("Fatal Python error: bool_dealloc" on
quitting the tray). The ``gui`` extra keeps 3.11 on 6.11, which does not.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from app.gc_guard import reference_leaks
from app.qt import QObject, Signal


class Pinger(QObject):
    ping = Signal()


def test_void_calls_and_emits_leave_none_and_true_counted(qtbot: Any) -> None:
    obj = Pinger()
    obj.ping.connect(lambda: None)
    calls = 500
    none_before, true_before = sys.getrefcount(None), sys.getrefcount(True)
    for _ in range(calls):
        obj.setObjectName("probe")  # returns nothing
    none_lost = none_before - sys.getrefcount(None)
    for _ in range(calls):
        obj.ping.emit()
    true_lost = true_before - sys.getrefcount(True)
    for obj_, lost in ((None, none_lost), (True, true_lost)):  # give back what a bug took,
        for _ in range(max(0, lost)):  # so a failing run does not crash the session
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj_))
    # A few references come and go with the loop itself; one per call is the bug.
    assert none_lost < calls // 10, f"None lost {none_lost} references in {calls} calls"
    assert true_lost < calls // 10, f"True lost {true_lost} references in {calls} emits"
    obj.deleteLater()


def test_the_tray_s_own_check_agrees(qtbot: Any) -> None:
    assert reference_leaks() == ""
