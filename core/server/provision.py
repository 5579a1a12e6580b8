"""A llama-server that works on this machine: found, or built for it.

`Provisioner.binary_for` is what a launch calls:

1. **discover** — every candidate is smoke-started (cached per binary and CPU) and ranked
   (`core.server.discover`);
2. **none works** → unless ``server.build = "off"``, check the toolchain (a clear error
   naming the package to install when the compiler is missing), build the pinned llama.cpp
   with Warmslot's patches, natively for this CPU, and discover again;
3. ``server.build = "now"`` and the model is sliding-window/hybrid and the binary lacks the
   checkpoint patch → build the patched server before the first start.

With ``server.build = "auto"`` that last build happens instead in the background, at idle
priority, while the stock binary serves: `upgrade_reason` says whether one is wanted and
`build(background=True)` runs it; the engine switches over at a quiet moment.

One build at a time; its last progress (`BuildProgress`) is kept for status and the tray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import core.build as build_mod
from core.config import ServerSettings
from core.errors import BinaryNotFound, BuildError, WarmslotError
from core.events import BuildProgress, Event, Notice
from core.paths import Paths
from core.server import discover
from core.server.discover import Checker, Discovery, ServerBinary
from core.status.server import BuildStatus

__all__ = ["NO_BINARY_PURPOSE", "PATCHED_PURPOSE", "Provisioner", "needs_checkpoint_patch"]

log = logging.getLogger("warmslot.server")

NO_BINARY_PURPOSE = "no llama-server works on this CPU: building one for it"
PATCHED_PURPOSE = "building the patched server for the disk tier"

RecordHook = Callable[[dict[str, object]], None]  # gets one build's telemetry row


def needs_checkpoint_patch(model: Path) -> bool:
    """Sliding-window or recurrent/hybrid: slot files restore correctly only on a server
    with Warmslot's checkpoint patch (docs/patches.md). Unknown metadata → False."""
    from core.server.gguf_facts import read_facts

    try:
        facts = read_facts(model)
    except Exception as e:  # a model we cannot read is not a reason to build
        log.debug("no metadata for %s: %r", model, e)
        return False
    return facts.is_swa or facts.is_recurrent


