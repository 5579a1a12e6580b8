"""One tray per configuration: a local socket named after the config directory.

The first instance listens on the socket. A later launch connects, sends
``open-dashboard`` and reads the one-line answer:

- ``ok``: the running instance opens its dashboard, and the launch exits;
- ``stopping <pid>``: that instance is quitting (finishing requests, saving
  sessions, stopping llama-server). The launch waits until process <pid> has
  exited and then becomes the instance itself — it never hands over to an
  instance that is going away.

An instance that takes the message without answering (a Warmslot from before
the answers) is taken to have opened its dashboard. A socket left behind by a
crash is removed when nobody answers on it. The stopping instance keeps its
socket until its core has stopped, so there is no moment when a launch finds
neither an answer nor a free socket.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.qt import QObject, QtNetwork, Signal
from core.local_api import STOPPING_WAIT_S

log = logging.getLogger("warmslot.gui")
OPEN_DASHBOARD = "open-dashboard"
OK = "ok"
STOPPING = "stopping"
CONNECT_MS = 500
# How long a launch waits for the running instance's answer. Only an instance from
# before the answers (or a GUI thread frozen that long) makes it wait this out.
REPLY_MS = 2000


def server_name(config_dir: Path) -> str:
    """A socket name unique per user and configuration directory."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "user"
    digest = hashlib.sha256(f"{user}\0{Path(config_dir).resolve()}".encode()).hexdigest()[:16]
    return f"warmslot-tray-{digest}"


@dataclass(frozen=True)
class Answer:
    """What the instance holding the socket said to a message."""

    kind: str  # "" (nobody listens), OK, STOPPING, or "silent" (took it, said nothing)
    pid: int = 0  # the stopping instance's process

    @classmethod
    def parse(cls, line: str) -> Answer:
        word, _, rest = line.strip().partition(" ")
        if word == STOPPING and rest.strip().isdigit():
            return cls(STOPPING, int(rest))
        return cls(OK) if word == OK else cls("silent")


def send(name: str, message: str, timeout_ms: int = CONNECT_MS, reply_ms: int = REPLY_MS) -> Answer:
    """Send `message` to the instance listening on `name` and read its answer."""
    sock = QtNetwork.QLocalSocket()
    sock.connectToServer(name)
    if not sock.waitForConnected(timeout_ms):
        return Answer("")
    sock.write((message + "\n").encode())
    sock.waitForBytesWritten(timeout_ms)
    got = b""
    deadline = time.monotonic() + reply_ms / 1000
    while b"\n" not in got:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not sock.waitForReadyRead(left_ms):
            got += bytes(sock.readAll().data())  # what came with the hang-up, if anything
            break
        got += bytes(sock.readAll().data())
    sock.disconnectFromServer()
    if sock.state() != QtNetwork.QLocalSocket.LocalSocketState.UnconnectedState:
        sock.waitForDisconnected(timeout_ms)
    return Answer.parse(got.decode(errors="replace").partition("\n")[0])


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_for_exit(pid: int, timeout_s: float, *, interval_s: float = 0.1) -> bool:
    """Wait until process `pid` has exited; False when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not _exited(pid):
        if time.monotonic() >= deadline:
            return False
        tick.wait(interval_s)
    return True


class SingleInstance(QObject):
    """Claim the instance socket, or hand over to the instance that holds it."""

    messageReceived = Signal(str)
    # A launch came while this instance was stopping: it starts once this one is gone.
    relaunchWaiting = Signal()

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.server: QtNetwork.QLocalServer | None = None
        self.stopping = False
        self._clients: set[QtNetwork.QLocalSocket] = set()

    def claim(self, message: str = OPEN_DASHBOARD, *, wait_s: float = STOPPING_WAIT_S) -> bool:
        """True: we are the instance now. False: `message` went to the running one.

        An instance that is stopping is waited for (`wait_s` at most, then this launch
        takes over), so a launch right after Quit starts rather than exits."""
        deadline = time.monotonic() + wait_s
        while True:
            answer = send(self.name, message)
            if answer.kind in (OK, "silent"):
                log.info("Warmslot's tray already runs; asked it to %s", message)
                return False
            if answer.kind != STOPPING:
                break  # nobody listens: ours
            log.warning(
                "Warmslot (pid %d) is still stopping; this launch starts once it has exited",
                answer.pid,
            )
            if not wait_for_exit(answer.pid, max(0.0, deadline - time.monotonic())):
                log.warning(
                    "Warmslot (pid %d) did not exit within %.0f s; starting anyway",
                    answer.pid,
                    wait_s,
                )
                break
        QtNetwork.QLocalServer.removeServer(self.name)  # a stale socket, or a hung instance's
        server = QtNetwork.QLocalServer(self)
        server.setSocketOptions(QtNetwork.QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            log.warning("single-instance socket %s: %s", self.name, server.errorString())
            return True  # run anyway; a second launch will then start a second tray
        server.newConnection.connect(self._accept)
        self.server = server
        return True

    def set_stopping(self) -> None:
        """From now on a launch is told this instance is stopping (and waits for it)
        instead of being handed the dashboard; keep the socket until the core stopped."""
        self.stopping = True

    def _accept(self) -> None:
        assert self.server is not None
        while self.server.hasPendingConnections():
            sock = self.server.nextPendingConnection()
            sock.setParent(self)
            self._clients.add(sock)
            sock.readyRead.connect(self._read_ready)
            sock.disconnected.connect(self._gone)
            self._read(sock)

    def _read_ready(self) -> None:
        sock = self.sender()
        if isinstance(sock, QtNetwork.QLocalSocket):
            self._read(sock)

    def _gone(self) -> None:
        sock = self.sender()
        if isinstance(sock, QtNetwork.QLocalSocket) and sock in self._clients:
            self._read(sock)
            self._clients.discard(sock)
            sock.deleteLater()

    def _read(self, sock: QtNetwork.QLocalSocket) -> None:
        while sock.canReadLine():
            line = bytes(sock.readLine().data()).decode(errors="replace").strip()
            if not line:
                continue
            if self.stopping:
                self._answer(sock, f"{STOPPING} {os.getpid()}")
                self.relaunchWaiting.emit()
            else:
                self._answer(sock, OK)
                self.messageReceived.emit(line)

    @staticmethod
    def _answer(sock: QtNetwork.QLocalSocket, text: str) -> None:
        if sock.state() == QtNetwork.QLocalSocket.LocalSocketState.ConnectedState:
            sock.write((text + "\n").encode())
            sock.flush()

    def release(self) -> None:
        """Stop listening (the next launch becomes the instance)."""
        for sock in list(self._clients):
            sock.readyRead.disconnect(self._read_ready)
            sock.disconnected.disconnect(self._gone)
            sock.abort()
            sock.deleteLater()
        self._clients.clear()
        if self.server is not None:
            self.server.close()
            self.server.deleteLater()
            self.server = None
