"""One tray per configuration: a local socket named after the config directory.

The first instance listens on the socket; a second launch finds it, sends
``open-dashboard`` and exits. A socket left behind by a crash is removed when
nobody answers on it.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
from pathlib import Path

from app.qt import QObject, QtNetwork, Signal

log = logging.getLogger("warmslot.gui")
OPEN_DASHBOARD = "open-dashboard"
CONNECT_MS = 500


def server_name(config_dir: Path) -> str:
    """A socket name unique per user and configuration directory."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "user"
    digest = hashlib.sha256(f"{user}\0{Path(config_dir).resolve()}".encode()).hexdigest()[:16]
    return f"warmslot-tray-{digest}"


def send(name: str, message: str, timeout_ms: int = CONNECT_MS) -> bool:
    """Send `message` to a running instance; False when none answers."""
    sock = QtNetwork.QLocalSocket()
    sock.connectToServer(name)
    if not sock.waitForConnected(timeout_ms):
        return False
    sock.write((message + "\n").encode())
    ok = sock.waitForBytesWritten(timeout_ms)
    sock.disconnectFromServer()
    if sock.state() != QtNetwork.QLocalSocket.LocalSocketState.UnconnectedState:
        sock.waitForDisconnected(timeout_ms)
    return bool(ok)


class SingleInstance(QObject):
    """Claim the instance socket, or hand over to the instance that holds it."""

    messageReceived = Signal(str)

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.server: QtNetwork.QLocalServer | None = None
        self._clients: set[QtNetwork.QLocalSocket] = set()

    def claim(self, message: str = OPEN_DASHBOARD) -> bool:
        """True: we are the first instance. False: `message` went to the running one."""
        if send(self.name, message):
            log.info("Warmslot's tray already runs; asked it to %s", message)
            return False
        QtNetwork.QLocalServer.removeServer(self.name)  # a stale socket from a crash
        server = QtNetwork.QLocalServer(self)
        server.setSocketOptions(QtNetwork.QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            log.warning("single-instance socket %s: %s", self.name, server.errorString())
            return True  # run anyway; a second launch will then start a second tray
        server.newConnection.connect(self._accept)
        self.server = server
        return True

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
            if line:
                self.messageReceived.emit(line)

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
