"""Launch planning: from the settings to what llama-server is launched with.

The fit request the settings imply (`request_from_settings`), the memory plan's
flags (with RPC workers when configured), the chat template to use, and the
launch identity that names the slot directory (`launch_id`). The engine calls
`resolve_launch` for each server it starts; `warmslot fit` and the model catalog
use `request_from_settings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.config import ServerSettings
from core.machine.devices import gpus_for, read_gpus, read_host
from core.paths import Paths, resources_dir
from core.server import discover, model, placement
from core.server.argv import LaunchInputs, build_argv, kv_relevant
from core.server.fit import FitPlan, FitRequest, plan_argv
from core.server.fit import plan as plan_fit
from core.server.gguf_facts import read_facts
from core.server.provision import Provisioner
from core.server.rpc import WorkerSet
from core.server.rpc_fit import launch_plan
from core.server.supervisor import Resolved

log = logging.getLogger("warmslot.core")


# extra_args flags that pin a planner choice: flag → (FitRequest field, parser).
_PINNING_FLAGS: dict[str, tuple[str, Any]] = {
    "-ngl": ("n_gpu_layers", int),
    "--gpu-layers": ("n_gpu_layers", int),
    "--n-gpu-layers": ("n_gpu_layers", int),
    "-ctk": ("cache_type_k", str),
    "--cache-type-k": ("cache_type_k", str),
    "-ctv": ("cache_type_v", str),
    "--cache-type-v": ("cache_type_v", str),
    "-ub": ("n_ubatch", int),
    "--ubatch-size": ("n_ubatch", int),
    "-ctxcp": ("ctx_checkpoints", int),
    "--ctx-checkpoints": ("ctx_checkpoints", int),
    "--swa-checkpoints": ("ctx_checkpoints", int),
    "-cms": ("checkpoint_min_step", int),
    "--checkpoint-min-step": ("checkpoint_min_step", int),
    "-fa": ("flash_attn", lambda v: v != "off"),
    "--flash-attn": ("flash_attn", lambda v: v != "off"),
    # The memory left free per device: Warmslot's estimate and llama.cpp's fit use it.
    "-fitt": ("vram_margin_mib", int),
    "--fit-target": ("vram_margin_mib", int),
}
_SWITCHES = {
    "--swa-full": ("swa_full", True),
    "-kvu": ("kv_unified", True),
    "--kv-unified": ("kv_unified", True),
}


def request_from_settings(
    server: ServerSettings, *, auto: bool = False, extra_args: Sequence[str] | None = None
) -> FitRequest:
    """The `FitRequest` the settings imply: configured values are pinned.

    With `auto`, slots, context per slot and RAM cache are left to the planner.
    Flags in ``server.extra_args`` that the planner would choose (``-ngl``,
    ``-ctk`` …) are pinned too, since llama-server will receive them anyway.
    ``-ngl all``/``auto`` leave the layer count to the planner.
    """
    pins: dict[str, Any] = {}
    if not auto:
        pins.update(
            slots=server.slots, ctx_per_slot=server.ctx_per_slot, cache_ram_mib=server.cache_ram_mib
        )
    args = list(server.extra_args if extra_args is None else extra_args)
    for i, token in enumerate(args):
        flag, _, inline = token.partition("=")
        if flag in _SWITCHES:
            key, value = _SWITCHES[flag]
            pins[key] = value
        elif flag in _PINNING_FLAGS:
            raw = inline or (args[i + 1] if i + 1 < len(args) else "")
            key, parse = _PINNING_FLAGS[flag]
            try:
                pins[key] = parse(raw)
            except ValueError:
                continue  # e.g. -ngl all: the planner decides
    return FitRequest(**pins)


def drop_flag(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value (``-ngl`` is dropped when NVML sees no GPU)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token == flag:
            skip = True
        else:
            out.append(token)
    return out


DEMO_TEMPLATE = "templates/gemma3-tools.jinja"


def chat_template_for(server: ServerSettings, mdl: model.ModelFile) -> Path | None:
    """The chat template file to launch with: the configured one, or for the demo
    model (whose GGUF has none, so the server's fallback drops every tool) ours."""
    if server.chat_template_file:
        return Path(server.chat_template_file).expanduser()
    if mdl.source == "demo":
        return resources_dir() / DEMO_TEMPLATE
    return None


def launch_id(
    server: ServerSettings,
    binary: discover.ServerBinary,
    mdl: model.ModelFile,
    template: Path | None = None,
    plan_args: tuple[str, ...] = (),
) -> str:
    """Identity of what a saved slot file depends on at launch: binary, model, KV
    flags and the chat template's content.

    It names the server's slot directory, so a file is only ever offered to a
    server it can belong to. (The template the server reports also joins every
    prefix fingerprint once it runs.)
    """
    argv = build_argv(
        server,
        LaunchInputs(
            binary=binary.path, model=mdl.path, port=0, slot_dir=Path(), plan_args=plan_args
        ),
    )
    template_hash = ""
    if template is not None:
        with contextlib.suppress(OSError):
            template_hash = hashlib.sha256(template.read_bytes()).hexdigest()
    h = hashlib.sha256()
    for part in (binary.identity, mdl.identity, json.dumps(kv_relevant(argv)), template_hash):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def place(
    result: FitPlan,
    binary: discover.ServerBinary,
    model_path: Path,
    request: FitRequest,
    extra_args: Sequence[str] = (),
) -> FitPlan:
    """`result` with llama.cpp's placement of its layers and tensors
    (`core.server.placement`), for the plan's own context and KV flags; unchanged when
    the user pinned ``-ngl`` (llama.cpp's fit would stop at it: the pin is kept)."""
    if request.n_gpu_layers is not None:
        return result
    target = request.vram_margin_mib  # server.extra_args --fit-target pins it
    argv = plan_argv(dataclasses.replace(result, placement=placement.at_launch(target)))
    found = placement.ask(
        binary.path,
        model_path,
        argv,
        target_mib=target,
        extra=_placement_flags(extra_args),
        env=binary.launch_env(),
    )
    if found.source == "failed":
        log.warning("llama-fit-params: %s; llama-server's --fit places the layers", found.error)
        found = dataclasses.replace(
            placement.at_launch(target), error=found.error, log_lines=found.log_lines
        )
    return dataclasses.replace(result, placement=found)


def _placement_flags(args: Sequence[str]) -> list[str]:
    """The user's flags that steer llama.cpp's placement (llama-fit-params takes them)."""
    keep = {"-dev", "--device", "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-sm",
            "--split-mode", "-mg", "--main-gpu", "-ot", "--override-tensor"}  # fmt: skip
    switches = {"-cmoe", "--cpu-moe"}
    out: list[str] = []
    for i, token in enumerate(args):
        flag = token.partition("=")[0]
        if flag in keep:
            out.append(token)
            if flag not in switches and "=" not in token and i + 1 < len(args):
                out.append(args[i + 1])
    return out


def plan_fit_for(
    s: ServerSettings,
    mdl: model.ModelFile,
    state_dir: Path,
    binary: discover.ServerBinary | None = None,
    *,
    placed_by_llama: bool = True,
) -> tuple[FitPlan | None, bool]:
    """The memory plan for these settings (its flags join the launch), or None if
    the model's metadata cannot be planned for: the launch then uses the settings.
    Also whether a GPU was seen: NVML's, else the devices `binary` lists (Vulkan,
    ROCm, Metal). Without one the layer count is left to llama-server; with one and a
    `binary`, llama.cpp places the layers and tensors (`place`) unless not
    `placed_by_llama` (RPC workers: `core.server.rpc_fit` places them)."""
    gpus = gpus_for(binary.path, binary.launch_env()) if binary else read_gpus()
    request = request_from_settings(s)
    try:
        facts = read_facts(mdl.path)
        result = plan_fit(facts, gpus, read_host(state_dir), request)
    except Exception as e:
        log.warning("no fit plan for %s (%r); launching with the settings alone", mdl.path, e)
        return None, bool(gpus)
    if not result.fits:
        log.warning(
            "the fit plan says %s does not fit: %s",
            mdl.path.name,
            "; ".join(result.gave_up) or "see `warmslot fit`",
        )
    if gpus and binary is not None and placed_by_llama:
        result = place(result, binary, mdl.path, request, s.extra_args)
    return result, bool(gpus)


async def resolve_launch(
    s: ServerSettings,
    *,
    paths: Paths,
    provision: Provisioner,
    workers: WorkerSet,
    primary: bool,
) -> tuple[Resolved, FitPlan | None]:
    """Find the binary and model these server settings name (off the loop), and plan
    the launch: the fit plan's flags, the chat template, the slot directory. The
    `primary` server alone is launched with the RPC `workers` (every other backend and
    pooled model is planned on this machine: docs/scale.md#several-backends), and its
    fit plan is returned too (the engine reports it); None for every other server."""
    loop = asyncio.get_running_loop()
    # Probing binaries and hashing files is blocking work: keep it off the loop.
    mdl = await loop.run_in_executor(None, model.resolve, paths, s.model)
    binary = await provision.binary_for(s, mdl.path)
    template = chat_template_for(s, mdl)
    plan: list[str] = []
    primary_plan: FitPlan | None = None
    on_workers = workers.configured and primary
    fit_plan, gpus_seen = await loop.run_in_executor(
        None,
        lambda: plan_fit_for(s, mdl, paths.state_dir, binary, placed_by_llama=not on_workers),
    )
    if fit_plan is not None and on_workers:
        # (No plan: the model's metadata is unreadable, and the launch goes without.)
        # Raises WorkerUnavailable when a needed worker is gone: the supervisor waits.
        wp = await loop.run_in_executor(
            None,
            lambda: launch_plan(
                workers,
                binary.path,
                mdl.path,
                paths.state_dir,
                request_from_settings(s),
                env=binary.launch_env(),
            ),
        )
        if wp.endpoints:  # -ngl/-ts place layers on the workers even without a GPU here
            # llama.cpp has no answer for a layout pinned per worker: Warmslot's estimate
            # places the layers, and --fit stays off (explicit -ngl would stop it anyway).
            fit_plan, gpus_seen = wp.plan, True
            plan += [*wp.argv, "--fit", "off"]
    if fit_plan is not None:
        flags = plan_argv(fit_plan)
        plan += flags if gpus_seen else drop_flag(flags, "-ngl")
        if primary:
            primary_plan = fit_plan
    if template is not None and not s.chat_template_file:
        plan += ["--jinja", "--chat-template-file", str(template)]
    resolved = Resolved(
        binary=binary,
        model=mdl,
        plan_args=tuple(plan),
        slot_dir=paths.slot_dir / launch_id(s, binary, mdl, template, tuple(plan)),
    )
    return resolved, primary_plan
