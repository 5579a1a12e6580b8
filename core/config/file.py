"""The settings file on disk: loading, the commented default file, and writing the
settings a person changed (`save_changes`, `set_value`) while keeping everything else
in the file as it was, byte for byte.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from core.config.keys import keys_file
from core.config.migrations import SCHEMA_VERSION, migrate
from core.config.reading import FileRead, read_file, read_text
from core.config.schema import (
    BACKEND_SCHEMA,
    LIST_SECTIONS,
    PROFILE_SCHEMA,
    SCHEMA,
    WORKER_SCHEMA,
    Settings,
    SettingsUpdate,
    iter_specs,
    split_name,
)
from core.config.tables import BackendSettings, ModelProfile, WorkerSettings
from core.config.validate import backends_from_list, profiles_from_list, workers_from_list
from core.errors import ConfigError


def load(path: Path) -> Settings:
    """Load settings from `path`; defaults when it does not exist. Raises the file's
    first problem (`core.config.reading.read_file` lists them all)."""
    got = read_file(path)
    if got.settings is None:
        raise got.problems[0].error
    return got.settings


def default_document() -> tomlkit.TOMLDocument:
    """The default settings file, every key commented with its description."""
    doc = tomlkit.document()
    doc.add(tomlkit.comment("Warmslot settings. Edit here, in the tray's Settings, or with"))
    doc.add(tomlkit.comment("`warmslot config set KEY VALUE`. Unknown keys are an error."))
    doc.add("version", SCHEMA_VERSION)
    current = ""
    table: Any = None
    for spec in iter_specs():
        section, key = spec.name.split(".", 1)
        if section != current:
            current = section
            table = tomlkit.table()
            doc.add(tomlkit.nl())
            doc.add(section, table)
        for line in _wrap(spec.description):
            table.add(tomlkit.comment(line))
        if spec.choices:
            table.add(tomlkit.comment("choices: " + ", ".join(spec.choices)))
        table.add(key, spec.default)
    return doc


def _wrap(text: str, width: int = 88) -> list[str]:
    lines: list[str] = []
    cur = ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        lines.append(cur)
    return lines


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_file(path: Path) -> None:
    """Write the commented default file if there is none."""
    if not path.exists():
        _atomic_write(path, tomlkit.dumps(default_document()))


def set_value(path: Path, name: str, value: Any) -> FileRead:
    """Validate and write one setting (`save_changes`); the file as it is afterwards."""
    return save_changes(path, {name: value})


# The lists of tables a change may replace as a whole, and how each is checked and written.
_TABLES: dict[str, tuple[Callable[..., Sequence[Any]], Callable[[Any], Any]]] = {
    "models": (profiles_from_list, lambda p: _profile_table(p)),
    "workers": (workers_from_list, lambda w: _worker_table(w)),
    "backends": (backends_from_list, lambda b: _backend_table(b)),
}


@dataclass(frozen=True)
class Edit:
    """Changes to the settings file, checked and not yet written (`edit_file`)."""

    path: Path
    before: str | None  # the file's text when it was read (None: there was no file)
    text: str  # its text with the changes
    after: FileRead  # the file as it reads with them

    def write(self) -> FileRead:
        """Write the new text (nothing when it is the same); the file as it reads then.
        Refused when the file changed since it was read (written by hand meanwhile)."""
        now = self.path.read_text(encoding="utf-8") if self.path.exists() else None
        if now != self.before:
            raise ConfigError(
                "the settings file changed while the change was made; nothing was written",
                file=str(self.path),
                hint="make the change again",
            )
        if self.text != self.before:
            _atomic_write(self.path, self.text)
        return self.after


def save_changes(path: Path, changes: Mapping[str, object]) -> FileRead:
    """Write `changes` into the settings file and nothing else (`edit_file`); the file
    as it reads then."""
    return edit_file(path, changes).write()


def edit_file(path: Path, changes: Mapping[str, object]) -> Edit:
    """`changes` made to the settings file's text, checked, not yet written.

    `changes` maps dotted setting names to values, or ``models`` / ``workers`` /
    ``backends`` to the whole list of their tables. Every other byte of the file stays
    as it was (comments, order, values the file has wrong). A missing file starts as the
    commented default file. Refused with ConfigError when a value is invalid, when the
    file is not valid TOML or is from a newer Warmslot, or when the result would have a
    problem at a changed setting or one the file did not have before (a rule between
    settings the change breaks)."""
    before = read_file(path)
    if not before.writable:
        raise before.problems[0].error
    values: dict[str, object] = {}
    for name, value in changes.items():
        if name in LIST_SECTIONS:
            values[name] = value
            continue
        spec = SCHEMA.get(name)
        if spec is None:
            split_name(name)  # raises the standard unknown-setting error
            raise AssertionError
        values[name] = spec.coerce(value, file=str(path))
    text = path.read_text(encoding="utf-8") if before.exists else None
    doc = tomlkit.parse(text if text is not None else tomlkit.dumps(default_document()))
    migrated = migrate(doc.unwrap(), str(path))
    if migrated.get("version") != doc.get("version", 1):
        doc = tomlkit.parse(tomlkit.dumps(migrated))
    for name, value in values.items():
        if name in _TABLES:
            _replace_tables(doc, name, value, str(path))
            continue
        section, key = name.split(".", 1)
        if section not in doc:
            doc.add(section, tomlkit.table())
        table: Any = doc[section]
        if not isinstance(table, dict):
            raise ConfigError(
                "cannot write into a value that is not a table",
                file=str(path),
                key=section,
                expected=f"a [{section}] table",
                got=table,
            )
        table[key] = value
    new_text = tomlkit.dumps(doc)
    after = read_text(new_text, path)
    known = {p.key for p in before.problems}
    for problem in after.problems:
        if problem.key not in known or set(problem.involves) & set(values):
            raise problem.error
    return Edit(path, text, new_text, after)


def plan_update(
    path: Path, current: Settings, changes: Mapping[str, object], *, persist: bool
) -> tuple[Edit | None, Settings | None, SettingsUpdate]:
    """What `changes` (dotted names, or ``models`` / ``workers`` / ``backends`` with
    their whole list) would do to the running `current` settings, nothing written yet:
    with `persist`, the edit of the settings file at `path` (`edit_file`) and the whole
    file as it would read then (None when it still has a problem, listed in the answer);
    without, `current` with the changes and no edit. Raises ConfigError for a change
    the file or the rules refuse."""
    if not persist:
        new = current.with_changes(changes, keys_path=keys_file(path))
        return None, new, SettingsUpdate.between(current, new)
    edit = edit_file(path, changes)
    if edit.after.settings is None:
        return edit, None, SettingsUpdate(problems=edit.after.problems)
    after = edit.after.settings
    return edit, after, SettingsUpdate.between(current, after)


def _replace_tables(doc: Any, name: str, wanted: Any, path: str) -> None:
    """Replace the ``[[name]]`` tables by `wanted`, unless they hold just that already
    (a hand-edited file keeps its comments then)."""
    parse, to_table = _TABLES[name]
    if not isinstance(wanted, list):
        raise ConfigError("wrong type", file=path, key=name, expected=f"a list of {name}")
    current = doc.unwrap().get(name, [])
    try:
        if parse(current, path=path) == wanted:
            return
    except ConfigError:
        pass  # what the file holds is wrong: replaced
    if name in doc:
        del doc[name]
    if wanted:
        aot = tomlkit.aot()
        for item in wanted:
            aot.append(to_table(item))
        doc.add(name, aot)


def _backend_table(backend: BackendSettings) -> Any:
    table = tomlkit.table()
    for spec in BACKEND_SCHEMA.values():
        key = spec.name.split(".", 1)[1]
        value = getattr(backend, key)
        if key == "name" or value != spec.default:
            table.add(key, value)
    return table


def _worker_table(worker: WorkerSettings) -> Any:
    table = tomlkit.table()
    for spec in WORKER_SCHEMA.values():
        key = spec.name.split(".", 1)[1]
        value = getattr(worker, key)
        if key in ("address", "port") or value != spec.default:
            table.add(key, value)
    return table


def _profile_table(prof: ModelProfile) -> Any:
    table = tomlkit.table()
    for spec in PROFILE_SCHEMA.values():
        key = spec.name.split(".", 1)[1]
        value = getattr(prof, key)
        if key in ("name", "model", "role") or value != spec.default:
            table.add(key, value)
    return table
