"""Settings whose values are secret, and how a change to them is shown.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from core.config.schema import Settings

# Settings whose values never appear in events, logs or status.
SECRET_SETTINGS = frozenset({"proxy.api_key"})


def settings_changes(
    old: Settings, new: Settings, names: Iterable[str]
) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, old, new)`` for each of `names`, secrets shown as "***" (or "" if unset)."""

    def shown(name: str, value: Any) -> Any:
        return ("***" if value else "") if name in SECRET_SETTINGS else value

    return tuple((n, shown(n, old.get(n)), shown(n, new.get(n))) for n in names)
