"""The settings file on disk: loading, the commented default file, and writing
one value (`set_value`) or all of them (`save`) while keeping the file's comments.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from core.config.migrations import SCHEMA_VERSION, migrate
from core.config.schema import (
    BACKEND_SCHEMA,
    PROFILE_SCHEMA,
    SCHEMA,
    WORKER_SCHEMA,
    Settings,
    iter_specs,
    split_name,
)
from core.config.tables import BackendSettings, ModelProfile, WorkerSettings
from core.config.validate import (
    backends_from_list,
    profiles_from_list,
    settings_from_dict,
    workers_from_list,
)
from core.errors import ConfigError


def load(path: Path) -> Settings:
    """Load settings from `path`; defaults when it does not exist."""
    if not path.exists():
        return Settings()
    try:
        raw = tomlkit.parse(path.read_text(encoding="utf-8")).unwrap()
    except (TOMLKitError, UnicodeDecodeError) as e:
        raise ConfigError(f"not valid TOML: {e}", file=str(path)) from e
    return settings_from_dict(
        migrate(raw, str(path)), path=str(path), keys_path=keys_beside(path)
    )


def keys_beside(config_file: Path) -> Path:
    """The named API keys' file beside the settings file (core.keys.keys_file)."""
    return config_file.with_name("keys.toml")


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


def set_value(path: Path, name: str, value: Any) -> Settings:
    """Validate and write one setting, keeping the file's comments. Returns the new settings."""
    spec = SCHEMA.get(name)
    if spec is None:
        split_name(name)  # raises the standard unknown-setting error
        raise AssertionError
    value = spec.coerce(value, file=str(path))
    ensure_file(path)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    migrated = migrate(doc.unwrap(), str(path))
    if migrated.get("version") != doc.get("version", 1):
        doc = tomlkit.parse(tomlkit.dumps(migrated))
    section, key = name.split(".", 1)
    if section not in doc:
        doc.add(section, tomlkit.table())
    table: Any = doc[section]
    table[key] = value
    new = settings_from_dict(doc.unwrap(), path=str(path), keys_path=keys_beside(path))
    _atomic_write(path, tomlkit.dumps(doc))
    return new


def save(path: Path, settings: Settings) -> None:
    """Write every value that differs from the file, keeping comments."""
    ensure_file(path)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    for spec in iter_specs():
        section, key = spec.name.split(".", 1)
        value = settings.get(spec.name)
        if section not in doc:
            doc.add(section, tomlkit.table())
        table: Any = doc[section]
        if key not in table or table[key] != value:
            table[key] = value
    # Arrays of tables ([[models]], [[workers]], [[backends]]) are rewritten only when
    # they changed, so a hand-edited file keeps its comments otherwise.
    tables: list[tuple[str, Callable[..., Any], Sequence[Any], Callable[[Any], Any]]] = [
        ("models", profiles_from_list, settings.models, _profile_table),
        ("workers", workers_from_list, settings.workers, _worker_table),
        ("backends", backends_from_list, settings.backends, _backend_table),
    ]
    for name, parse, wanted, to_table in tables:
        if parse(doc.unwrap().get(name, []), path=str(path)) == wanted:
            continue
        if name in doc:
            del doc[name]
        if wanted:
            aot = tomlkit.aot()
            for item in wanted:
                aot.append(to_table(item))
            doc.add(name, aot)
    settings_from_dict(
        migrate(doc.unwrap(), str(path)), path=str(path), keys_path=keys_beside(path)
    )
    _atomic_write(path, tomlkit.dumps(doc))


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
