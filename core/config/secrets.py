"""Settings whose values are secret, and how a change to them is shown."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from core.config.schema import LIST_SECTIONS, Settings

# Settings whose values never appear in events, logs or status.
SECRET_SETTINGS = frozenset({"proxy.api_key"})


def settings_changes(
    old: Settings, new: Settings, names: Iterable[str]
) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, old, new)`` for each of `names`, secrets shown as "***" (or "" if unset);
    a list of tables (``models`` …) as how many tables it has."""

    def shown(name: str, settings: Settings) -> Any:
        if name in LIST_SECTIONS:
            return f"{len(getattr(settings, name))} tables"
        value = settings.get(name)
        return ("***" if value else "") if name in SECRET_SETTINGS else value

    return tuple((n, shown(n, old), shown(n, new)) for n in names)
