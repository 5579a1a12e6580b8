"""The settings schema: `Settings` (every section), one `SettingSpec` per setting
derived from the dataclasses' declarations (`SCHEMA`, and one per list of tables),
and the rules that involve more than one setting (`check_settings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_type_hints

import tomlkit
from tomlkit.exceptions import TOMLKitError

from core.config.checks import Check, is_loopback
from core.config.sections import (
    CacheSettings,
    PoolSettings,
    PressureSettings,
    ProxySettings,
    ServerSettings,
    TelemetrySettings,
)
from core.config.tables import BackendSettings, ModelProfile, WorkerSettings
from core.errors import ConfigError
from core.keys import KeyFileError, load_keys


@dataclass
class Settings:
    """All of Warmslot's settings. Access as ``settings.server.port``.

    `models` is a list of tables (``[[models]]``), not a section: its fields are in
    `PROFILE_SCHEMA`. With no profiles Warmslot runs the single `server.model`.
    """

    server: ServerSettings = field(default_factory=ServerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    pressure: PressureSettings = field(default_factory=PressureSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    models: list[ModelProfile] = field(default_factory=list)
    workers: list[WorkerSettings] = field(default_factory=list)
    backends: list[BackendSettings] = field(default_factory=list)

    def get(self, name: str) -> Any:
        """Value of a dotted name such as ``proxy.port``."""
        section, key = split_name(name)
        return getattr(getattr(self, section), key)

    def replace(self, name: str, value: Any, *, check: bool = True) -> Settings:
        """A copy with one validated value changed. With `check`, the rules between
        settings (`check_settings`) must hold too; an editor that changes several at
        once passes ``check=False`` and checks the result once (one change may only be
        valid with the next)."""
        spec = SCHEMA[name]
        spec.validate(value)
        new = dataclasses.replace(self)
        section, key = split_name(name)
        setattr(new, section, dataclasses.replace(getattr(self, section), **{key: value}))
        if check:
            check_settings(new)
        return new

    def as_dict(self) -> dict[str, dict[str, object]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SettingSpec:
    """One setting: dotted name, type, default, description, validation."""

    name: str
    type: type
    default: Any
    description: str
    check: Check | None
    restart: bool
    choices: tuple[str, ...] | None

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "a string",
            list: "a list of strings",
        }[self.type]

    def coerce(self, value: Any, *, file: str | None = None) -> Any:
        """Check the type (ints are accepted for floats) and return the value."""
        ok: bool
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif self.type is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            value = [str(v) for v in value] if ok else value
        else:
            ok = isinstance(value, str)
            value = str(value) if ok else value
        if not ok:
            raise ConfigError(
                "wrong type", file=file, key=self.name, expected=self.expected(), got=value
            )
        self.validate(value, file=file)
        return value

    def validate(self, value: Any, *, file: str | None = None) -> None:
        if self.choices and value not in self.choices:
            raise ConfigError(
                "invalid value", file=file, key=self.name, expected=self.expected(), got=value
            )
        if self.check is not None:
            want = self.check(value)
            if want:
                raise ConfigError(
                    "invalid value", file=file, key=self.name, expected=want, got=value
                )

    def parse_text(self, text: str) -> Any:
        """Parse a value typed on the command line (TOML syntax, or a bare string)."""
        if self.type is str:
            try:
                parsed = tomlkit.parse(f"v = {text}")["v"]
                if isinstance(parsed, str):
                    return str(parsed)
            except TOMLKitError:
                pass
            return text
        try:
            value = tomlkit.parse(f"v = {text}")["v"]
        except TOMLKitError as e:
            raise ConfigError(
                "cannot parse value", key=self.name, expected=self.expected(), got=text
            ) from e
        return value.unwrap() if hasattr(value, "unwrap") else value


def split_name(name: str) -> tuple[str, str]:
    """``(section, key)`` of a known dotted name; ConfigError for an unknown one."""
    if name not in SCHEMA:
        raise ConfigError(
            "unknown setting", key=name, hint="`warmslot config show` lists every setting"
        )
    section, _, key = name.partition(".")
    return section, key


LIST_SECTIONS = ("models", "workers", "backends")  # lists of tables, validated by their own schema


def section_specs(prefix: str, sect_type: type) -> dict[str, SettingSpec]:
    """The specs of one section's (or one list table's) dataclass, named ``prefix.field``."""
    specs: dict[str, SettingSpec] = {}
    hints = get_type_hints(sect_type)
    for f in dataclasses.fields(sect_type):
        hint = hints[f.name]
        typ = list if getattr(hint, "__origin__", None) is list else hint
        factory = cast(Callable[[], Any], f.default_factory)
        default = factory() if f.default is dataclasses.MISSING else f.default
        specs[f"{prefix}.{f.name}"] = SettingSpec(
            name=f"{prefix}.{f.name}",
            type=typ,
            default=default,
            description=f.metadata["description"],
            check=f.metadata["check"],
            restart=f.metadata["restart"],
            choices=f.metadata["choices"],
        )
    return specs


def _build_schema() -> dict[str, SettingSpec]:
    specs: dict[str, SettingSpec] = {}
    for sect in dataclasses.fields(Settings):
        if sect.name not in LIST_SECTIONS:
            specs.update(section_specs(sect.name, get_type_hints(Settings)[sect.name]))
    return specs


SCHEMA: dict[str, SettingSpec] = _build_schema()
# The fields of one ``[[models]]`` table, named ``models.<field>``.
PROFILE_SCHEMA: dict[str, SettingSpec] = section_specs("models", ModelProfile)
# The fields of one ``[[workers]]`` table, named ``workers.<field>``.
WORKER_SCHEMA: dict[str, SettingSpec] = section_specs("workers", WorkerSettings)
# The fields of one ``[[backends]]`` table, named ``backends.<field>``.
BACKEND_SCHEMA: dict[str, SettingSpec] = section_specs("backends", BackendSettings)


def iter_specs() -> Iterator[SettingSpec]:
    """Every setting of the sections, in declaration order."""
    yield from SCHEMA.values()


def check_settings(
    settings: Settings, *, file: str | None = None, keys_path: Path | None = None
) -> None:
    """Rules that involve more than one setting; raises ConfigError. `keys_path`: the
    named API keys' file (core.keys), which also allows a non-loopback proxy.host."""
    c = settings.cache
    for shorter, longer in (("ttl_short_s", "ttl_long_s"), ("ttl_long_s", "ttl_extended_s")):
        if getattr(c, shorter) > getattr(c, longer):
            raise ConfigError(
                "TTL classes must not shrink: short ≤ long ≤ extended",
                file=file,
                key=f"cache.{longer}",
                expected=f"at least cache.{shorter} ({getattr(c, shorter)} s)",
                got=getattr(c, longer),
            )
    if settings.backends and (settings.models or settings.workers):
        # Several backends serve the one primary model (docs/scale.md#several-backends).
        raise ConfigError(
            "[[backends]] cannot be combined with [[models]] or [[workers]] yet",
            file=file,
            key="backends",
            expected="no [[models]] and no [[workers]] tables with [[backends]]",
        )
    host = settings.proxy.host
    if not is_loopback(host) and not settings.proxy.api_key and not _named_keys(keys_path):
        raise ConfigError(
            "a proxy reachable from the network needs an API key",
            file=file,
            key="proxy.host",
            expected="a loopback address (127.0.0.1) while no API key is configured",
            got=host,
            hint="add a key per user first (`warmslot keys add NAME`) or set proxy.api_key, "
            "or keep proxy.host = 127.0.0.1 (docs/security.md#serving-a-team)",
        )


def _named_keys(keys_path: Path | None) -> bool:
    """Whether the key file holds a key (an unreadable one counts as none)."""
    try:
        return keys_path is not None and bool(load_keys(keys_path))
    except KeyFileError:
        return False
