"""The settings dialog, generated from `core.config.SCHEMA`.

One tab per section, one editor per setting chosen by its type (check box,
choice list, number, text, argument list); the description is the tooltip and
the caption, with when a change takes effect (at once, when llama-server restarts,
when Warmslot restarts).

It opens with what the settings *file* holds (`Backend.settings_file`), not with
what the core runs on: a value the file has wrong is shown where it fits its
editor (else the default) and marked with what is wrong, a problem no field can
show (an unknown key, a broken table) is listed above the tabs, and a file that
is not valid TOML is shown read-only with where it is broken — nothing is written
to it. Every edit is checked with the setting's own `coerce` (type and validator),
and the rules between settings (TTL short ≤ long ≤ extended, a network proxy
needs a key) are checked on every edit too, shown in words at each field they
involve and gone as soon as either is fixed. Save is off while an edited field has
a problem; what the file had wrong before does not hold it back.

Saving hands the core only the settings the user edited (`update_settings`): the
file keeps every other byte. The core reads the whole file back and applies it
when it is valid; otherwise the dialog stays open and says what is still wrong.
When a changed setting waits for a restart the dialog says which (llama-server's
is offered at once; Warmslot's is a Quit and start again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.backend import Backend
from app.controller import error_text
from app.dialogs import RestartOffer
from app.qt import Qt, QtWidgets, Signal
from app.settings_field import ERROR_STYLE, WHEN_TIP, Field, humanize
from app.tasks import Tasks
from core import config as config_mod
from core.config import Applies, FileRead, Settings, SettingsUpdate
from core.errors import ConfigError
from core.machine import autostart

SECTION_TITLES = {
    "server": "Server",
    "proxy": "Proxy",
    "cache": "Cache",
    "pressure": "Memory pressure",
    "telemetry": "History",
    "pool": "Models",
}
WHEN_MARK = {Applies.LIVE: "", Applies.SERVER: " ↻", Applies.WARMSLOT: " ⟳"}
LEGEND = "↻ = takes effect when llama-server restarts · ⟳ = when Warmslot restarts"


class SettingsDialog(QtWidgets.QDialog):
    """Edit every core setting; saves the edited ones through the backend (the core)
    into the TOML file (see the module doc)."""

    saved = Signal(object)  # the core's SettingsUpdate

    def __init__(
        self,
        backend: Backend,
        tasks: Tasks,
        *,
        restart: Callable[[], None] | None = None,
        server_running: Callable[[], bool] = lambda: False,
        parent: QtWidgets.QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Warmslot settings")
        self.backend = backend
        self.tasks = tasks
        self._restart = restart
        self._server_running = server_running
        self.fields: dict[str, Field] = {}
        self.pending_restart: list[str] = []
        self.file: FileRead = backend.settings_file()

        self.file_note = QtWidgets.QLabel()
        self.file_note.setObjectName("file_note")
        self.file_note.setWordWrap(True)
        self.file_note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.file_note.setStyleSheet(
            "#file_note { background: #fff5f5; color: #c92a2a; border: 1px solid #ffa8a8;"
            " border-radius: 3px; padding: 6px; }"
        )
        self.file_note.hide()
        self.tabs = QtWidgets.QTabWidget()
        self._tab_of: dict[str, int] = {}
        forms: dict[str, QtWidgets.QFormLayout] = {}
        for spec in config_mod.iter_specs():
            section = spec.name.split(".", 1)[0]
            if section not in forms:
                page = QtWidgets.QWidget()
                form = QtWidgets.QFormLayout(page)
                form.setFieldGrowthPolicy(
                    QtWidgets.QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow
                )
                form.setLabelAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop)
                scroll = QtWidgets.QScrollArea()
                scroll.setWidgetResizable(True)
                scroll.setWidget(page)
                self._tab_of[section] = self.tabs.addTab(scroll, section_title(section))
                forms[section] = form
            field = Field(spec, spec.default, self)
            field.changed.connect(self._update)
            self.fields[spec.name] = field
            label = QtWidgets.QLabel(humanize(spec.name) + WHEN_MARK[spec.applies])
            label.setToolTip(f"{spec.description}\n\n{WHEN_TIP[spec.applies]}")
            forms[section].addRow(label, field.container)

        # Not a core setting: the XDG autostart entry is the truth (core/machine/autostart.py).
        self.autostart = QtWidgets.QCheckBox("Start Warmslot's tray at login")
        self.autostart.setObjectName("autostart")
        self.autostart.setChecked(autostart.is_enabled())
        self.autostart.setEnabled(autostart.supported())
        if not autostart.supported():
            self.autostart.setToolTip("On this system the installer sets this up.")
        else:
            self.autostart.setToolTip(str(autostart.entry_path()))

        self.status = QtWidgets.QLabel(LEGEND)
        self.status.setObjectName("status")
        self.status.setWordWrap(True)
        self.restart_box = RestartOffer(self._do_restart, self.accept)
        self.restart_text = self.restart_box.text
        self.restart_now = self.restart_box.now

        self.buttons = QtWidgets.QDialogButtonBox(
            QtWidgets.QDialogButtonBox.StandardButton.Save
            | QtWidgets.QDialogButtonBox.StandardButton.Cancel
            | QtWidgets.QDialogButtonBox.StandardButton.RestoreDefaults
        )
        self.save_button = self.buttons.button(QtWidgets.QDialogButtonBox.StandardButton.Save)
        self.buttons.accepted.connect(self.save)
        self.buttons.rejected.connect(self.reject)
        self.defaults_button = self.buttons.button(
            QtWidgets.QDialogButtonBox.StandardButton.RestoreDefaults
        )
        self.defaults_button.clicked.connect(self.restore_defaults)

        lay = QtWidgets.QVBoxLayout(self)
        lay.addWidget(self.file_note)
        lay.addWidget(self.tabs, 1)
        lay.addWidget(self.autostart)
        lay.addWidget(self.status)
        lay.addWidget(self.restart_box)
        lay.addWidget(self.buttons)
        self.resize(760, 660)
        self.show_file(self.file)

    # ------------------------------------------------------------ the file
    def show_file(self, file: FileRead) -> None:
        """Show what `file` holds: every value, every problem; forget earlier edits."""
        self.file = file
        for name, f in self.fields.items():
            written = file.written.get(name, file.values[name])
            problems = file.problems_at(name)
            f._loading = True
            f.set_value(written if problems and f.fits(written) else file.values[name])
            f._loading = False
            f.dirty = False
            f.file_problem = " ".join(p.text for p in problems) or None
            f.rule_problem = None
            f.editor.setEnabled(file.writable)
            f.validate()
        self.defaults_button.setEnabled(file.writable)
        for section, index in self._tab_of.items():
            bad = any(file.problems_at(n) for n in self.fields if n.startswith(f"{section}."))
            self.tabs.setTabText(index, section_title(section) + (" ⚠" if bad else ""))
        self.file_note.setText(file_note(file))
        self.file_note.setVisible(bool(file.problems))
        self._update()

    # ------------------------------------------------------------ state
    @property
    def problems(self) -> dict[str, str]:
        """What holds Save back: each edited field's problem."""
        return {n: f.shown_problem() or "" for n, f in self.fields.items() if f.blocking}

    def current(self) -> dict[str, Any]:
        """Every setting as the dialog would leave it: an edited field's value where it
        is valid, else the file's (the default where the file's is wrong)."""
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            value, problem = f.check()
            out[name] = value if f.dirty and problem is None else self.file.values[name]
        return out

    def _rules(self) -> None:
        """The rules between settings, on the values as edited: shown at each field they
        involve, and cleared as soon as they hold (whichever field fixed them). A rule
        is not judged on a field whose own value is wrong."""
        wrong = {n for n, f in self.fields.items() if f.problem is not None}
        wrong |= {n for n, f in self.fields.items() if not f.dirty and f.file_problem}
        found: dict[str, list[str]] = {}
        path = self.file.path
        keys = config_mod.keys_beside(path) if path.is_absolute() else None
        for rule in config_mod.settings_problems(_unchecked(self.current()), keys_path=keys):
            if wrong.intersection(rule.involves) or rule.key not in self.fields:
                continue
            found.setdefault(rule.key, []).append(rule.text)
        for name, f in self.fields.items():
            f.set_rule_problem(" ".join(found[name]) if name in found else None)

    def _update(self) -> None:
        self._rules()
        bad = self.problems
        self.save_button.setEnabled(self.file.writable and not bad)
        if not self.file.writable:
            self.status.setText("The settings file cannot be read: nothing is written to it.")
            self.status.setStyleSheet(ERROR_STYLE)
        elif bad:
            names = ", ".join(humanize(n) for n in list(bad)[:3])
            self.status.setText(
                f"{len(bad)} setting{'s need' if len(bad) > 1 else ' needs'} attention: {names}"
            )
            self.status.setStyleSheet(ERROR_STYLE)
        else:
            self.status.setText(LEGEND)
            self.status.setStyleSheet("")

    def restore_defaults(self) -> None:
        for name, f in self.fields.items():
            f.take(config_mod.SCHEMA[name].default)

    def changes(self) -> dict[str, object]:
        """The settings the user edited that differ from the file (or that the file has
        wrong): all that Save writes. Raises ConfigError if an edited field is invalid."""
        out: dict[str, object] = {}
        for name, f in self.fields.items():
            if not f.dirty:
                continue
            value, problem = f.check()
            if problem is not None:
                raise ConfigError(problem, key=name)
            if value != self.file.values[name] or self.file.problems_at(name):
                out[name] = value
        return out

    # ------------------------------------------------------------ saving
    def save(self) -> None:
        self._update()
        if self.problems or not self.file.writable:
            return
        try:
            changes = self.changes()
        except ConfigError as e:
            self._show_error(str(e))
            return
        self.save_button.setEnabled(False)
        self.status.setText("Saving…")
        self.tasks.watch(
            self.backend.update_settings(changes),
            lambda update: self._saved(changes, update),
            self._save_failed,
            owner=self,
        )

    def apply_autostart(self) -> str | None:
        """Write or remove the login entry as the checkbox says; the error, if any."""
        want = self.autostart.isChecked()
        if not autostart.supported() or want == autostart.is_enabled():
            return None
        try:
            if want:
                autostart.enable()
            else:
                autostart.disable()
        except OSError as e:
            return f"Could not change starting at login: {e}"
        return None

    def _show_error(self, text: str) -> None:
        self.status.setText(text)
        self.status.setStyleSheet(ERROR_STYLE)

    def _saved(self, changes: Mapping[str, object], update: SettingsUpdate) -> None:
        if problem := self.apply_autostart():
            self._show_error(problem)
            self.save_button.setEnabled(True)
            return
        self.saved.emit(update)
        if not update.applied:
            # Written, but the file still has problems: show it as it is now.
            self.show_file(self.backend.settings_file())
            n = len(changes)
            self._show_error(
                (f"Saved {n} change{'s' if n != 1 else ''}. " if n else "")
                + "The settings file still has problems (marked), so Warmslot goes on "
                "with the settings it had."
            )
            return
        self.save_button.setEnabled(True)
        server = update.waiting_for(Applies.SERVER)
        warmslot = update.waiting_for(Applies.WARMSLOT)
        self.pending_restart = server + warmslot
        running = self._server_running()
        lines = []
        if server and running:
            lines.append(
                f"{_names(server)} take{'s' if len(server) == 1 else ''} effect when "
                "llama-server restarts (its slots are saved and restored where the cache "
                "allows)."
            )
        if warmslot:
            lines.append(
                f"{_names(warmslot)} take{'s' if len(warmslot) == 1 else ''} effect when "
                "Warmslot restarts (Quit, then start it again)."
            )
        if not lines:
            self.status.setText("Saved.")
            self.accept()
            return
        self.status.setText("Saved.")
        self.restart_text.setText("Saved. " + " ".join(lines))
        self.restart_now.setVisible(bool(server and running))
        self.restart_now.setEnabled(self._restart is not None)
        self.restart_box.show()

    def _save_failed(self, exc: BaseException) -> None:
        self.save_button.setEnabled(True)
        self._show_error(f"Could not save: {error_text(exc)}")

    def _do_restart(self) -> None:
        if self._restart is not None:
            self._restart()
        self.accept()


