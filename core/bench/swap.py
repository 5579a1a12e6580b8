"""`warmslot bench swap`: two models that do not fit together, alternating requests.

Both arms run in one invocation on the same binary and models, with a RAM budget
that fits one model at a time, so every request for the other model swaps:

- **plain** — unload/reload only (the cache manager off), what a model swapper does;
- **swap-aware** — Warmslot saves each model's prefix before unloading it and
  restores (and verifies) it after loading it again, before the request runs.

Reported per arm: prompt tokens the requests had to evaluate, tokens reused,
prefill seconds and wall seconds, over the requests after each model's first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict, cast

from core.bench.common import post_json, settle
from core.bench.trace import make_trace
from core.config import ModelProfile, Settings
from core.engine import Core
from core.paths import Paths
from core.server.client import CompletionTimings


def settings_for_swap(
    model_a: str, model_b: str, *, ctx: int, budget_mib: int, cache: bool
) -> Settings:
    s = Settings().replace("server.model", model_a).replace("proxy.port", 0)
    s = s.replace("server.ctx_per_slot", ctx).replace("cache.enabled", cache)
    s.models = [
        ModelProfile(name="a", role="text"),
        ModelProfile(name="b", model=model_b, priority=100),
    ]
    s.pool.ram_floor_mib = 0
    s.pool.ram_budget_mib = budget_mib
    s.pool.vram_budget_mib = 1  # keep the plan on the host: the budget is what swaps
    return s


def budget_for_one(model_a: str, model_b: str, ctx: int, state_dir: Path) -> int:
    """A RAM budget (MiB) that fits the larger model alone but not both."""
    from core.machine import devices
    from core.models import profiles

    s = settings_for_swap(model_a, model_b, ctx=ctx, budget_mib=0, cache=True)
    host = devices.read_host(state_dir)
    mib = [
        profiles.footprint(p, profiles.server_settings(s, p), Path(m), [], host).ram // profiles.MIB
        for p, m in zip(profiles.profiles(s), (model_a, model_b), strict=True)
    ]
    return int(max(mib) + min(mib) // 2)


class SwapRequest(TypedDict):
    """One request of an arm: its round, model and llama-server's reuse numbers."""

    round: int
    model: str  # "a" or "b"
    cache_n: int
    prompt_n: int
    prompt_ms: float


class ArmResult(TypedDict):
    """One arm of `warmslot bench swap` (plain unload/reload, or swap-aware)."""

    run: str
    requests_after_swap: int
    prompt_tokens: int
    cached_tokens: int
    hit: float | None
    prefill_s: float
    wall_s: float
    loads: int
    requests: list[SwapRequest]


def run_arm(
    name: str,
    model_a: str,
    model_b: str,
    *,
    rounds: int,
    scale: float,
    ctx: int,
    budget_mib: int,
    home: Paths,
    log: Any = None,
) -> ArmResult:
    """Run one arm: `rounds` agent sessions on each model in turn, one budget for both."""
    from core.cache.manager import policy_factory

    s = settings_for_swap(
        model_a, model_b, ctx=ctx, budget_mib=budget_mib, cache=name == "swap-aware"
    )
    # Each round opens a new agent session on each model (the user switching models
    # between tasks): what survives a swap is the stable prefix the sessions share.
    trace = [
        r
        for r in make_trace(sessions=rounds, turns=1, scale=scale, restart_before_session=None)
        if r.kind == "agent"
    ]
    core = Core(home, s, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    rows: list[SwapRequest] = []
    t0 = time.perf_counter()
    try:
        assert core.proxy is not None
        for i, r in enumerate(trace):
            for model in ("a", "b"):
                headers = {**r.headers, "x-session-id": f"{model}-{r.session}"}
                data = post_json(
                    f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions",
                    {**r.body, "model": model},
                    headers,
                )
                # llama-server's timings, as it sent them
                t = cast(CompletionTimings, data.get("timings") or {})
                rows.append(
                    {
                        "round": i,
                        "model": model,
                        "cache_n": int(t.get("cache_n", 0)),
                        "prompt_n": int(t.get("prompt_n", 0)),
                        "prompt_ms": float(t.get("prompt_ms", 0.0)),
                    }
                )
                if log is not None:
                    log(
                        f"  {name:<10} round {i} model {model}: cache_n {rows[-1]['cache_n']:>6}"
                        f" prompt_n {rows[-1]['prompt_n']:>6} {rows[-1]['prompt_ms']:>8.0f} ms"
                    )
                settle(core)
        events = core.query("recent_events", limit=500, category="models").result(30)
    finally:
        core.stop()
    swapped = [r for r in rows if r["round"] > 0]  # every one of these followed a swap
    cached = sum(r["cache_n"] for r in swapped)
    new = sum(r["prompt_n"] for r in swapped)
    return {
        "run": name,
        "requests_after_swap": len(swapped),
        "prompt_tokens": new,
        "cached_tokens": cached,
        "hit": cached / (cached + new) if cached + new else None,
        "prefill_s": round(sum(r["prompt_ms"] for r in swapped) / 1000, 3),
        "wall_s": round(time.perf_counter() - t0, 2),
        "loads": sum(1 for e in events if e["kind"] == "loaded"),
        "requests": rows,
    }


def run(
    model_a: str,
    model_b: str,
    *,
    rounds: int = 4,
    scale: float = 0.5,
    ctx: int = 24576,
    workdir: Path | None = None,
    log: Any = None,
    user: Paths | None = None,
) -> list[ArmResult]:
    """Both arms, plain then swap-aware, on the same models and budget. `user`: the
    installation whose llama-server builds they use (`Paths.scratch`)."""
    base = workdir or Path(tempfile.mkdtemp(prefix="warmslot-swap-"))
    try:
        budget = budget_for_one(model_a, model_b, ctx, base)
        return [
            run_arm(
                name,
                model_a,
                model_b,
                rounds=rounds,
                scale=scale,
                ctx=ctx,
                budget_mib=budget,
                home=user.scratch(base / name) if user else Paths.under(base / name),
                log=log,
            )
            for name in ("plain", "swap-aware")
        ]
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)


def format_table(results: list[ArmResult]) -> str:
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v * 100:.1f} %"

    rows = [
        ("", *[r["run"] for r in results]),
        ("requests after a swap", *[str(r["requests_after_swap"]) for r in results]),
        ("prompt tokens evaluated", *[str(r["prompt_tokens"]) for r in results]),
        ("prompt tokens reused", *[str(r["cached_tokens"]) for r in results]),
        ("hit rate", *[pct(r["hit"]) for r in results]),
        ("prefill seconds", *[f"{r['prefill_s']:.2f}" for r in results]),
        ("model loads", *[str(r["loads"]) for r in results]),
        ("wall seconds", *[f"{r['wall_s']:.1f}" for r in results]),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{r[0]:<{width}}  " + "  ".join(f"{c:>11}" for c in r[1:]) for r in rows)


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "swap", help="two models, one memory budget: plain reload vs swap-aware save/restore"
    )
    p.add_argument(
        "--model-a",
        required=True,
        help="first GGUF (dense models show the "
        "disk tier; sliding-window ones need the checkpoint patch)",
    )
    p.add_argument("--model-b", required=True, help="second GGUF")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--scale", type=float, default=0.5, help="trace size (1.0 = opencode)")
    p.add_argument("--ctx", type=int, default=24576, help="context per slot")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    results = run(
        args.model_a,
        args.model_b,
        rounds=args.rounds,
        scale=args.scale,
        ctx=args.ctx,
        log=log,
        user=Paths.default(getattr(args, "dev_dir", None)),
    )
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0
