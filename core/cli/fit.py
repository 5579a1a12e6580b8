"""`warmslot fit`: show the plan of llama-server flags before anything launches.

The configured values (slots, context per slot, RAM cache, and any planner flag
found in ``server.extra_args``) are pinned; ``--auto`` lets the planner choose
slots, context and RAM cache itself, to show what it would pick. With a GPU (NVML's,
or any device the llama-server binary lists) the layers and tensors are placed by
llama.cpp (``llama-fit-params``, `core.server.launch.place`) exactly as the launch
does, shown next to Warmslot's own estimate.
Exit status: 0 when the plan fits, 1 when it does not (or on an error).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from core import config as config_mod
from core.machine.devices import gpus_for, read_gpus, read_host
from core.paths import Paths
from core.server import discover
from core.server.fit import plan
from core.server.fit_report import format_plan
from core.server.gguf_facts import read_facts
from core.server.launch import place, request_from_settings

__all__ = ["cmd_fit", "doctor_lines", "register"]


def doctor_lines(settings: config_mod.Settings, model_path: Path, paths: Paths) -> list[str]:
    """What `warmslot doctor` says about the fit plan: slots and context per slot, why,
    and any note that an agent will hit the context (hitting it is never silent)."""
    try:
        facts = read_facts(model_path)
        p = plan(
            facts, read_gpus(), read_host(paths.state_dir), request_from_settings(settings.server)
        )
    except Exception as e:  # the launch then goes without a plan: say so, do not fail
        return [f"fit:         ✘ no fit plan ({e}); the launch uses the settings as they are"]
    mark = "✔" if p.fits else "✘"
    lines = [
        f"fit:         {mark} -np {p.slots}, {p.ctx_per_slot} tokens per slot"
        + ("" if p.fits else " — DOES NOT FIT (`warmslot fit`)"),
        f"      slots: {p.reasons.get('slots', '')}",
        f"      context: {p.reasons.get('ctx_per_slot', '')}",
    ]
    lines += [f"      note: {n}" for n in p.notes if "context" in n]
    return lines


def cmd_fit(args: argparse.Namespace) -> int:
    """Print the fit plan for the configured (or given) model."""
    paths = Paths.default(getattr(args, "dev_dir", None))
    settings = config_mod.load(paths.config_file)
    if args.model:
        model_path = Path(args.model)
    else:
        from core.server.model import resolve

        model_path = resolve(paths, settings.server.model).path
    facts = read_facts(model_path)
    extra = list(settings.server.extra_args)
    if args.fit_target is not None:
        extra += ["--fit-target", str(args.fit_target)]
    found = discover.discover(paths, settings.server.binary).found
    gpus = gpus_for(found.path, found.launch_env()) if found else read_gpus()
    host = read_host(paths.state_dir)
    request = request_from_settings(settings.server, auto=args.auto, extra_args=extra)
    result = plan(facts, gpus, host, request)
    workers_text, workers_doc = "", None
    if settings.workers:  # RPC workers: checked as a launch checks them (docs/scale.md)
        from core.server.rpc import check_workers
        from core.server.rpc_fit import format_workers, plan_with_workers

        checks = check_workers(found.path, settings.workers) if found else []
        wp = plan_with_workers(facts, gpus, host, request, checks)
        result = wp.plan
        workers_text = format_workers(wp, checks) or "workers: not checked (no llama-server)"
        workers_doc = {"checks": [c.to_dict() for c in checks], "rpc": list(wp.endpoints)}
    elif gpus and found is not None:  # llama.cpp places layers and tensors, as at launch
        result = place(result, found, model_path, request, extra)
    if args.json:
        doc = {
            "model": facts.to_dict(),
            "gpus": [g.to_dict() for g in gpus],
            "host": host.to_dict(),
            "plan": result.to_dict(),
            "workers": workers_doc,
        }
        print(json.dumps(doc, indent=2))
    else:
        layers = f"{facts.n_layer} layers"
        if facts.is_swa:
            layers += f" ({facts.n_swa_layers} sliding-window {facts.n_swa}, "
            layers += f"{facts.n_full_layers} full)"
        if facts.is_recurrent:
            layers += f" ({sum(facts.recurrent_layers)} recurrent)"
        print(
            f"model: {facts.path}\n  {facts.architecture}, {layers}, "
            f"{facts.weights_bytes / (1 << 30):.2f} GiB of weights, "
            f"trained context {facts.n_ctx_train}"
        )
        if facts.n_expert:
            print(f"  Mixture of Experts: {facts.n_expert} experts per layer")
        print(
            f"devices: {len(gpus)} GPU(s); host RAM {host.ram_available / (1 << 30):.1f} GiB "
            f"available of {host.ram_total / (1 << 30):.1f} GiB"
        )
        for g in gpus:
            print(
                f"  {g.device or f'GPU{g.index}'}: {g.name}, {g.free_bytes >> 20} MiB free of "
                f"{g.total_bytes >> 20} MiB (from {g.source})"
            )
        print(f"llama-server: {found.path if found else 'none found (warmslot build)'}\n")
        print(format_plan(result))
        if workers_text:
            print("\n" + workers_text)
    return 0 if result.fits else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `fit` subcommand to the main CLI."""
    p = subparsers.add_parser(
        "fit", help="plan llama-server flags so the model, its context and caches fit"
    )
    p.add_argument("--model", help="a GGUF file (default: the configured model)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--fit-target",
        type=int,
        metavar="MIB",
        help="memory to leave free on each GPU, in MiB (llama-server's --fit-target; "
        "default 1024 or server.extra_args)",
    )
    p.add_argument(
        "--auto",
        action="store_true",
        help="let the planner choose slots, context and RAM cache instead of the settings",
    )
    p.set_defaults(func=cmd_fit)
