"""The settings dialog, generated from `core.config.SCHEMA`.

One tab per section, one editor per setting chosen by its type (check box,
choice list, number, text, argument list); the description is the tooltip and
the caption. Every edit is checked with the setting's own `coerce` (type and
validator) and a problem is shown under the field; Save stays disabled until all
fields are valid. Saving goes through the core (`update_settings`), which writes
the TOML file; when a setting that needs a llama-server restart changed, the
dialog offers the restart instead of closing.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from app import fmt
from app.backend import Backend
from app.controller import error_text
from app.dialogs import RestartOffer
from app.qt import QObject, Qt, QtWidgets, Signal
from app.tasks import Tasks
from core import autostart
from core import config as config_mod
from core.config import Settings, SettingSpec
from core.errors import ConfigError
from core.keys import keys_file

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
}


def humanize(name: str) -> str:
    """``cache.ttl_short_s`` → ``TTL short (s)``."""
    words = [WORDS.get(w, w) for w in name.split(".", 1)[1].split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


class Field(QObject):
    """An editor for one setting, with its error label."""

    changed = Signal()

    def __init__(self, spec: SettingSpec, value: Any, parent: QtWidgets.QWidget) -> None:
        super().__init__(parent)
        self.spec = spec
        self.container = QtWidgets.QWidget(parent)
        col = QtWidgets.QVBoxLayout(self.container)
        col.setContentsMargins(0, 0, 0, 4)
        col.setSpacing(2)
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        self._compact = spec.type in (int, float, bool) or bool(spec.choices)
        self.editor = self._make_editor(row)
        self.editor.setObjectName(spec.name)
        tip = spec.description + (
            "\n\nTakes effect after llama-server restarts." if spec.restart else ""
        )
        self.editor.setToolTip(tip)
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
        if self._compact:
            row.addStretch(1)
        col.addLayout(row)
        self.error = QtWidgets.QLabel()
        self.error.setObjectName(f"{spec.name}:error")
        self.error.setStyleSheet("color: #c92a2a;")
        self.error.setWordWrap(True)
        self.error.hide()
        col.addWidget(self.error)
        self.caption = QtWidgets.QLabel(spec.description)
        self.caption.setWordWrap(True)
        self.caption.setStyleSheet("color: #777; font-size: small;")
        col.addWidget(self.caption)
        self.set_value(value)
        self.problem: str | None = None

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
            if spec.type is list:
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
            if e.expected is not None:
                return None, f"Expected {e.expected}; got {e.got!r}."
            return None, str(e)
        except ValueError as e:
            return None, str(e)

    def validate(self) -> bool:
        _, problem = self.check()
        self.problem = problem
        self.error.setText(problem or "")
        # The error takes the caption's place, so the form does not jump as errors come
        # and go (the description is still the editor's tooltip).
        self.error.setVisible(problem is not None)
        self.caption.setVisible(problem is None)
        self.mark.setVisible(problem is not None)
        if self.in_words is not None:
            value = self.raw() if problem is None else None
            self.in_words.setText(f"= {fmt.duration(value)}" if value else "")
        return problem is None

    def show_problem(self, problem: str) -> None:
        """Show a problem found beyond this field's own checks (until it is edited)."""
        self.problem = problem
        self.error.setText(problem)
        self.error.setVisible(True)
        self.caption.setVisible(False)
        self.mark.setVisible(True)

    def _edited(self, *_: Any) -> None:
        self.validate()
        self.changed.emit()


