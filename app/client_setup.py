""" "Client setup…": copyable snippets for opencode, aider, Claude Code and Codex CLI.

The texts come from `core.clients`, the one declaration ``warmslot clients``, the
README and docs/clients.md are made from; this window shows one tab per client with
what works, where the snippet goes, the snippet itself with a Copy button, and why
each of its settings is there.
"""

from __future__ import annotations

import html

from app.menu import client_url
from app.qt import QtGui, QtWidgets
from core.clients import ClientSetup, client_model_name, client_setups, proxy_address
from core.config import Settings


class ClientSetupDialog(QtWidgets.QDialog):
    """One tab per client; the base URL on top, each with a Copy button."""

    def __init__(
        self,
        state_url: str,
        settings: Settings,
        parent: QtWidgets.QWidget | None = None,
        *,
        key_required: bool | None = None,
        context: int | None = None,
    ) -> None:
        """`key_required`: whether clients must send a key (core.keys.key_required: named
        keys or proxy.api_key); None reads proxy.api_key alone. `context`: the agent's
        slot in tokens (core.clients.slot_context), for the compaction settings."""
        super().__init__(parent)
        self.setWindowTitle("Warmslot — Client setup")
        self.resize(760, 640)
        address = proxy_address(state_url, settings)
        self.url = client_url(address)
        self.model = client_model_name(settings)
        key = bool(settings.proxy.api_key) if key_required is None else key_required
        # Each agent waits as long as Warmslot waits for llama-server (docs/clients.md#timeouts).
        timeout = settings.proxy.upstream_timeout_s
        self.setups = client_setups(
            address, self.model, api_key=key, timeout_s=timeout, context=context
        )
        self.snippets: dict[str, QtWidgets.QPlainTextEdit] = {}
        self.reasons: dict[str, QtWidgets.QLabel] = {}
        self.copy_buttons: dict[str, QtWidgets.QPushButton] = {}

        lay = QtWidgets.QVBoxLayout(self)
        top = QtWidgets.QHBoxLayout()
        url_label = QtWidgets.QLabel(f"Client base URL: <b>{self.url}</b>")
        top.addWidget(url_label, 1)
        copy_url = QtWidgets.QPushButton("Copy URL")
        copy_url.setObjectName("copy_url")
        copy_url.clicked.connect(lambda: QtWidgets.QApplication.clipboard().setText(self.url))
        self.copy_buttons["url"] = copy_url
        top.addWidget(copy_url)
        lay.addLayout(top)
        if key:
            note = QtWidgets.QLabel(
                "The proxy requires an API key: the snippets read it from the environment "
                "variable WARMSLOT_API_KEY (your key from `warmslot keys add NAME`, or "
                "proxy.api_key)."
            )
            note.setWordWrap(True)
            lay.addWidget(note)

        self.tabs = QtWidgets.QTabWidget()
        for s in self.setups:
            self.tabs.addTab(self._page(s), s.title if s.works else f"{s.title} (does not work)")
        lay.addWidget(self.tabs, 1)
        close = QtWidgets.QPushButton("Close")
        close.clicked.connect(self.accept)
        row = QtWidgets.QHBoxLayout()
        row.addStretch(1)
        row.addWidget(close)
        lay.addLayout(row)

    def _page(self, s: ClientSetup) -> QtWidgets.QWidget:
        page = QtWidgets.QWidget()
        lay = QtWidgets.QVBoxLayout(page)
        status = QtWidgets.QLabel(s.status)
        status.setWordWrap(True)
        status.setObjectName(f"status_{s.id}")
        status.setStyleSheet("color: #2b8a3e;" if s.works else "color: #873800;")
        lay.addWidget(status)
        where = QtWidgets.QLabel(f"Where: {s.where}")
        where.setWordWrap(True)
        lay.addWidget(where)
        text = QtWidgets.QPlainTextEdit(s.snippet)
        text.setReadOnly(True)
        text.setFont(QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont))
        text.setLineWrapMode(QtWidgets.QPlainTextEdit.LineWrapMode.NoWrap)
        lay.addWidget(text, 1)
        reasons = QtWidgets.QLabel(
            "<br>".join(f"<b>{html.escape(o.name)}</b>: {html.escape(o.why)}" for o in s.options)
        )
        reasons.setWordWrap(True)
        reasons.setObjectName(f"why_{s.id}")
        lay.addWidget(reasons)
        self.reasons[s.id] = reasons
        copy = QtWidgets.QPushButton("Copy")
        copy.clicked.connect(
            lambda _checked=False, t=s.snippet: QtWidgets.QApplication.clipboard().setText(t)
        )
        row = QtWidgets.QHBoxLayout()
        row.addStretch(1)
        row.addWidget(copy)
        lay.addLayout(row)
        self.snippets[s.id] = text
        self.copy_buttons[s.id] = copy
        return page
