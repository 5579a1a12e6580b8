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

import shlex
from collections.abc import Callable, Mapping
from typing import Any

from app import fmt
from app.backend import Backend
from app.controller import error_text
from app.dialogs import RestartOffer
from app.qt import QObject, Qt, QtWidgets, Signal
from app.tasks import Tasks
from core import config as config_mod
from core.config import Applies, FileRead, Problem, Settings, SettingSpec, SettingsUpdate
from core.errors import ConfigError
from core.machine import autostart

INT_LIMIT = 2**31 - 1
FILE_FIELDS = {"server.binary", "server.model", "server.chat_template_file"}
SECRET_FIELDS = config_mod.SECRET_SETTINGS
WORDS = {
    "ttl": "TTL",
    "ctx": "context",
    "api": "API",
    "ram": "RAM",
    "vram": "VRAM",
    "mib": "(MiB)",
    "mb": "(MiB)",
    "s": "(s)",
    "pct": "(%)",
    "aux": "side-call",
}
SECTION_TITLES = {
    "server": "Server",
    "proxy": "Proxy",
    "cache": "Cache",
    "pressure": "Memory pressure",
    "telemetry": "History",
    "pool": "Models",
}
ERROR_STYLE = "color: #c92a2a;"
WHEN_TIP = {
    Applies.LIVE: "Takes effect at once.",
    Applies.SERVER: "Takes effect when llama-server restarts (↻).",
    Applies.WARMSLOT: "Takes effect when Warmslot restarts (⟳).",
}
WHEN_MARK = {Applies.LIVE: "", Applies.SERVER: " ↻", Applies.WARMSLOT: " ⟳"}
LEGEND = "↻ = takes effect when llama-server restarts · ⟳ = when Warmslot restarts"


