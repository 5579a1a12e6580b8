"""The switch to the patched llama-server in the background (``server.build = "auto"``).

When the primary server is ready on a stock binary that the model's disk tier needs
patched (`Provisioner.upgrade_reason`: sliding-window and hybrid models), the patched
server is built at idle priority while the stock one serves, and the primary restarts
on it at the next quiet moment — no request in flight and none for
``server.switch_idle_s`` (docs/build.md#when-warmslot-builds-by-itself). A build that
fails is said once and not tried again in this run; serving goes on with the stock
server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from core.config import ServerSettings
from core.errors import WarmslotError
from core.events import Event, Notice, ServerStateChanged
from core.server.provision import PATCHED_PURPOSE, Provisioner
from core.server.supervisor import Supervisor


class PatchedUpgrade:
    """Builds the patched server once the primary is ready on a stock one, then
    switches to it when the proxy is quiet. `on_state` is its event subscriber."""

    def __init__(
        self,
        provision: Provisioner,
        *,
        supervisor: Callable[[], Supervisor | None],
        settings: Callable[[], ServerSettings],
        idle_for: Callable[[], float | None],
        emit: Callable[[Event], None],
    ) -> None:
        self.provision = provision
        self._supervisor = supervisor
        self._settings = settings  # the primary server's
        # Seconds since the proxy's last request ended; None while one is in flight.
        self._idle_for = idle_for
        self._emit = emit
        self._task: asyncio.Task[None] | None = None
        self._failed = False

    def on_state(self, event: Event) -> None:
        """When the primary server is ready, see whether it needs the patched build
        (once at a time; pooled models and backends name themselves and are skipped)."""
        if not isinstance(event, ServerStateChanged) or event.model or event.state != "ready":
            return
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.ensure_future(self._upgrade())

    def cancel(self) -> None:
        """Stop a build or wait under way (at shutdown)."""
        if self._task is not None:
            self._task.cancel()

    async def _upgrade(self) -> None:
        sup = self._supervisor()
        s = self._settings()
        if sup is None or sup.resolved is None or s.build != "auto" or self.provision.building:
            return
        if self._failed:  # once per run: a failing build is not retried per restart
            return
        binary, mdl = sup.resolved.binary, sup.resolved.model
        loop = asyncio.get_running_loop()
        why = await loop.run_in_executor(None, self.provision.upgrade_reason, s, binary, mdl.path)
        if why is None:
            return
        self._emit(
            Notice(
                level="info",
                text=f"{why}. Building the patched server in the background at idle "
                "priority; Warmslot switches to it at the next quiet moment.",
                hint='server.build = "off" stops this; "now" builds before starting',
            )
        )
        try:
            await self.provision.build(PATCHED_PURPOSE, background=True)
        except asyncio.CancelledError:
            raise
        except WarmslotError as e:
            self._emit(
                Notice(
                    level="warning",
                    text=f"The patched llama-server could not be built: {e}",
                    hint=e.hint or "serving goes on with the stock server, without the disk tier",
                )
            )
            self._failed = True
            return
        found = await self.provision.discover(s)
        if found.found is None or not found.found.patched:
            return
        await self._wait_quiet(s.switch_idle_s)
        self._emit(Notice(level="info", text="Switching to the patched llama-server (disk tier)."))
        await sup.restart("switching to the patched llama-server for the disk tier")

    async def _wait_quiet(self, idle_s: float) -> None:
        """Until no request is in flight and none ended in the last `idle_s` seconds."""
        while True:
            idle = self._idle_for()
            if idle is not None and idle >= idle_s:
                return
            wait = 0.5 if idle is None else max(0.1, idle_s - idle)
            await asyncio.sleep(wait)
