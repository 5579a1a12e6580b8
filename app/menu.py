"""The tray menu, built by a plain function from an `AppState`.

`menu_entries(state)` is pure (no Qt): tests build it for every state. `populate`
turns the entries into QActions on a QMenu and connects them to handlers by id
(the pattern of Vorta's ``tray_menu.py``, without its god object).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from app.qt import QtGui, QtWidgets
from app.state import RUNNING, AppState, TrayState
from core.clients import base_url

START = "start"
STOP = "stop"
RESTART = "restart"
CANCEL_BUILD = "cancel_build"
DASHBOARD = "dashboard"
SETTINGS = "settings"
LOGS = "logs"
COPY_DETAIL = "copy_detail"
CHOOSE_MODEL = "choose_model"
COPY_URL = "copy_url"
CLIENT_SETUP = "client_setup"
QUIT = "quit"
DETAIL_WIDTH = 72  # characters per menu line: menus do not wrap text themselves
DETAIL_LINES = 3


@dataclass(frozen=True)
class MenuEntry:
    """One menu row: an action, a disabled label, or a separator."""

    id: str
    text: str = ""
    enabled: bool = True
    tooltip: str = ""
    kind: str = "action"  # action | label | separator


def _sep(n: int) -> MenuEntry:
    return MenuEntry(id=f"sep{n}", kind="separator")


def menu_entries(state: AppState) -> list[MenuEntry]:
    """The tray menu for `state`, top to bottom."""
    t = state.tray
    head = f"Warmslot — {state.label}"
    if state.hit_rate_hour is not None and t in RUNNING:
        head += f" · hit {state.hit_rate_hour * 100:.0f} % (1 h)"
    entries = [MenuEntry(id="status", text=head, enabled=False, kind="label")]
    if state.progress is not None and t in (TrayState.STARTING, TrayState.BUILDING):
        entries.append(
            MenuEntry(
                id="progress",
                text=f"{state.progress[1]} ({state.progress[0]:.0f} %)",
                enabled=False,
                kind="label",
            )
        )
    elif state.detail and t in (TrayState.ERROR, TrayState.DEGRADED, TrayState.COLD):
        for i, line in enumerate(detail_lines(state.detail)):
            entries.append(
                MenuEntry(
                    id="detail" if i == 0 else f"detail{i}",
                    text=line,
                    enabled=False,
                    kind="label",
                    tooltip=state.detail,
                )
            )
        entries.append(
            MenuEntry(id=COPY_DETAIL, text="Copy message", tooltip="Copy the whole message")
        )
    entries.append(_sep(1))
    can_start = t in (TrayState.STOPPED, TrayState.ERROR)
    entries.append(
        MenuEntry(
            id=START,
            text="Start model + cache",
            enabled=can_start,
            tooltip="Find or build llama-server, fit, launch, restore or prewarm prefixes"
            if can_start
            else "Already running",
        )
    )
    if t is TrayState.BUILDING:
        entries.append(
            MenuEntry(
                id=CANCEL_BUILD,
                text="Cancel build",
                enabled=state.can_cancel_build,
                tooltip="" if state.can_cancel_build else "This core cannot cancel builds",
            )
        )
    entries.append(
        MenuEntry(
            id=RESTART,
            text="Restart server",
            enabled=t in (TrayState.WARM, TrayState.COLD, TrayState.DEGRADED),
        )
    )
    entries.append(
        MenuEntry(
            id=STOP,
            text="Stop",
            enabled=t in RUNNING and state.server_state != "stopping",
        )
    )
    url = client_url(state.proxy_url)
    entries += [
        _sep(2),
        MenuEntry(
            id=CHOOSE_MODEL,
            text="Choose model…",
            tooltip="Models you already have (LM Studio, llama.cpp, Hugging Face, Ollama) "
            "or any GGUF file, with whether each fits",
        ),
        MenuEntry(
            id=COPY_URL,
            text="Copy client URL",
            enabled=bool(url),
            tooltip=f"Copy {url} (the OpenAI base URL for your client)"
            if url
            else "Known once Warmslot's proxy runs",
        ),
        MenuEntry(
            id=CLIENT_SETUP, text="Client setup…", tooltip="opencode, aider, Claude Code, Codex"
        ),
        _sep(4),
        MenuEntry(id=DASHBOARD, text="Open dashboard"),
        MenuEntry(id=SETTINGS, text="Settings…"),
        MenuEntry(id=LOGS, text="Open logs"),
        _sep(3),
        MenuEntry(id=QUIT, text="Quit"),
    ]
    return entries


def client_url(proxy_url: str) -> str:
    """The base URL clients need (the proxy's address + ``/v1``); "" when unknown.

    A proxy bound to every interface is reached on loopback from this machine.
    """
    if not proxy_url:
        return ""
    return base_url(proxy_url.replace("://0.0.0.0:", "://127.0.0.1:"))


def detail_lines(text: str) -> list[str]:
    """`text` wrapped for a menu: at most DETAIL_LINES lines, "…" where it was cut."""
    lines = textwrap.wrap(" ".join(text.split()), DETAIL_WIDTH) or [""]
    if len(lines) > DETAIL_LINES:
        lines = lines[:DETAIL_LINES]
        lines[-1] = lines[-1][: DETAIL_WIDTH - 2] + " …"
    return lines


def populate(
    menu: QtWidgets.QMenu,
    entries: list[MenuEntry],
    handlers: Mapping[str, Callable[[], object]],
) -> dict[str, QtGui.QAction]:
    """Replace `menu`'s contents with `entries`; returns the actions by id."""
    menu.clear()
    actions: dict[str, QtGui.QAction] = {}
    for e in entries:
        if e.kind == "separator":
            menu.addSeparator()
            continue
        action = menu.addAction(e.text)
        action.setObjectName(e.id)
        action.setEnabled(e.enabled)
        if e.tooltip:
            action.setToolTip(e.tooltip)
        handler = handlers.get(e.id)
        if e.kind == "action" and handler is not None:
            action.triggered.connect(lambda _checked=False, h=handler: h())
        actions[e.id] = action
    menu.setToolTipsVisible(True)
    return actions
