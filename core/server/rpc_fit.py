"""Spreading a model over the main host and its RPC workers (a layer on the fit planner).

The rule, in order:

1. Workers that do not answer are left out (`core.server.rpc.WorkerCheck`).
2. With a worker's ``layers`` pinned in the settings, the layers go exactly as pinned:
   each pinned worker's devices share its count, local GPUs share the rest, and the
   first layers stay on the main host (``-ngl`` = the total offloaded, ``-ts`` the
   split).
3. Else a model that fits on the main host alone stays there: every RPC round trip
   costs time, and a worker is one more machine that can go away.
4. Else the fit planner places layers on the workers' devices first, then on local
   GPUs, as many as fit (llama-server lists RPC devices before local GPUs, so
   ``-ts`` is in that order); the rest run on the main host.

`WorkerPlan.argv` is what the launch adds: ``--rpc`` with the workers that got layers
(a worker with none is not a dependency), ``-ngl`` and ``-ts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.machine.devices import GpuInfo, HostInfo, read_gpus, read_host
from core.server.fit import FitPlan, FitRequest, plan, plan_argv
from core.server.gguf_facts import ModelFacts, read_facts
from core.server.rpc import WorkerCheck, WorkerSet, WorkerUnavailable

__all__ = ["WorkerPlan", "format_workers", "launch_plan", "plan_with_workers"]


@dataclass(frozen=True)
class WorkerPlan:
    """The fit plan with the workers, and which workers the launch depends on."""

    plan: FitPlan
    endpoints: tuple[str, ...]  # --rpc, in order; () runs on the main host alone
    labels: tuple[str, ...]  # the same workers, as status names them
    left_out: dict[str, str]  # endpoint → why it gets no layers
    fits_locally: bool  # whether the main host alone could hold it

    @property
    def argv(self) -> list[str]:
        """Flags the launch adds to the plan's: ``--rpc`` (with -ngl/-ts kept even on a
        main host without GPUs, where the layer count otherwise is left to llama-server)."""
        if not self.endpoints:
            return []
        return ["--rpc", ",".join(self.endpoints)]


def _remote_gpus(checks: Sequence[WorkerCheck]) -> list[GpuInfo]:
    return [
        GpuInfo(i, f"{d.worker}", d.total_bytes, d.free_bytes)
        for i, d in enumerate(d for c in checks for d in c.devices)
    ]


def _pinned_split(
    checks: Sequence[WorkerCheck], gpus: Sequence[GpuInfo], n_units: int
) -> list[int]:
    split: list[int] = []
    for c in checks:
        n = len(c.devices)
        split += [c.worker.layers // n + (1 if i < c.worker.layers % n else 0) for i in range(n)]
    rest = max(0, n_units - sum(split)) if gpus else 0
    total_free = sum(g.free_bytes for g in gpus) or 1
    local = [rest * g.free_bytes // total_free for g in gpus]
    if local:
        local[-1] += rest - sum(local)
    return split + local


def plan_with_workers(
    facts: ModelFacts,
    gpus: Sequence[GpuInfo],
    host: HostInfo,
    request: FitRequest,
    checks: Sequence[WorkerCheck],
) -> WorkerPlan:
    """The fit plan over the main host, its GPUs and the workers that answered."""
    local = plan(facts, gpus, host, request)
    live = [c for c in checks if c.ok and c.devices]
    left_out = {c.worker.endpoint: f"not answering: {c.problem}" for c in checks if not c.ok}
    pinned = [c for c in live if c.worker.layers > 0]
    n_units = facts.n_layer + 1
    if pinned:
        for c in live:
            if not c.worker.layers:
                left_out[c.worker.endpoint] = "other workers have layers pinned; this one none"
        split = _pinned_split(pinned, gpus, n_units)
        used = pinned
        req = dataclasses.replace(
            request, n_gpu_layers=min(n_units, sum(split)), layer_split=tuple(split)
        )
    elif not live or local.fits:
        for c in live:
            left_out[c.worker.endpoint] = "not needed: the model fits on the main host"
        return WorkerPlan(local, (), (), left_out, local.fits)
    else:
        used = live
        req = request
    result = plan(facts, [*_remote_gpus(used), *gpus], host, req)
    if not pinned:
        # Workers whose devices got no layer are no dependency: plan again without them.
        layers = [d.layers for d in result.devices if d.kind == "gpu"]
        per_worker, i = [], 0
        for c in used:
            per_worker.append(sum(layers[i : i + len(c.devices)]))
            i += len(c.devices)
        idle = [c for c, n in zip(used, per_worker, strict=True) if n == 0]
        if idle:
            for c in idle:
                left_out[c.worker.endpoint] = "no layer left for it"
            used = [c for c in used if c not in idle]
            result = plan(facts, [*_remote_gpus(used), *gpus], host, req)
    result = _named(result, used)
    return WorkerPlan(
        result,
        tuple(c.worker.endpoint for c in used),
        tuple(c.worker.label for c in used),
        left_out,
        local.fits,
    )


def _named(result: FitPlan, used: Sequence[WorkerCheck]) -> FitPlan:
    """The plan with RPC devices named as llama-server names them (RPC0 …, their worker)
    and kind "rpc", and a reason line for the split."""
    remote = [d for c in used for d in c.devices]
    devices = []
    for i, d in enumerate(result.devices):
        if i < len(remote):
            dev = remote[i]
            d = dataclasses.replace(d, name=f"RPC{i} {dev.worker}", kind="rpc")
        devices.append(d)
    reasons = dict(result.reasons)
    per_device = ", ".join(
        f"{d.name.split(' ')[0]} {d.layers}" for d in devices if d.kind != "host"
    )
    host_layers = devices[-1].layers if devices else 0
    reasons["rpc"] = (
        f"layers: main host {host_layers}, {per_device} (--rpc {len(used)} worker"
        f"{'s' if len(used) != 1 else ''}: {', '.join(c.worker.label for c in used)})"
    )
    return dataclasses.replace(result, devices=tuple(devices), reasons=reasons)


def format_workers(wp: WorkerPlan, checks: Sequence[WorkerCheck]) -> str:
    """Lines for `warmslot fit`: each worker's check and its share of the model."""
    if not checks:
        return ""
    lines = ["workers (llama.cpp RPC):"]
    for c in checks:
        lines.append(f"  {c.summary()}")
        if c.worker.endpoint in wp.left_out:
            lines.append(f"      left out: {wp.left_out[c.worker.endpoint]}")
    if wp.endpoints:
        lines.append("  llama-server " + " ".join(wp.argv + plan_argv(wp.plan)))
    return "\n".join(lines)


def launch_plan(
    workers: WorkerSet,
    binary: Path,
    model: Path,
    state_dir: Path,
    request: FitRequest,
    *,
    env: Mapping[str, str] | None = None,
) -> WorkerPlan:
    """Check the workers and plan the launch over those that answer (blocking: run off
    the loop). A worker that does not answer is left out when the model fits without
    it; else this raises `WorkerUnavailable` naming it, and the launch waits."""
    checks = workers.check(binary, env)
    facts = read_facts(model)
    wp = plan_with_workers(facts, read_gpus(), read_host(state_dir), request, checks)
    missing = [c.worker.label for c in checks if not c.ok]
    if missing and not wp.plan.fits:
        workers.mark(in_use=(), lost=wp.left_out, waiting=missing)
        names = ", ".join(f"{c.worker.label} ({c.problem})" for c in checks if not c.ok)
        raise WorkerUnavailable(
            f"waiting for worker {names}: the model does not fit without it",
            workers=missing,
            hint="start `warmslot worker` there, or remove it from [[workers]]",
        )
    workers.mark(in_use=wp.endpoints, lost=wp.left_out, waiting=())
    return wp
