"""What the fit plan says to a person: `format_plan` (the table `warmslot fit` and the
status show) and `cross_check` (the plan against the buffers llama-server logged).
The plan itself is `core.server.fit`."""

from __future__ import annotations

import re

from core.server.fit import FitPlan, as_mib, plan_argv
from core.server.sizing import MIB


def format_plan(plan: FitPlan) -> str:
    """A human-readable table of the plan, its memory use and its reasons."""
    b = plan.breakdown
    lines = [f"Fit plan for {plan.model}: {'fits' if plan.fits else 'DOES NOT FIT'}", ""]
    lines.append(
        f"  {'device':<28} {'weights':>10} {'KV+state':>10} {'compute':>10} "
        f"{'other':>10} {'total':>10} {'budget':>10}"
    )
    for d in plan.devices:
        mark = "" if d.fits else "  ← over"
        lines.append(
            f"  {d.name[:28]:<28} {as_mib(d.weights_bytes):>10} {as_mib(d.kv_bytes):>10} "
            f"{as_mib(d.compute_bytes):>10} {as_mib(d.other_bytes):>10} "
            f"{as_mib(d.total_bytes):>10} {as_mib(d.budget_bytes):>10}{mark}"
        )
    lines += [
        "",
        f"  KV per token: {b.kv_bytes_per_token} B full-attention"
        + (f" + {b.kv_swa_bytes_per_token} B sliding-window" if b.kv_swa_bytes_per_token else ""),
        f"  KV per slot: {as_mib(b.kv_bytes_per_slot)} ({b.kv_cells_full} cells"
        + (f", SWA {b.kv_cells_swa} cells" if b.kv_swa_bytes_per_token else "")
        + f"); all slots {as_mib(b.kv_bytes_total)}",
        f"  checkpoints: {as_mib(b.checkpoint_bytes)} each, up to {as_mib(b.checkpoints_bytes_max)}"
        f"; RAM prompt cache up to {as_mib(b.cache_ram_bytes)}",
        f"  disk per saved state: {as_mib(b.disk_per_prefix_bytes)} for a full slot "
        f"({as_mib(b.disk_per_1k_tokens_bytes)} per 1k tokens"
        + (f" + {as_mib(b.disk_window_bytes)} window" if b.disk_window_bytes else "")
        + (
            f" + {as_mib(b.disk_checkpoint_bytes)} per context checkpoint"
            if b.disk_checkpoint_bytes
            else ""
        )
        + ")",
        "",
        "  choices:",
    ]
    values = {
        "n_gpu_layers": f"-ngl {plan.n_gpu_layers}",
        "slots": f"-np {plan.slots}",
        "ctx_per_slot": f"{plan.ctx_per_slot}/slot",
        "cache_types": f"{plan.cache_type_k}/{plan.cache_type_v}",
        "swa_full": "on" if plan.swa_full else "off",
        "cache_ram_mib": f"{plan.cache_ram_mib} MiB",
        "ctx_checkpoints": str(plan.ctx_checkpoints),
        "checkpoint_min_step": str(plan.checkpoint_min_step),
        "tensor_split": ",".join(map(str, plan.tensor_split)),
    }
    place = plan.placement
    for key, why in plan.reasons.items():
        if place is not None and key in ("n_gpu_layers", "tensor_split"):
            why = f"Warmslot's estimate, not launched: {why}"
        lines.append(f"    {key:<20} {values.get(key, ''):<14} {why}")
    lines += ["", *placement_lines(plan)]
    if plan.gave_up:
        lines += ["", "  gave up:"] + [f"    - {g}" for g in plan.gave_up]
    if plan.notes:
        lines += ["", "  notes:"] + [f"    - {n}" for n in plan.notes]
    lines += ["", "  llama-server " + " ".join(plan_argv(plan))]
    return "\n".join(lines)


def placement_lines(plan: FitPlan) -> list[str]:
    """Who places the layers and tensors, what llama.cpp chose, and Warmslot's estimate
    beside it (docs/gpu.md#placement)."""
    place = plan.placement
    estimate = f"-ngl {plan.n_gpu_layers}" + (
        f", -ts {','.join(map(str, plan.tensor_split))}" if plan.tensor_split else ""
    )
    if place is None:
        gpus = [d for d in plan.devices if d.kind == "gpu"]
        who = "Warmslot's estimate (RPC workers)" if gpus else "none: no GPU, all on the CPU"
        return [f"  layers and tensors: {who}; the launch uses {estimate if gpus else 'no -ngl'}"]
    out = [
        "  layers and tensors: placed by llama.cpp (the launch uses its answer)",
        f"    llama.cpp:           {place.describe()}",
        f"    Warmslot estimate:   {estimate} (no expert offload; for comparison)",
    ]
    if place.error:
        out.append(f"    llama-fit-params:    {place.error}")
    out += [f"    | {ln}" for ln in place.log_lines[-8:]]
    return out


_KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")
_COMPUTE_LINE = re.compile(r"(\S+) compute buffer size = +([\d.]+) MiB")


def cross_check(plan: FitPlan, log_text: str, *, tolerance: float = 0.05) -> list[str]:
    """Compare the plan with the buffers llama-server logged (needs ``-lv 4``).

    Returns one line per disagreement beyond `tolerance` (KV) or 50 % (compute,
    a rougher estimate); an empty list means they agree or the log has no sizes.
    """
    kv = sum(float(m.group(1)) for m in _KV_LINE.finditer(log_text)) * MIB
    compute = sum(float(m.group(2)) for m in _COMPUTE_LINE.finditer(log_text)) * MIB
    out = []
    planned_kv = (
        plan.breakdown.kv_bytes_total - plan.breakdown.recurrent_bytes_per_slot * plan.slots
    )
    if kv and abs(planned_kv - kv) > tolerance * kv:
        out.append(
            f"KV cache: planned {as_mib(planned_kv)}, llama-server allocated {as_mib(int(kv))}"
        )
    planned_c = plan.breakdown.compute_bytes_gpu + plan.breakdown.compute_bytes_host
    if compute and abs(planned_c - compute) > 0.5 * compute:
        out.append(
            f"compute buffers: planned {as_mib(planned_c)}, llama-server reserved "
            f"{as_mib(int(compute))}"
        )
    return out
