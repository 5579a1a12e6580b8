"""A settings change applied to the core (`Core.update_settings`): planned by the
settings package (`core.config.plan_update`: the file's edit, the settings to use, the
answer), then applied — on a running core a new proxy address is bound first, so a
port that is taken changes nothing, and subscribers hear what changed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from core import config as config_mod
from core.config import Settings, SettingsUpdate
from core.events import Event, SettingsChanged
from core.local_api import RuntimeFile
from core.paths import Paths
from core.proxy.app import Proxy


class Host(Protocol):
    """What a settings change reads and changes of the engine (`core.engine.Core`)."""

    paths: Paths
    settings: Settings
    proxy: Proxy | None
    runtime: RuntimeFile
    started_at: float

    def emit(self, event: Event) -> None: ...


def apply_stopped(core: Host, changes: Mapping[str, object], *, persist: bool) -> SettingsUpdate:
    """On a core that is not running: the file, and the settings its start uses."""
    edit, new, update = config_mod.plan_update(
        core.paths.config_file, core.settings, changes, persist=persist
    )
    if edit is not None:
        edit.write()
    if new is not None:
        core.settings = new
    return update


async def apply_running(
    core: Host, changes: Mapping[str, object], *, persist: bool
) -> SettingsUpdate:
    """On the running core (its loop): what can change live changes now."""
    old = core.settings
    edit, new, update = config_mod.plan_update(
        core.paths.config_file, old, changes, persist=persist
    )
    moved = {"proxy.host", "proxy.port"} & set(update.changed)
    if new is not None and moved and core.proxy is not None and core.proxy.port:
        # Live: the new address first (a taken port changes nothing, the file keeps
        # its value), then the runtime file, so `warmslot status` and the tray find it.
        await core.proxy.rebind(new.proxy.host, new.proxy.port)
        core.runtime.write(core.proxy.host, core.proxy.port, core.started_at)
    if edit is not None:
        edit.write()
    if new is None:
        return update
    core.settings = new
    if update.changed:
        core.emit(SettingsChanged(changes=config_mod.settings_changes(old, new, update.changed)))
    return update