class Provisioner:
    """Finds or builds the llama-server binary for launches (runs on the core loop)."""

    def __init__(
        self,
        paths: Paths,
        emit: Callable[[Event], None],
        record: RecordHook | None = None,
        *,
        check: Checker | None = discover.smoke_check,
        request: build_mod.BuildRequest | None = None,
    ) -> None:
        self._paths = paths
        # What automatic builds build (their purpose and priority are set per build):
        # the pinned llama.cpp with Warmslot's patches, for this CPU.
        self._request = request or build_mod.BuildRequest()
        self._emit = emit
        self._record = record
        self._check = check
        self._cancel: asyncio.Event | None = None
        self._running: asyncio.Future[build_mod.BuildRecord] | None = None
        self.progress: BuildProgress | None = None
        """The running build's last progress; None when no build runs."""
        self.last_discovery: Discovery | None = None

    # ------------------------------------------------------------------ finding
    async def discover(self, s: ServerSettings) -> Discovery:
        """Discovery off the loop (smoke starts and hashing are blocking)."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            None, lambda: discover.discover(self._paths, s.binary, check=self._check)
        )
        self.last_discovery = result
        return result

    async def binary_for(self, s: ServerSettings, model: Path) -> ServerBinary:
        """The binary to launch `model` with, building one first when needed (see module)."""
        result = await self.discover(s)
        found = result.found
        pinned = next((c for c in result.candidates if c.source == "configured" and c.path), None)
        if pinned is not None and not pinned.ok:
            self._emit(
                Notice(
                    level="warning",
                    text=f"server.binary {pinned.path} is not usable: {pinned.reason}",
                    hint="`warmslot doctor` shows every candidate; another one is used if it works",
                )
            )
        if found is None:
            if s.build == "off":
                raise BinaryNotFound(
                    f"no usable llama-server ({result.failures()})",
                    hint='set server.build = "auto" to let Warmslot build one for this CPU, '
                    "run `warmslot build`, or set server.binary to one that works here",
                )
            tools = build_mod.check_toolchain()
            if not tools.ok:  # say so before promising a build
                raise BuildError(
                    f"no llama-server works on this machine ({result.failures()}), and one "
                    f"cannot be built here: {', '.join(tools.problems)}",
                    hint=tools.hint,
                )
            self._emit(
                Notice(
                    level="warning",
                    text=f"No llama-server works on this machine ({result.failures()}). "
                    "Building one for this CPU from source; this happens once.",
                    hint="progress: `warmslot status`; the build is cached for later starts",
                )
            )
            await self._build_or_join(NO_BINARY_PURPOSE)
            result = await self.discover(s)
            if result.found is None:
                raise BinaryNotFound(
                    f"the llama-server built for this CPU does not work either "
                    f"({result.failures()})",
                    hint="see `warmslot doctor` and the build log (`warmslot build list`)",
                )
            return result.found
        if s.build == "now" and self.upgrade_reason(s, found, model):
            await self._build_or_join(PATCHED_PURPOSE)
            result = await self.discover(s)
            if result.found is not None:
                return result.found
        return found

    def upgrade_reason(self, s: ServerSettings, binary: ServerBinary, model: Path) -> str | None:
        """Why a patched build would help this launch, or None (not wanted, or pinned)."""
        if s.build == "off" or s.binary or binary.patched:
            return None
        if not needs_checkpoint_patch(model):
            return None
        return (
            f"{model.name} is a sliding-window/hybrid model and {binary.source} llama-server "
            "lacks Warmslot's checkpoint patch, so saved prefixes cannot be restored"
        )

    # ----------------------------------------------------------------- building
    @property
    def building(self) -> bool:
        return self._cancel is not None

    async def _build_or_join(self, purpose: str) -> None:
        """Build, or wait for the build already running (another model's start, or the
        background build) — one build at a time, and never the same one twice."""
        running = self._running
        if running is not None and not running.done():
            await asyncio.shield(running)
        else:
            await self.build(purpose)

    async def build(self, purpose: str = "", *, background: bool = False) -> build_mod.BuildRecord:
        """Build (or find cached) the pinned llama.cpp with Warmslot's patches for this CPU.

        Raises BuildError (with what to do) when the toolchain is incomplete or the build
        fails, WarmslotError when another build already runs.
        """
        if self._running is not None and not self._running.done():
            raise WarmslotError("a llama-server build is already running")
        tools = build_mod.check_toolchain()
        if not tools.ok:
            raise BuildError(
                f"cannot build llama-server here: {', '.join(tools.problems)}", hint=tools.hint
            )
        self._cancel = asyncio.Event()

        def on_progress(ev: BuildProgress) -> None:
            self.progress = None if ev.done else ev
            self._emit(ev)

        self._running = asyncio.ensure_future(
            build_mod.build(
                replace(self._request, purpose=purpose, background=background),
                self._paths,
                on_progress=on_progress,
                cancel=self._cancel,
                record=self._record,
            )
        )
        try:
            return await self._running
        finally:
            self._cancel = None
            self.progress = None

    def cancel(self) -> bool:
        """Cancel the running build; True if one was running."""
        if self._cancel is None:
            return False
        self._cancel.set()
        return True

    def status(self) -> BuildStatus | None:
        """The running build for status and the tray, or None."""
        ev = self.progress
        if ev is None:
            return {"state": "starting", "purpose": "", "percent": 0.0} if self.building else None
        return {
            "state": "running",
            "purpose": ev.purpose,
            "background": ev.background,
            "percent": round(ev.percent, 1),
            "step": ev.step,
            "steps_done": ev.steps_done,
            "steps_total": ev.steps_total,
            "elapsed_s": ev.elapsed_s,
            "eta_s": None if ev.eta_s is None else round(ev.eta_s),
            "text": ev.describe(),
        }
