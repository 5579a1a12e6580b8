"""Validating a settings document (a plain dict, already migrated) into `Settings`:
the sections key by key, and the lists of tables as a whole (unique names, one primary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.config.schema import (
    BACKEND_SCHEMA,
    LIST_SECTIONS,
    PROFILE_SCHEMA,
    SCHEMA,
    WORKER_SCHEMA,
    Problem,
    Settings,
    settings_problems,
)
from core.config.tables import BackendSettings, ModelProfile, WorkerSettings
from core.errors import ConfigError


def profiles_from_list(values: Any, *, path: str = "<settings>") -> list[ModelProfile]:
    """Validate the ``[[models]]`` tables: known keys, types, unique names, one primary."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            "wrong type", file=path, key="models", expected="a list of tables ([[models]])"
        )
    out: list[ModelProfile] = []
    for i, table in enumerate(values):
        prof = ModelProfile()
        for key, value in table.items():
            spec = PROFILE_SCHEMA.get(f"models.{key}")
            if spec is None:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=f"models[{i}].{key}",
                    expected="one of " + ", ".join(k.split(".", 1)[1] for k in PROFILE_SCHEMA),
                )
            setattr(prof, key, spec.coerce(value, file=path))
        if not prof.name:
            raise ConfigError(
                "missing value", file=path, key=f"models[{i}].name", expected="a model name"
            )
        if prof.name in {p.name for p in out}:
            raise ConfigError(
                "duplicate model name", file=path, key=f"models[{i}].name", got=prof.name
            )
        if not prof.model and (prof.role != "text" or any(p.role == "text" for p in out)):
            raise ConfigError(
                "missing value",
                file=path,
                key=f"models[{i}].model",
                expected="a GGUF path (only the first 'text' profile may use server.model)",
            )
        out.append(prof)
    if out and not any(p.role == "text" for p in out):
        raise ConfigError(
            "no primary model",
            file=path,
            key="models",
            expected="at least one profile with role 'text' (the first is the primary)",
        )
    return out


def workers_from_list(values: Any, *, path: str = "<settings>") -> list[WorkerSettings]:
    """Validate the ``[[workers]]`` tables: known keys, types, an address each, no
    worker named or listed twice."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            "wrong type", file=path, key="workers", expected="a list of tables ([[workers]])"
        )
    out: list[WorkerSettings] = []
    for i, table in enumerate(values):
        worker = WorkerSettings()
        for key, value in table.items():
            spec = WORKER_SCHEMA.get(f"workers.{key}")
            if spec is None:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=f"workers[{i}].{key}",
                    expected="one of " + ", ".join(k.split(".", 1)[1] for k in WORKER_SCHEMA),
                )
            # Errors name the table too: `workers[1].port`, not just `workers.port`.
            named = dataclasses.replace(spec, name=f"workers[{i}].{key}")
            setattr(worker, key, named.coerce(value, file=path))
        if not worker.address:
            raise ConfigError(
                "missing value",
                file=path,
                key=f"workers[{i}].address",
                expected="the worker's host name or IPv4 address",
            )
        if worker.endpoint in {w.endpoint for w in out}:
            raise ConfigError(
                "worker listed twice",
                file=path,
                key=f"workers[{i}]",
                expected="each address:port once",
                got=worker.endpoint,
            )
        if worker.name and worker.name in {w.name for w in out}:
            raise ConfigError(
                "duplicate worker name",
                file=path,
                key=f"workers[{i}].name",
                expected="a name no other worker has",
                got=worker.name,
            )
        out.append(worker)
    return out


def backends_from_list(values: Any, *, path: str = "<settings>") -> list[BackendSettings]:
    """Validate the ``[[backends]]`` tables: known keys, types, a unique name each, the
    launch options only where Warmslot launches the backend."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            "wrong type", file=path, key="backends", expected="a list of tables ([[backends]])"
        )
    out: list[BackendSettings] = []
    for i, table in enumerate(values):
        backend = BackendSettings()
        for key, value in table.items():
            spec = BACKEND_SCHEMA.get(f"backends.{key}")
            if spec is None:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=f"backends[{i}].{key}",
                    expected="one of " + ", ".join(k.split(".", 1)[1] for k in BACKEND_SCHEMA),
                )
            named = dataclasses.replace(spec, name=f"backends[{i}].{key}")
            setattr(backend, key, named.coerce(value, file=path))
        if not backend.name:
            raise ConfigError(
                "missing value", file=path, key=f"backends[{i}].name", expected="a name"
            )
        if backend.name in {b.name for b in out}:
            raise ConfigError(
                "duplicate backend name",
                file=path,
                key=f"backends[{i}].name",
                expected="a name no other backend has",
                got=backend.name,
            )
        if backend.url and (backend.threads or backend.extra_args):
            raise ConfigError(
                "launch options on a remote backend",
                file=path,
                key=f"backends[{i}]",
                expected="threads and extra_args only where url is empty (launched here)",
            )
        out.append(backend)
    return out


def read_document(
    doc: dict[str, object], *, path: str = "<settings>", keys_path: Path | None = None
) -> tuple[Settings, list[Problem]]:
    """Every valid value of a plain dict (already migrated) in `Settings` (defaults for
    the rest) and every problem, in the document's order, then the rules between
    settings. A rule is not checked on a setting whose own value is wrong (it would be
    judged on the default that stands in for it). `keys_path`: see `check_settings`."""
    settings = Settings()
    problems: list[Problem] = []
    tables: dict[str, Callable[..., Sequence[object]]] = {
        "models": profiles_from_list,
        "workers": workers_from_list,
        "backends": backends_from_list,
    }
    for section, values in doc.items():
        if section == "version":
            continue
        if section in LIST_SECTIONS:
            try:
                setattr(settings, section, tables[section](values, path=path))
            except ConfigError as e:
                problems.append(Problem.of(e))
            continue
        if not isinstance(values, dict) or not hasattr(settings, section):
            unknown = ConfigError(
                "unknown section",
                file=path,
                key=section,
                expected="one of " + ", ".join(f.name for f in dataclasses.fields(Settings)),
                got=section,
            )
            words = f"Not a section of Warmslot's settings: [{section}]."
            problems.append(Problem.of(unknown, words))
            continue
        target = getattr(settings, section)
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in SCHEMA:
                bad = ConfigError(
                    "unknown setting",
                    file=path,
                    key=name,
                    hint="`warmslot config show` lists every setting",
                )
                problems.append(Problem.of(bad, f"Not a setting of this Warmslot: {name}."))
                continue
            try:
                setattr(target, key, SCHEMA[name].coerce(value, file=path))
            except ConfigError as e:
                problems.append(Problem.of(e))
    wrong = {p.key for p in problems}
    for rule in settings_problems(settings, file=path, keys_path=keys_path):
        if not wrong.intersection(rule.involves):
            problems.append(rule)
    return settings, problems


def settings_from_dict(
    doc: dict[str, object], *, path: str = "<settings>", keys_path: Path | None = None
) -> Settings:
    """Validate a plain dict (already migrated) into `Settings` (`keys_path`: see
    `check_settings`); raises the first problem's ConfigError."""
    settings, problems = read_document(doc, path=path, keys_path=keys_path)
    if problems:
        raise problems[0].error
    return settings