class SettingsDialog(QtWidgets.QDialog):
    """Edit every core setting; saves through the backend (the core) to the TOML file."""

    saved = Signal(object, list)  # new Settings, names that need a restart

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
        current = backend.settings

        self.tabs = QtWidgets.QTabWidget()
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
                self.tabs.addTab(scroll, SECTION_TITLES.get(section, section.title()))
                forms[section] = form
            field = Field(spec, current.get(spec.name), self)
            field.changed.connect(self._update)
            self.fields[spec.name] = field
            label = QtWidgets.QLabel(humanize(spec.name) + (" ↻" if spec.restart else ""))
            label.setToolTip(spec.description)
            forms[section].addRow(label, field.container)

        # Not a core setting: the XDG autostart entry is the truth (core/autostart.py).
        self.autostart = QtWidgets.QCheckBox("Start Warmslot's tray at login")
        self.autostart.setObjectName("autostart")
        self.autostart.setChecked(autostart.is_enabled())
        self.autostart.setEnabled(autostart.supported())
        if not autostart.supported():
            self.autostart.setToolTip("On this system the installer sets this up.")
        else:
            self.autostart.setToolTip(str(autostart.entry_path()))

        self.status = QtWidgets.QLabel("↻ = takes effect after llama-server restarts")
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
        self.buttons.button(
            QtWidgets.QDialogButtonBox.StandardButton.RestoreDefaults
        ).clicked.connect(self.restore_defaults)

        lay = QtWidgets.QVBoxLayout(self)
        lay.addWidget(self.tabs, 1)
        lay.addWidget(self.autostart)
        lay.addWidget(self.status)
        lay.addWidget(self.restart_box)
        lay.addWidget(self.buttons)
        self.resize(720, 640)
        for f in self.fields.values():
            f.validate()
        self._update()

    # ------------------------------------------------------------ state
    @property
    def problems(self) -> dict[str, str]:
        return {n: f.problem for n, f in self.fields.items() if f.problem}

    def _update(self) -> None:
        bad = self.problems
        self.save_button.setEnabled(not bad)
        if bad:
            names = ", ".join(humanize(n) for n in list(bad)[:3])
            self.status.setText(
                f"{len(bad)} setting{'s need' if len(bad) > 1 else ' needs'} attention: {names}"
            )
            self.status.setStyleSheet("color: #c92a2a;")
        else:
            self.status.setText("↻ = takes effect after llama-server restarts")
            self.status.setStyleSheet("")

    def restore_defaults(self) -> None:
        for name, f in self.fields.items():
            f.set_value(config_mod.SCHEMA[name].default)

    def new_settings(self) -> Settings:
        """The settings as edited (raises ConfigError if a field is invalid)."""
        s = self.backend.settings
        for name, f in self.fields.items():
            value, problem = f.check()
            if problem is not None:
                raise ConfigError(problem, key=name)
            if s.get(name) != value:
                s = s.replace(name, value, check=False)
        # The rules between settings, on the whole result; named API keys (core.keys)
        # allow a non-loopback proxy.host too.
        core = getattr(self.backend, "core", None)
        keys = keys_file(core.paths.config_file) if core is not None else None
        config_mod.check_settings(s, keys_path=keys)
        return s

    # ------------------------------------------------------------ saving
    def save(self) -> None:
        if any(not f.validate() for f in self.fields.values()):
            self._update()
            return
        try:
            new = self.new_settings()
        except ConfigError as e:
            field = self.fields.get(e.key or "")
            if field is not None:  # a rule between settings: shown at the field it names
                field.show_problem(str(e))
            self.status.setText(str(e))
            self.status.setStyleSheet("color: #c92a2a;")
            return
        self.save_button.setEnabled(False)
        self.status.setText("Saving…")
        self.tasks.watch(
            self.backend.update_settings(new),
            lambda names: self._saved(new, names),
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

    def _saved(self, new: Settings, restart_names: list[str]) -> None:
        if problem := self.apply_autostart():
            self.status.setText(problem)
            self.status.setStyleSheet("color: #c92a2a;")
            self.save_button.setEnabled(True)
            return
        self.saved.emit(new, list(restart_names))
        self.save_button.setEnabled(True)
        self.pending_restart = list(restart_names)
        if restart_names and self._server_running():
            self.status.setText("Saved.")
            shown = ", ".join(humanize(n) for n in restart_names[:4])
            more = f" and {len(restart_names) - 4} more" if len(restart_names) > 4 else ""
            self.restart_text.setText(
                f"Saved. {shown}{more} take effect when llama-server restarts "
                "(its slots are saved and restored where the cache allows)."
            )
            self.restart_box.show()
            self.restart_now.setEnabled(self._restart is not None)
            return
        self.status.setText("Saved.")
        self.accept()

    def _save_failed(self, exc: BaseException) -> None:
        self.save_button.setEnabled(True)
        self.status.setText(f"Could not save: {error_text(exc)}")
        self.status.setStyleSheet("color: #c92a2a;")

    def _do_restart(self) -> None:
        if self._restart is not None:
            self._restart()
        self.accept()
