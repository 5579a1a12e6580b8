"""The settings schema: `Settings` (every section), one `SettingSpec` per setting
derived from the dataclasses' declarations (`SCHEMA`, and one per list of tables),
and the rules that involve more than one setting (`check_settings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_type_hints

import tomlkit
from tomlkit.exceptions import TOMLKitError

from core.config.checks import Applies, Check, is_loopback
from core.config.keys import KeyFileError, load_keys
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

    def with_changes(
        self, changes: Mapping[str, object], *, keys_path: Path | None = None
    ) -> Settings:
        """A copy with `changes` (dotted names, or ``models`` / ``workers`` /
        ``backends`` with their whole list), each value checked, then the rules between
        settings on the result (`keys_path`: see `check_settings`)."""
        new = dataclasses.replace(self)
        for name, value in changes.items():
            if name in LIST_SECTIONS:
                setattr(new, name, list(cast(list[Any], value)))
                continue
            spec = SCHEMA.get(name)
            if spec is None:
                split_name(name)  # raises the standard unknown-setting error
                raise AssertionError
            section, key = split_name(name)
            coerced = spec.coerce(value)
            setattr(new, section, dataclasses.replace(getattr(new, section), **{key: coerced}))
        check_settings(new, keys_path=keys_path)
        return new

    def as_dict(self) -> dict[str, dict[str, object]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SettingSpec:
    """One setting: dotted name, type, default, description, validation, and when a
    change takes effect (`applies`)."""

    name: str
    type: type
    default: Any
    description: str
    check: Check | None
    applies: Applies
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
            applies=f.metadata["applies"],
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


_LIST_SCHEMAS = {"models": PROFILE_SCHEMA, "workers": WORKER_SCHEMA, "backends": BACKEND_SCHEMA}
_ORDER = (Applies.LIVE, Applies.SERVER, Applies.WARMSLOT)


def applies_of(name: str) -> Applies:
    """When a change to setting `name` takes effect; for a list of tables (``models``,
    ``workers``, ``backends``), the latest of its fields'."""
    if name in _LIST_SCHEMAS:
        return max((s.applies for s in _LIST_SCHEMAS[name].values()), key=_ORDER.index)
    return SCHEMA[name].applies


def changed_settings(old: Settings, new: Settings) -> list[str]:
    """The settings whose value differs, in declaration order (then the lists of tables)."""
    names = [n for n in SCHEMA if old.get(n) != new.get(n)]
    return names + [n for n in LIST_SECTIONS if getattr(old, n) != getattr(new, n)]


@dataclass(frozen=True)
class SettingsUpdate:
    """`Core.update_settings`'s answer.

    `changed`: the settings whose value the core now uses differs from before (what the
    change wrote, and anything edited by hand in the file since it was read). `waiting`:
    those of them that take effect only after a restart, with which (`Applies`).
    `problems`: what is still wrong in the settings file after the change was written;
    then nothing was applied, and `changed` and `waiting` are empty.
    """

    changed: tuple[str, ...] = ()
    waiting: tuple[tuple[str, Applies], ...] = ()
    problems: tuple[Problem, ...] = ()

    @property
    def applied(self) -> bool:
        return not self.problems

    def waiting_for(self, kind: Applies) -> list[str]:
        """The changed settings that take effect when `kind` restarts."""
        return [name for name, k in self.waiting if k is kind]

    @classmethod
    def between(cls, old: Settings, new: Settings) -> SettingsUpdate:
        """What changed from `old` to `new`, and what of it waits for a restart."""
        changed = changed_settings(old, new)
        waiting = tuple((n, applies_of(n)) for n in changed if applies_of(n) is not Applies.LIVE)
        return cls(tuple(changed), waiting)


@dataclass(frozen=True)
class Problem:
    """One thing wrong in the settings: the setting it belongs to (``""`` for the file as
    a whole), what to tell the user in words, and the error (file, key, expected, got)
    that `load` raises and the CLI prints. `involves` names every setting a rule between
    settings reads (the setting itself for a value's own problem); `line` and `column`
    point into the file where known (broken TOML)."""

    key: str
    text: str
    error: ConfigError
    involves: tuple[str, ...] = ()
    line: int | None = None
    column: int | None = None

    @classmethod
    def of(cls, error: ConfigError, text: str = "") -> Problem:
        """A value's own problem at the setting its error names; in words, `text` or
        "Expected …; got …." from the error."""
        name = error.key or ""
        if not text:
            text = (
                f"Expected {error.expected}; got {error.got!r}."
                if error.expected is not None
                else str(error)
            )
        return cls(name, text, error, (name,) if name else ())


TTL_WORDS = {"ttl_short_s": "short", "ttl_long_s": "long", "ttl_extended_s": "extended"}


def settings_problems(
    settings: Settings, *, file: str | None = None, keys_path: Path | None = None
) -> list[Problem]:
    """The rules that involve more than one setting, each broken one as a `Problem` at
    every setting it is shown with. `keys_path`: the named API keys' file (core.keys),
    which also allows a non-loopback proxy.host."""
    out: list[Problem] = []
    c = settings.cache
    for shorter, longer in (("ttl_short_s", "ttl_long_s"), ("ttl_long_s", "ttl_extended_s")):
        low, high = getattr(c, shorter), getattr(c, longer)
        if low <= high:
            continue
        error = ConfigError(
            "TTL classes must not shrink: short ≤ long ≤ extended",
            file=file,
            key=f"cache.{longer}",
            expected=f"at least cache.{shorter} ({low} s)",
            got=high,
        )
        rule = "the TTL classes go short ≤ long ≤ extended"
        names = (f"cache.{shorter}", f"cache.{longer}")
        short_word, long_word = TTL_WORDS[shorter], TTL_WORDS[longer]
        out.append(
            Problem(
                names[0],
                f"Longer than the {long_word} TTL ({high:,} s): {rule}.",
                error,
                names,
            )
        )
        out.append(
            Problem(
                names[1],
                f"Shorter than the {short_word} TTL ({low:,} s): {rule}.",
                error,
                names,
            )
        )
    host = settings.proxy.host
    if not is_loopback(host) and not settings.proxy.api_key and not _named_keys(keys_path):
        error = ConfigError(
            "a proxy reachable from the network needs an API key",
            file=file,
            key="proxy.host",
            expected="a loopback address (127.0.0.1) while no API key is configured",
            got=host,
            hint="add a key per user first (`warmslot keys add NAME`) or set proxy.api_key, "
            "or keep proxy.host = 127.0.0.1 (docs/security.md#serving-a-team)",
        )
        out.append(
            Problem(
                "proxy.host",
                "Reachable from the network only with an API key: set the API key, add a "
                "key per user (warmslot keys add NAME), or keep 127.0.0.1.",
                error,
                ("proxy.host", "proxy.api_key"),
            )
        )
    return out


def check_settings(
    settings: Settings, *, file: str | None = None, keys_path: Path | None = None
) -> None:
    """Rules that involve more than one setting (`settings_problems`); raises the first
    broken one's ConfigError."""
    if problems := settings_problems(settings, file=file, keys_path=keys_path):
        raise problems[0].error


def _named_keys(keys_path: Path | None) -> bool:
    """Whether the key file holds a key (an unreadable one counts as none)."""
    try:
        return keys_path is not None and bool(load_keys(keys_path))
    except KeyFileError:
        return False
