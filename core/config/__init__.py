"""Settings: one typed schema, declared once, persisted as commented TOML.

Each section is a dataclass; each field carries its description and validator in
its metadata. Everything else — the default file with comments, validation with
errors that name file, key, expected and got, `warmslot config set`, and the GUI's
settings dialog — is derived from these declarations.

The file carries ``version``; older files are upgraded by `MIGRATIONS` in order.

The package's modules, by responsibility: `checks` (the validators a field names),
`sections` (``[server]``, ``[proxy]`` …), `tables` (``[[models]]``, ``[[workers]]``,
``[[backends]]``), `schema` (`Settings`, `SettingSpec`, the rules between settings),
`validate` (a document into `Settings`), `migrations`, `file` (load, save, set one
value) and `secrets`. Callers import from ``core.config``.
"""

from __future__ import annotations

from core.config.checks import Check
from core.config.file import default_document, ensure_file, keys_beside, load, save, set_value
from core.config.migrations import MIGRATIONS, SCHEMA_VERSION, Migration, migrate
from core.config.schema import (
    BACKEND_SCHEMA,
    LIST_SECTIONS,
    PROFILE_SCHEMA,
    SCHEMA,
    WORKER_SCHEMA,
    Settings,
    SettingSpec,
    check_settings,
    iter_specs,
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
    "BackendSettings",
    "CacheSettings",
    "Check",
    "Migration",
    "ModelProfile",
    "PoolSettings",
    "PressureSettings",
    "ProxySettings",
    "ServerSettings",
    "SettingSpec",
    "Settings",
    "TelemetrySettings",
    "WorkerSettings",
    "backends_from_list",
    "check_settings",
    "default_document",
    "ensure_file",
    "iter_specs",
    "keys_beside",
    "load",
    "migrate",
    "profiles_from_list",
    "save",
    "set_value",
    "settings_changes",
    "settings_from_dict",
    "workers_from_list",
]
