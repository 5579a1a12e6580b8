"""One editor of the settings dialog: a setting's widget chosen by its type, its checks
and its problem in words (`app.settings_dialog` lays them out, one tab per section)."""

from __future__ import annotations

import shlex
from typing import Any

from app import fmt
from app.qt import QObject, QtWidgets, Signal
from core import config as config_mod
from core.config import Applies, Problem, SettingSpec
from core.errors import ConfigError

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
ERROR_STYLE = "color: #c92a2a;"
WHEN_TIP = {
    Applies.LIVE: "Takes effect at once.",
    Applies.SERVER: "Takes effect when llama-server restarts (↻).",
    Applies.WARMSLOT: "Takes effect when Warmslot restarts (⟳).",
}


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
        self.use_default.clicked.connect(lambda: self.take(spec.default))
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

    def take(self, value: Any) -> None:
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