def humanize(name: str) -> str:
    """``cache.ttl_short_s`` → ``TTL short (s)``."""
    words = [WORDS.get(w, w) for w in name.split(".", 1)[1].split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


class Field(QObject):
    """An editor for one setting, with its error label.

    `file_problem` is what the settings file had wrong at this setting when the dialog
    opened: shown until the field is edited, and never a reason to hold Save back.
    `rule_problem` is a rule between settings the current values break (set by the
    dialog on every edit). `dirty`: the user edited the field.
    """

    changed = Signal()

    def __init__(
        self,
        spec: SettingSpec,
        value: Any,
        parent: QtWidgets.QWidget,
        *,
        file_problem: str | None = None,
    ) -> None:
        super().__init__(parent)
        self.spec = spec
        self.container = QtWidgets.QWidget(parent)
        col = QtWidgets.QVBoxLayout(self.container)
        col.setContentsMargins(0, 0, 0, 4)
        col.setSpacing(2)
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        self._compact = spec.type in (int, float, bool) or bool(spec.choices)
        self._loading = True
        self.editor = self._make_editor(row)
        self.editor.setObjectName(spec.name)
        self.editor.setToolTip(f"{spec.description}\n\n{WHEN_TIP[spec.applies]}")
        row.insertWidget(0, self.editor, 0 if self._compact else 1)
        self.mark = QtWidgets.QLabel("⚠")
        self.mark.setStyleSheet("color: #e03131; font-weight: bold;")
        self.mark.hide()
        row.insertWidget(1, self.mark)
        # Durations in seconds read better with their size next to them ("= 24.0 h").
        self.in_words: QtWidgets.QLabel | None = None
        if spec.type is int and spec.name.endswith("_s"):
            self.in_words = QtWidgets.QLabel()
            self.in_words.setObjectName(f"{spec.name}:words")
            self.in_words.setStyleSheet("color: #555;")
            row.insertWidget(2, self.in_words)
        # A value the file has wrong can be replaced by the default in one click (a
        # number box cannot show "two minutes", and shows the default meanwhile).
        self.use_default = QtWidgets.QPushButton("Use the default")
        self.use_default.setObjectName(f"{spec.name}:default")
        self.use_default.clicked.connect(lambda: self._take(spec.default))
        self.use_default.hide()
        row.addWidget(self.use_default)
        if self._compact:
            row.addStretch(1)
        col.addLayout(row)
        self.error = QtWidgets.QLabel()
        self.error.setObjectName(f"{spec.name}:error")
        self.error.setStyleSheet(ERROR_STYLE)
        self.error.setWordWrap(True)
        self.error.hide()
        col.addWidget(self.error)
        self.caption = QtWidgets.QLabel(spec.description)
        self.caption.setWordWrap(True)
        self.caption.setStyleSheet("color: #777; font-size: small;")
        col.addWidget(self.caption)
        self.problem: str | None = None
        self.file_problem = file_problem
        self.rule_problem: str | None = None
        self.dirty = False
        self.set_value(value)
        self._loading = False

    # ------------------------------------------------------------ editors
    def _make_editor(self, row: QtWidgets.QHBoxLayout) -> QtWidgets.QWidget:
        spec = self.spec
        w: QtWidgets.QWidget
        if spec.type is bool:
            w = QtWidgets.QCheckBox()
            w.toggled.connect(self._edited)
        elif spec.choices:
            w = QtWidgets.QComboBox()
            w.addItems(list(spec.choices))
            w.currentIndexChanged.connect(self._edited)
        elif spec.type is int:
            w = QtWidgets.QSpinBox()
            w.setRange(-INT_LIMIT, INT_LIMIT)
            w.setMinimumWidth(140)
            w.setKeyboardTracking(True)
            w.valueChanged.connect(self._edited)
        elif spec.type is float:
            w = QtWidgets.QDoubleSpinBox()
            w.setDecimals(2)
            w.setRange(-1e12, 1e12)
            w.setMinimumWidth(140)
            w.valueChanged.connect(self._edited)
        else:
            w = QtWidgets.QLineEdit()
            w.textChanged.connect(self._edited)
            if spec.type is list and spec.name.endswith("_dirs"):
                w.setPlaceholderText("folders, separated by spaces (quote one with spaces)")
            elif spec.type is list:
                w.setPlaceholderText("arguments as on a shell command line, e.g. --flash-attn on")
            elif spec.name in SECRET_FIELDS:
                w.setEchoMode(QtWidgets.QLineEdit.EchoMode.Password)
                w.setPlaceholderText("empty: no key required")
                show = QtWidgets.QCheckBox("show")
                show.toggled.connect(
                    lambda on: w.setEchoMode(
                        QtWidgets.QLineEdit.EchoMode.Normal
                        if on
                        else QtWidgets.QLineEdit.EchoMode.Password
                    )
                )
                row.addWidget(show)
            elif spec.name in FILE_FIELDS:
                w.setPlaceholderText("empty: found automatically")
                browse = QtWidgets.QPushButton("Browse…")
                browse.clicked.connect(self._browse)
                row.addWidget(browse)
        return w

    def _browse(self) -> None:
        editor = self.editor
        assert isinstance(editor, QtWidgets.QLineEdit)
        path, _ = QtWidgets.QFileDialog.getOpenFileName(
            self.container, humanize(self.spec.name), editor.text()
        )
        if path:
            editor.setText(path)

    # ------------------------------------------------------------ values
    def fits(self, value: Any) -> bool:
        """Whether the editor can show `value` (the file may hold any TOML value)."""
        t = self.spec.type
        if t is bool:
            return isinstance(value, bool)
        if self.spec.choices:
            return value in self.spec.choices
        if t is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if t is float:
            return isinstance(value, int | float) and not isinstance(value, bool)
        if t is list:
            return isinstance(value, list) and all(isinstance(v, str) for v in value)
        return isinstance(value, str)

    def set_value(self, value: Any) -> None:
        w = self.editor
        if isinstance(w, QtWidgets.QCheckBox):
            w.setChecked(bool(value))
        elif isinstance(w, QtWidgets.QComboBox):
            w.setCurrentIndex(max(0, w.findText(str(value))))
        elif isinstance(w, QtWidgets.QSpinBox):
            w.setValue(int(value))
        elif isinstance(w, QtWidgets.QDoubleSpinBox):
            w.setValue(float(value))
        elif isinstance(w, QtWidgets.QLineEdit):
            w.setText(shlex.join(value) if self.spec.type is list else str(value))

    def _take(self, value: Any) -> None:
        """Set `value` as the user's edit (also when the editor already shows it)."""
        self.set_value(value)
        self._edited()

    def raw(self) -> Any:
        """The value as typed (may still be invalid); ValueError when it cannot be parsed."""
        w = self.editor
        if isinstance(w, QtWidgets.QCheckBox):
            return w.isChecked()
        if isinstance(w, QtWidgets.QComboBox):
            return w.currentText()
        if isinstance(w, QtWidgets.QSpinBox):
            return w.value()
        if isinstance(w, QtWidgets.QDoubleSpinBox):
            return float(w.value())
        assert isinstance(w, QtWidgets.QLineEdit)
        if self.spec.type is list:
            try:
                return shlex.split(w.text())
            except ValueError as e:
                raise ValueError(f"cannot split into arguments: {e}") from e
        return w.text()

    def check(self) -> tuple[Any, str | None]:
        """(valid value, None) or (None, what is wrong), using the schema's own checks."""
        try:
            return self.spec.coerce(self.raw()), None
        except ConfigError as e:
            return None, Problem.of(e).text
        except ValueError as e:
            return None, str(e)

    @property
    def blocking(self) -> bool:
        """Whether this field holds Save back: an edit with a problem."""
        return self.dirty and (self.problem is not None or self.rule_problem is not None)

    def shown_problem(self) -> str | None:
        """What the field says is wrong: its edit's own problem, a rule between settings,
        or (until it is edited) what the file had wrong."""
        if self.problem is not None:
            return self.problem
        if self.rule_problem is not None:
            return self.rule_problem
        if not self.dirty and self.file_problem is not None:
            return f"In the settings file: {self.file_problem}"
        return None

    def validate(self) -> bool:
        _, problem = self.check()
        self.problem = problem if self.dirty or self.file_problem is None else None
        self.show()
        if self.in_words is not None:  # not for a stand-in default of a wrong file value
            stand_in = not self.dirty and self.file_problem is not None
            value = self.raw() if problem is None and not stand_in else None
            self.in_words.setText(f"= {fmt.duration(value)}" if value else "")
        return problem is None

    def show(self) -> None:
        """Show the problem, if any, in the caption's place (the description is still the
        editor's tooltip), so the form does not jump as problems come and go."""
        shown = self.shown_problem()
        self.error.setText(shown or "")
        self.error.setVisible(shown is not None)
        self.caption.setVisible(shown is None)
        self.mark.setVisible(shown is not None)
        self.use_default.setVisible(not self.dirty and self.file_problem is not None)

    def set_rule_problem(self, text: str | None) -> None:
        """A rule between settings this field is part of (None: it holds)."""
        if text != self.rule_problem:
            self.rule_problem = text
            self.show()

    def _edited(self, *_: Any) -> None:
        if self._loading:
            return
        self.dirty = True
        self.validate()
        self.changed.emit()


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
            f._take(config_mod.SCHEMA[name].default)

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
