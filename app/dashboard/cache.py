"""Cache: what each slot holds, the saved prefix states (size, TTL class, time to expiry,
pinned, verified), the saved conversations (client, session, tokens, size, age, expiry)
and the known prefixes, with pin/unpin, evict and re-warm."""

from __future__ import annotations

from typing import Any

from app import fmt
from app.charts import tone
from app.controller import error_text
from app.dashboard.base import Request, Tab, ViewContext, fill, fill_keeping_selection, table
from app.dialogs import confirm
from app.qt import Qt, QtWidgets
from core.status import SavedRow, SlotRow, Status, cache_error, cache_of

NEEDS = {
    "pin": "Core.pin(filename, pinned) → Future",
    "evict": "Core.evict(filename) → Future",
    "rewarm": "Core.rewarm(fingerprint) → Future",
}


CONVERSATION = "conversation"  # a saved state's "kind" (core.cache.conversations)


def is_conversation(state: SavedRow) -> bool:
    return state["kind"] == CONVERSATION


def ttl_seconds(settings: Any, ttl_class: str) -> float | None:
    value = getattr(settings.cache, f"ttl_{ttl_class}_s", None)
    return float(value) if value is not None else None


def expiry_text(state: SlotRow | SavedRow, settings: Any, now: float) -> str:
    """Time to expiry: the core's own figure (`expires_in_s`) when it gives one, else a
    saved state's TTL from its last use (a status taken without the index database)."""
    if state.get("pinned"):
        return "never (pinned)"
    if "expires_in_s" in state:
        left = state["expires_in_s"]
        if left is None:
            return "never"
    elif isinstance(last_used := state.get("last_used"), float | int) and last_used:
        ttl = ttl_seconds(settings, str(state.get("ttl_class", "")))
        if ttl is None:
            return "—"
        left = last_used + ttl - now
    else:
        return "—"
    return "due now" if left <= 0 else f"in {fmt.duration(left)}"


# An unpinned state this large is asked about too: it took minutes of prefill to build.
CONFIRM_BYTES = 1 << 30


def evict_question(state: SavedRow) -> str | None:
    """What to ask before evicting `state`, or None when it needs no question (an
    unpinned state under `CONFIRM_BYTES`)."""
    if not state["pinned"] and state["bytes"] < CONFIRM_BYTES:
        return None
    what = (
        f"the conversation of {state['client'] or '—'} session {state['session'] or '—'}"
        if is_conversation(state)
        else f"the saved prefix {state['fingerprint']}"
    )
    pinned = (
        "It is pinned: it never expires and is kept under memory pressure."
        if state["pinned"]
        else "It is not pinned."
    )
    return (
        f"Evict {what}?\n\n{state['tokens']:,} tokens, {fmt.size(state['bytes'])} on disk "
        f"({state['file']}). {pinned}\n\nIts file is deleted now; the next request that "
        "needs it prefills those tokens again."
    )


