"""Settings: one typed schema, declared once, persisted as commented TOML.

Each section is a dataclass; each field carries its description and validator in
its metadata. Everything else — the default file with comments, validation with
errors that name file, key, expected and got, `warmslot config set`, and the GUI's
settings dialog — is derived from these declarations.

The file carries ``version``; older files are upgraded by `MIGRATIONS` in order.

The package's modules, by responsibility: `checks` (the validators a field names),
`sections` (``[server]``, ``[proxy]`` …), `tables` (``[[models]]``, ``[[workers]]``,
``[[backends]]``), `schema` (`Settings`, `SettingSpec`, the rules between settings),
`validate` (a document into `Settings`), `reading` (the file as it is, each problem
at its setting), `migrations`, `file` (load, write the changed settings only) and
`secrets`. Callers import from ``core.config``.

Every setting declares when a change takes effect (`Applies`: at once, when
llama-server restarts, when Warmslot restarts).
"""

from __future__ import annotations

from core.config.checks import Applies, Check
from core.config.file import (
    Edit,
    default_document,
    edit_file,
    ensure_file,
    load,
    plan_update,
    save_changes,
    set_value,
)
from core.config.migrations import MIGRATIONS, SCHEMA_VERSION, Migration, migrate
from core.config.reading import FileRead, keys_beside, read_file
from core.config.schema import (
    BACKEND_SCHEMA,
    LIST_SECTIONS,
    PROFILE_SCHEMA,
    SCHEMA,
    WORKER_SCHEMA,
    Problem,
    Settings,
    SettingSpec,
    SettingsUpdate,
    applies_of,
    changed_settings,
    check_settings,
    iter_specs,
    settings_problems,
)
from core.config.secrets import SECRET_SETTINGS, settings_changes
from core.config.sections import (
    TTL_CLASSES,
    CacheSettings,
    PoolSettings,
    PressureSettings,
    ProxySettings,
    ServerSettings,
    TelemetrySettings,
)
from core.config.tables import ROLES, BackendSettings, ModelProfile, WorkerSettings
from core.config.validate import (
    backends_from_list,
    profiles_from_list,
    settings_from_dict,
    workers_from_list,
)

__all__ = [
    "BACKEND_SCHEMA",
    "LIST_SECTIONS",
    "MIGRATIONS",
    "PROFILE_SCHEMA",
    "ROLES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SECRET_SETTINGS",
    "TTL_CLASSES",
    "WORKER_SCHEMA",
    "Applies",
    "BackendSettings",
    "CacheSettings",
    "Check",
    "Edit",
    "FileRead",
    "Migration",
    "ModelProfile",
    "PoolSettings",
    "PressureSettings",
    "Problem",
    "ProxySettings",
    "ServerSettings",
    "SettingSpec",
    "Settings",
    "SettingsUpdate",
    "TelemetrySettings",
    "WorkerSettings",
    "applies_of",
    "backends_from_list",
    "changed_settings",
    "check_settings",
    "default_document",
    "edit_file",
    "ensure_file",
    "iter_specs",
    "keys_beside",
    "load",
    "migrate",
    "plan_update",
    "profiles_from_list",
    "read_file",
    "save_changes",
    "set_value",
    "settings_changes",
    "settings_from_dict",
    "settings_problems",
    "workers_from_list",
]
