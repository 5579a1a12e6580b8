"""Reading the settings file leniently: every value it holds and every problem in it.

`load` (core.config.file) needs a file without a problem and raises the first one.
An editor needs more: the file's own values even when one of them is wrong, and each
problem at the setting it belongs to, so that it can show what is in the file, mark
what is wrong and write back only what the user changed (`save_changes`). `read_file`
gives that as a `FileRead`; `load` is built on it, so both judge a file alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import ParseError, TOMLKitError

from core.config.migrations import migrate
from core.config.schema import SCHEMA, Problem, Settings
from core.config.validate import read_document
from core.errors import ConfigError


@dataclass(frozen=True)
class FileRead:
    """The settings file as it is.

    `values` holds every setting of the sections: the file's value where it is valid,
    the default elsewhere. `written` holds what the file says for each setting it names,
    valid or not (an editor shows a wrong value that fits its field). `settings` is the
    whole file, only when it has no problem. A file that is not valid TOML, or that a
    newer Warmslot wrote, is not `writable`: nothing may write it until a person fixed
    it (its first problem says where).
    """

    path: Path
    exists: bool
    values: dict[str, Any]
    written: dict[str, Any]
    problems: tuple[Problem, ...]
    settings: Settings | None
    writable: bool

    @property
    def ok(self) -> bool:
        return not self.problems

    def problems_at(self, name: str) -> list[Problem]:
        """The problems shown at setting `name` (its own and the rules it is part of)."""
        return [p for p in self.problems if p.key == name]

    def file_problems(self) -> list[Problem]:
        """The problems no setting of the sections shows: broken TOML, a version, an
        unknown section or key, the lists of tables."""
        return [p for p in self.problems if p.key not in SCHEMA]


def keys_beside(config_file: Path) -> Path:
    """The named API keys' file beside the settings file (core.keys.keys_file)."""
    return config_file.with_name("keys.toml")


def read_file(path: Path) -> FileRead:
    """Read `path` leniently (see the module doc); a missing file reads as the defaults."""
    if not path.exists():
        return read_text(None, path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        error = ConfigError(f"not valid TOML: not UTF-8 text ({e})", file=str(path))
        return _unreadable(path, Problem("", f"The file {path} is not UTF-8 text.", error))
    return read_text(text, path)


def read_text(text: str | None, path: Path) -> FileRead:
    """`read_file` of `text` as the content of `path` (None: no file)."""
    defaults = {name: spec.default for name, spec in SCHEMA.items()}
    if text is None:
        return FileRead(path, False, defaults, {}, (), Settings(), True)
    try:
        raw = tomlkit.parse(text).unwrap()
    except TOMLKitError as e:
        error = ConfigError(f"not valid TOML: {e}", file=str(path))
        line = e.line if isinstance(e, ParseError) else None
        # tomlkit counts columns from 0; an editor, and the message, from 1.
        col = e.col + 1 if isinstance(e, ParseError) else None
        where = f" at line {line}, column {col}" if line is not None else ""
        words = f"{path} is not valid TOML{where}: {_reason(e)}."
        return _unreadable(path, Problem("", words, error, (), line, col))
    try:
        doc = migrate(raw, str(path))
    except ConfigError as e:
        words = f"{path}: {e.user_message()}"
        return _unreadable(path, Problem("version", words, e, ("version",)))
    settings, problems = read_document(doc, path=str(path), keys_path=keys_beside(path))
    written: dict[str, Any] = {}
    for section, table in doc.items():
        if isinstance(table, dict):
            for key, value in table.items():
                if f"{section}.{key}" in SCHEMA:
                    written[f"{section}.{key}"] = value
    wrong = {p.key for p in problems}
    values = {name: defaults[name] if name in wrong else settings.get(name) for name in SCHEMA}
    return FileRead(
        path,
        True,
        values,
        written,
        tuple(problems),
        None if problems else settings,
        True,
    )


def _unreadable(path: Path, problem: Problem) -> FileRead:
    defaults = {name: spec.default for name, spec in SCHEMA.items()}
    return FileRead(path, True, defaults, {}, (problem,), None, False)


def _reason(e: TOMLKitError) -> str:
    """tomlkit's message without its own " at line L col C" (said once, in words)."""
    text = str(e)
    cut = text.rfind(" at line ")
    return (text[:cut] if cut > 0 else text).rstrip(".")