class CacheTab(Tab):
    title = "Cache"

    def __init__(self, ctx: ViewContext, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(ctx, parent)
        self.summary = QtWidgets.QLabel("—")
        self.summary.setWordWrap(True)
        self.outer.addWidget(self.summary)

        self.outer.addWidget(QtWidgets.QLabel("<b>Slots</b>"))
        self.slots = table(
            ["slot", "role", "session", "prefix", "tokens", "in flight", "last request", "expires"],
            stretch=2,
        )
        self.slots.setMaximumHeight(140)
        self.outer.addWidget(self.slots)

        head = QtWidgets.QHBoxLayout()
        head.addWidget(QtWidgets.QLabel("<b>Saved states</b> (disk tier)"))
        head.addStretch(1)
        self.pin_button = QtWidgets.QPushButton("Pin")
        self.evict_button = QtWidgets.QPushButton("Evict")
        self.rewarm_button = QtWidgets.QPushButton("Re-warm")
        self.pin_button.setObjectName("pin")
        self.evict_button.setObjectName("evict")
        self.rewarm_button.setObjectName("rewarm")
        self.pin_button.clicked.connect(self._toggle_pin)
        self.evict_button.clicked.connect(lambda: self.evict(self._selected_state()))
        self.rewarm_button.clicked.connect(self._rewarm_saved)
        for b in (self.pin_button, self.evict_button, self.rewarm_button):
            head.addWidget(b)
        self.outer.addLayout(head)
        self.saved = table(
            [
                "file",
                "fingerprint",
                "tokens",
                "size",
                "TTL class",
                "expires",
                "pinned",
                "verified",
                "last used",
                "this server",
            ],
            stretch=0,
        )
        self.saved.itemSelectionChanged.connect(self._update_buttons)
        self.outer.addWidget(self.saved, 2)

        head3 = QtWidgets.QHBoxLayout()
        head3.addWidget(QtWidgets.QLabel("<b>Conversations</b> (saved sessions)"))
        head3.addStretch(1)
        self.conversation_pin_button = QtWidgets.QPushButton("Pin")
        self.conversation_evict_button = QtWidgets.QPushButton("Evict")
        self.conversation_pin_button.setObjectName("conversation_pin")
        self.conversation_evict_button.setObjectName("conversation_evict")
        self.conversation_pin_button.clicked.connect(self._toggle_conversation_pin)
        self.conversation_evict_button.clicked.connect(
            lambda: self.evict(self._selected_conversation_state())
        )
        head3.addWidget(self.conversation_pin_button)
        head3.addWidget(self.conversation_evict_button)
        self.outer.addLayout(head3)
        self.conversations = table(
            [
                "client",
                "session",
                "tokens",
                "size",
                "saved",
                "last used",
                "expires",
                "pinned",
                "this server",
                "file",
            ],
            stretch=1,
        )
        self.conversations.itemSelectionChanged.connect(self._update_conversation_buttons)
        self.outer.addWidget(self.conversations, 1)

        head2 = QtWidgets.QHBoxLayout()
        head2.addWidget(QtWidgets.QLabel("<b>Known prefixes</b>"))
        head2.addStretch(1)
        self.rewarm_prefix_button = QtWidgets.QPushButton("Re-warm prefix")
        self.rewarm_prefix_button.setObjectName("rewarm_prefix")
        self.rewarm_prefix_button.clicked.connect(
            lambda: self._run("rewarm", self.selected_prefix())
        )
        head2.addWidget(self.rewarm_prefix_button)
        self.outer.addLayout(head2)
        self.prefixes = table(
            ["fingerprint", "client", "tokens", "share of prompt", "found by", "warm in slot"],
            stretch=1,
        )
        self.prefixes.itemSelectionChanged.connect(self._update_prefix_button)
        self.outer.addWidget(self.prefixes, 1)
        self.action_label = QtWidgets.QLabel("")
        self.action_label.setProperty("role", "muted")
        self.outer.addWidget(self.action_label)
        self._saved_rows: list[SavedRow] = []
        self._conversation_rows: list[SavedRow] = []
        self.confirm_box: QtWidgets.QMessageBox | None = None
        self._update_buttons()
        self._update_prefix_button()
        self._update_conversation_buttons()

    def requests(self) -> dict[str, Request]:
        return {"status": ("server_status", {})}

    # ------------------------------------------------------------ drawing
    def apply(self, results: dict[str, Any]) -> None:
        st: Status | None = results.get("status")
        if st is None:
            return
        cache = cache_of(st)
        if cache is None:
            why = cache_error(st)
            self.summary.setText(
                f"Cache status failed: {why}"
                if why
                else "No cache inventory: the cache manager is not attached (plain proxy) "
                "or the core is not running."
            )
            for t in (self.slots, self.saved, self.prefixes, self.conversations):
                t.setRowCount(0)
            self._saved_rows = []
            self._conversation_rows = []
            self._update_buttons()
            self._update_prefix_button()
            self._update_conversation_buttons()
            return
        now = self.ctx.clock()
        settings = self.ctx.backend.settings
        disk = cache["disk_tier"]
        used = sum(s["bytes"] for s in cache["saved"])
        paused = cache["paused"]
        self.summary.setText(
            f"Cache {'on' if cache['enabled'] else 'off'} · server identity "
            f"{cache['identity'] or '—'} · disk tier "
            f"{'on' if disk['usable'] else 'off'}: {disk['reason'] or '—'} · "
            f"{len(cache['saved'])} saved states, {fmt.size(used)}"
            + (
                f"<br><span style='color:{tone('warning', self.palette()).name()}'>"
                f"Paused: {'; '.join(paused)}</span>"
                if paused
                else ""
            )
        )
        aux = cache["aux_slot"]
        fill(
            self.slots,
            [
                [
                    s["id"],
                    "side calls" if s["id"] == aux else "primary",
                    s["session"] or "—",
                    s["prefix"] or "—",
                    s["tokens"],
                    s["inflight"],
                    s["kind"] or "—",
                    f"{s['ttl_class']}, {expiry_text(s, settings, now)}"
                    if "ttl_class" in s
                    else "—",
                ]
                for s in cache["slots"]
            ],
        )
        states = cache["saved"]
        self._saved_rows = [s for s in states if not is_conversation(s)]
        fill_keeping_selection(
            self.saved,
            [
                [
                    s["file"],
                    s["fingerprint"],
                    s["tokens"],
                    fmt.size(s["bytes"]),
                    s["ttl_class"],
                    expiry_text(s, settings, now),
                    "yes" if s["pinned"] else "no",
                    s["verified"] or "—",
                    fmt.ago(s["last_used"], now),
                    "yes" if s["current"] else "no",
                ]
                for s in self._saved_rows
            ],
            keys=[s["file"] for s in self._saved_rows],
        )
        held = {s["prefix"]: s["id"] for s in cache["slots"] if s["prefix"]}
        fill_keeping_selection(
            self.prefixes,
            [
                [
                    p["fingerprint"],
                    p["client"],
                    p["tokens"],
                    fmt.pct(p["share"], 0),
                    p["source"],
                    held.get(p["fingerprint"], "—"),
                ]
                for p in cache["prefixes"]
            ],
            keys=[p["fingerprint"] for p in cache["prefixes"]],
        )
        self._fill_conversations([s for s in states if is_conversation(s)], settings, now)
        self._update_buttons()
        self._update_prefix_button()
        self._update_conversation_buttons()

    def _fill_conversations(self, rows: list[SavedRow], settings: Any, now: float) -> None:
        self._conversation_rows = rows
        fill_keeping_selection(
            self.conversations,
            [
                [
                    s["client"] or "—",
                    s["session"] or "—",
                    s["tokens"],
                    fmt.size(s["bytes"]),
                    fmt.ago(s["created"], now),
                    fmt.ago(s["last_used"], now),
                    expiry_text(s, settings, now),
                    "yes" if s["pinned"] else "no",
                    "yes" if s["current"] else "no",
                    s["file"],
                ]
                for s in rows
            ],
            keys=[s["file"] for s in rows],
        )

    # ------------------------------------------------------------ actions
    def selected_file(self) -> str | None:
        rows = self.saved.selectionModel().selectedRows()
        if not rows:
            return None
        item = self.saved.item(rows[0].row(), 0)
        return str(item.data(Qt.ItemDataRole.UserRole)) if item is not None else None

    def _selected_state(self) -> SavedRow | None:
        name = self.selected_file()
        return next((s for s in self._saved_rows if s["file"] == name), None)

    def _update_buttons(self) -> None:
        sel = self._selected_state()
        backend = self.ctx.backend
        self.pin_button.setText("Unpin" if sel and sel["pinned"] else "Pin")
        for button, cmd in (
            (self.pin_button, "pin"),
            (self.evict_button, "evict"),
            (self.rewarm_button, "rewarm"),
        ):
            if not backend.supports(cmd):
                button.setEnabled(False)
                button.setToolTip(f"Not available: this core has no {NEEDS[cmd]}")
            elif sel is None:
                button.setEnabled(False)
                button.setToolTip("Select a saved state first")
            else:
                button.setEnabled(True)
                button.setToolTip("")
        if sel is not None and not sel["current"]:
            self.rewarm_button.setEnabled(False)
            self.rewarm_button.setToolTip("Saved for another server build, model or flags")

    def _toggle_pin(self) -> None:
        sel = self._selected_state()
        if sel is not None:
            self._run("pin", sel["file"], not sel["pinned"])

    def _rewarm_saved(self) -> None:
        sel = self._selected_state()
        if sel is not None:
            self._run("rewarm", sel["fingerprint"])

    def selected_conversation(self) -> str | None:
        """The file name of the selected saved conversation."""
        rows = self.conversations.selectionModel().selectedRows()
        if not rows:
            return None
        item = self.conversations.item(rows[0].row(), 0)
        return str(item.data(Qt.ItemDataRole.UserRole)) if item is not None else None

    def _selected_conversation_state(self) -> SavedRow | None:
        name = self.selected_conversation()
        return next((s for s in self._conversation_rows if s["file"] == name), None)

    def _update_conversation_buttons(self) -> None:
        sel = self._selected_conversation_state()
        self.conversation_pin_button.setText("Unpin" if sel and sel["pinned"] else "Pin")
        for button, cmd in (
            (self.conversation_pin_button, "pin"),
            (self.conversation_evict_button, "evict"),
        ):
            if not self.ctx.backend.supports(cmd):
                button.setEnabled(False)
                button.setToolTip(f"Not available: this core has no {NEEDS[cmd]}")
            elif sel is None:
                button.setEnabled(False)
                button.setToolTip("Select a conversation first")
            else:
                button.setEnabled(True)
                button.setToolTip(
                    "Pinned conversations never expire"
                    if cmd == "pin"
                    else "Delete its saved state now"
                )

    def _toggle_conversation_pin(self) -> None:
        sel = self._selected_conversation_state()
        if sel is not None:
            self._run("pin", sel["file"], not sel["pinned"])

    def selected_prefix(self) -> str | None:
        rows = self.prefixes.selectionModel().selectedRows()
        if not rows:
            return None
        item = self.prefixes.item(rows[0].row(), 0)
        return item.text() if item is not None else None

    def _update_prefix_button(self) -> None:
        b = self.rewarm_prefix_button
        if not self.ctx.backend.supports("rewarm"):
            b.setEnabled(False)
            b.setToolTip(f"Not available: this core has no {NEEDS['rewarm']}")
        elif self.selected_prefix() is None:
            b.setEnabled(False)
            b.setToolTip("Select a prefix first")
        else:
            b.setEnabled(True)
            b.setToolTip("Re-warm it in its slot, or restore/prewarm it into a free slot")

    def evict(self, state: SavedRow | None) -> None:
        """Evict a saved state; a pinned or large one only after the user says so."""
        if state is None:
            return
        question = evict_question(state)
        if question is None:
            self._run("evict", state["file"])
            return
        self.confirm_box = confirm(
            "Evict saved state?",
            question,
            "Evict",
            lambda: self._run("evict", state["file"]),
            self,
        )
        self.confirm_box.finished.connect(self._confirm_closed)

    def _confirm_closed(self) -> None:
        self.confirm_box = None

    def _run(self, cmd: str, *args: Any) -> None:
        if not args or args[0] is None:
            return
        self.action_label.setText(f"{cmd.replace('_', ' ')} {args[0]} …")

        def ok(_: Any) -> None:
            self.action_label.setText(f"{cmd.replace('_', ' ')} {args[0]}: done")
            self.refresh()

        def failed(exc: BaseException) -> None:
            self.action_label.setText(f"{cmd.replace('_', ' ')} failed: {error_text(exc)}")

        self.ctx.tasks.watch(self.ctx.backend.command(cmd, *args), ok, failed, owner=self)
