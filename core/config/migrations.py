"""Upgrading older settings files: the file carries ``version``; `migrate` runs
`MIGRATIONS` in order up to `SCHEMA_VERSION`.
"""

from __future__ import annotations

from collections.abc import Callable

from core.errors import ConfigError

SCHEMA_VERSION = 1


# Upgrades of older files: MIGRATIONS[n] turns a version-n document into version n+1.
# A file with no `version` is version 1 (the first released layout).
Migration = Callable[[dict[str, object]], dict[str, object]]
MIGRATIONS: dict[int, Migration] = {}


def migrate(doc: dict[str, object], path: str) -> dict[str, object]:
    """`doc` upgraded to `SCHEMA_VERSION` (`path` names the file in errors); a
    file from a newer Warmslot is refused."""
    version = doc.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise ConfigError(
            "invalid version",
            file=path,
            key="version",
            expected=f"an integer 1..{SCHEMA_VERSION}",
            got=version,
        )
    if version > SCHEMA_VERSION:
        raise ConfigError(
            "file is from a newer Warmslot",
            file=path,
            key="version",
            expected=f"≤ {SCHEMA_VERSION}",
            got=version,
            hint="upgrade Warmslot or move the file aside",
        )
    while version < SCHEMA_VERSION:
        doc = MIGRATIONS[version](doc)
        version += 1
        doc["version"] = version
    return doc