def section_title(section: str) -> str:
    return SECTION_TITLES.get(section, section.title())


def _names(names: list[str]) -> str:
    shown = ", ".join(humanize(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def file_note(file: FileRead) -> str:
    """What the box above the tabs says about the file's problems ("" when none)."""
    if not file.problems:
        return ""
    if not file.writable:
        first = file.problems[0]
        return (
            f"{first.text}\nFix it in a text editor; until then Warmslot does not write "
            "the file, and these fields show the defaults."
        )
    lines = [p.text for p in file.file_problems()]
    marked = {p.key for p in file.problems if p.key in config_mod.SCHEMA}
    if marked:
        n = len(marked)
        lines.append(
            f"{n} setting{'s' if n != 1 else ''} in the file {'have' if n != 1 else 'has'} "
            "a wrong value (marked ⚠): fix {0} here, or leave {0} — Save writes only what "
            "you change.".format("them" if n != 1 else "it")
        )
    elif lines:
        lines.append(
            "Fix the file in a text editor (remove or rename what is named above); Save "
            "writes only what you change here and leaves the rest as it is."
        )
    return f"The settings file {file.path} has problems:\n" + "\n".join(lines)


def _unchecked(values: Mapping[str, Any]) -> Settings:
    """`values` in a `Settings` without the rules between them (to find which break)."""
    s = Settings()
    for name, value in values.items():
        s = s.replace(name, value, check=False)
    return s
