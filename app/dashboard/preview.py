"""What *Start model + cache* will launch, told before it runs.

A stopped Warmslot's status names no model (it is resolved at the start) and its slot
map holds the settings' placeholder (two slots while the fit plan chooses), so the
Overview would say "2 slots" for a server the plan starts with four. `preview` answers
the way the launch does (`core.server.launch.plan_fit_for` on the primary model's
settings): the model file, and the slots and context the fit plan picks for it on this
machine now. It reads the model's header and the devices' free memory: run it on a
worker thread (`Tasks.run`), never on the GUI thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.config import Settings
from core.errors import WarmslotError
from core.models import profiles
from core.paths import Paths
from core.server import model as model_mod
from core.server.launch import plan_fit_for

DEMO_NAME = "gemma-3-270m-q4_k_m.gguf"  # the demo model's file (core.server.model)


@dataclass(frozen=True)
class LaunchPreview:
    """The model and slots the next start launches with."""

    model: str  # the model's file name
    path: str  # its path; "" for the demo model before its first start sets it up
    source: str  # configured | demo
    size: int | None  # bytes; None when the file is not there yet
    slots: int | None  # what -np will be; None: the plan decides once the model is there
    ctx_per_slot: int | None  # tokens per slot; None when the server picks (no plan)
    why: str  # where the slot count comes from, in words
    aux_slot: int | None  # the slot reserved for side calls, if one is
    problem: str = ""  # why the start would fail (the model is missing …), else ""


def slots_text(p: LaunchPreview) -> str:
    """ "4 slots, 8,192 tokens each (the fit plan: …); slot 3 reserved for side calls"."""
    if p.slots is None:
        return f"chosen by the fit plan at the start ({p.why})"
    each = f", {p.ctx_per_slot:,} tokens each" if p.ctx_per_slot else ""
    aux = (
        f"; slot {p.aux_slot} reserved for side calls"
        if p.aux_slot is not None and "side calls" not in p.why  # the plan's reason says it
        else ""
    )
    return f"{p.slots} slot{'' if p.slots == 1 else 's'}{each} ({p.why}){aux}"


def _aux(settings: Settings, slots: int) -> int | None:
    # The cache's slot map reserves the last slot when there are two or more.
    return slots - 1 if slots >= 2 and settings.cache.aux_slot else None


def preview(settings: Settings, paths: Paths) -> LaunchPreview:
    """What a start with `settings` would launch (blocking: reads files and devices)."""
    s = (
        profiles.server_settings(settings, profiles.primary(settings))
        if settings.models
        else settings.server
    )
    configured = s.slots
    fallback = s.launch_slots
    fallback_why = "server.slots" if configured else "the default; no fit plan"
    if not s.model:
        demo = paths.models_dir / DEMO_NAME
        if not demo.is_file():  # set up (from its package) by the first start, not here
            return LaunchPreview(
                model=DEMO_NAME, path="", source="demo", size=None,
                slots=configured or None, ctx_per_slot=s.ctx_per_slot or None,
                why="server.slots" if configured
                else "the demo model is set up first, then planned for",
                aux_slot=_aux(settings, configured) if configured else None,
            )  # fmt: skip
    try:
        mdl = model_mod.resolve(paths, s.model)
    except WarmslotError as e:
        name = Path(s.model).name if s.model else DEMO_NAME
        return LaunchPreview(
            model=name, path=s.model, source="configured", size=None, slots=fallback,
            ctx_per_slot=s.launch_ctx_per_slot, why=fallback_why,
            aux_slot=_aux(settings, fallback), problem=e.user_message().splitlines()[0],
        )  # fmt: skip
    plan, _gpus = plan_fit_for(s, mdl, paths.state_dir)
    if plan is None:  # unreadable metadata: the launch goes with the settings alone
        slots, ctx, why = fallback, s.launch_ctx_per_slot, fallback_why
    else:
        slots, ctx = plan.slots, plan.ctx_per_slot
        why = "server.slots" if configured else "the fit plan"
        reason = plan.reasons.get("slots", "")
        if reason and not configured:
            why = f"the fit plan: {reason}"
        if not plan.fits:
            why += "; the plan says it does not fit (`warmslot fit`)"
    return LaunchPreview(
        model=mdl.path.name,
        path=str(mdl.path),
        source=mdl.source,
        size=mdl.size,
        slots=slots,
        ctx_per_slot=ctx,
        why=why,
        aux_slot=_aux(settings, slots),
    )
