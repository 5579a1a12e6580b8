"""`warmslot bench trace`: an opencode-shaped trace, bare llama-server vs Warmslot.

Both runs use the same binary, model and launch flags, in one invocation. The
bare run sends the trace straight to llama-server (what a client does without
Warmslot); the Warmslot run sends it through the proxy with the cache manager.
Both restart the server before session 3. Reported per run: prompt tokens the
client waited for, tokens reused from cache, prefill seconds, hit rates (all
agent turns, turns 2..N, the first agent turn after the restart) — and the
server's own totals from `/metrics`, which include Warmslot's background work
(prewarm, probes), so the comparison is honest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

from core.bench.common import post_json, settle
from core.bench.trace import TraceRequest, interleave, make_trace
from core.config import Settings
from core.engine import Core
from core.events import CacheEventKind
from core.paths import Paths
from core.server.client import CompletionTimings, parse_metrics


class RequestRow(TypedDict):
    """One replayed request: what the server's `timings` said of it."""

    session: str
    kind: str  # the trace request's kind: "agent" | "title"
    turn: int
    after_restart: bool
    cache_n: int
    prompt_n: int
    prompt_ms: float
    previous: int  # its session's previous agent prompt, tokens (0: none, or after restart)


class RunSummary(TypedDict):
    """One arm's summary (`RunResult.summary`; `run` adds the request rows)."""

    run: str
    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    hit_all_agent: float | None
    hit_turns_2_plus: float | None
    hit_first_after_restart: float | None
    hit_titles: float | None
    own_previous_min: float | None
    server_prompt_tokens: int
    server_prefill_s: float
    wall_s: float
    cache_events: dict[str, int]
    rejections: list[str]
    flags: str
    requests: NotRequired[list[RequestRow]]


@dataclass
class RunResult:
    name: str
    requests: list[RequestRow] = field(default_factory=list)
    server_prompt_tokens: float = 0.0
    server_prompt_seconds: float = 0.0
    wall_s: float = 0.0
    cache_events: dict[str, int] = field(default_factory=dict)
    rejections: list[str] = field(default_factory=list)
    flags: str = ""  # the launch's slots, context and RAM cache (the same in both arms)

    def summary(self) -> RunSummary:
        agent = [r for r in self.requests if r["kind"] == "agent"]
        later = [r for r in agent if r["turn"] >= 2]
        # Of each agent turn from the second on: its session's previous prompt, reused.
        own = [r["cache_n"] / r["previous"] for r in later if r.get("previous")]
        after = [r for r in agent if r["turn"] == 1 and r["after_restart"]]

        def hit(rows: list[RequestRow]) -> float | None:
            cached = sum(r["cache_n"] for r in rows)
            total = cached + sum(r["prompt_n"] for r in rows)
            return cached / total if total else None

        return {
            "run": self.name,
            "prompt_tokens": sum(r["prompt_n"] for r in self.requests),
            "cached_tokens": sum(r["cache_n"] for r in self.requests),
            "prefill_s": round(sum(r["prompt_ms"] for r in self.requests) / 1000, 3),
            "hit_all_agent": hit(agent),
            "hit_turns_2_plus": hit(later),
            "hit_first_after_restart": hit(after),
            "hit_titles": hit([r for r in self.requests if r["kind"] == "title"]),
            "own_previous_min": min(own) if own else None,
            "server_prompt_tokens": int(self.server_prompt_tokens),
            "server_prefill_s": round(self.server_prompt_seconds, 3),
            "wall_s": round(self.wall_s, 2),
            "cache_events": dict(self.cache_events),
            "rejections": list(self.rejections),
            "flags": self.flags,
        }


def _server_metrics(core: Core) -> tuple[float, float]:
    sup = core.supervisor
    if sup is None or sup.base_url is None:
        return 0.0, 0.0
    req = urllib.request.Request(f"{sup.base_url}/metrics", headers=sup.auth_headers())
    with urllib.request.urlopen(req, timeout=30) as resp:
        values = parse_metrics(resp.read().decode())
    return (
        values.get("llamacpp:prompt_tokens_total", 0.0),
        values.get("llamacpp:prompt_seconds_total", 0.0),
    )


def replay(
    core: Core, trace: list[TraceRequest], name: str, *, through_proxy: bool, log: Any = None
) -> RunResult:
    result = RunResult(name)
    t0 = time.perf_counter()
    restarted = False
    previous: dict[str, int] = {}  # session → its last agent prompt (tokens)
    for r in trace:
        if r.restart_before:
            settle(core)
            tok, sec = _server_metrics(core)
            result.server_prompt_tokens += tok
            result.server_prompt_seconds += sec
            core.restart_server().result(600)
            settle(core)
            restarted = True
        sup = core.supervisor
        assert sup is not None and core.proxy is not None
        base = f"http://127.0.0.1:{core.proxy.port}" if through_proxy else sup.base_url
        # Straight to llama-server, the request carries its per-launch key.
        headers = r.headers if through_proxy else {**r.headers, **sup.auth_headers()}
        data = post_json(f"{base}/v1/chat/completions", r.body, headers)
        # llama-server's timings, as it sent them
        t = cast(CompletionTimings, data.get("timings") or {})
        row: RequestRow = {
            "session": r.session,
            "kind": r.kind,
            "turn": r.turn,
            "after_restart": restarted,
            "cache_n": int(t.get("cache_n", 0)),
            "prompt_n": int(t.get("prompt_n", 0)),
            "prompt_ms": float(t.get("prompt_ms", 0)),
            "previous": previous.get(r.session, 0) if not restarted else 0,
        }
        if r.kind == "agent":
            previous[r.session] = row["cache_n"] + row["prompt_n"]
        result.requests.append(row)
        if log is not None:
            log(
                f"  {name:<8} {r.session[:8]} {r.kind:<5} turn {r.turn}: cache_n "
                f"{row['cache_n']:>6} prompt_n {row['prompt_n']:>6} {row['prompt_ms']:>8.0f} ms"
            )
    settle(core)
    tok, sec = _server_metrics(core)
    result.server_prompt_tokens += tok
    result.server_prompt_seconds += sec
    result.wall_s = time.perf_counter() - t0
    for e in core.query("recent_events", limit=1000, category="cache").result(30):
        result.cache_events[e["kind"]] = result.cache_events.get(e["kind"], 0) + 1
        if e["kind"] == CacheEventKind.RESTORE_REJECTED:
            result.rejections.append(e["reason"])
    return result


def run(
    model: str,
    *,
    template: str = "",
    scale: float,
    sessions: int,
    turns: int,
    slots: int,
    ctx: int,
    workdir: Path | None = None,
    log: Any = None,
    alternate: bool = False,
    cache_ram_mib: int | None = None,
    binary: str = "",
    user: Paths | None = None,
) -> list[RunSummary]:
    """Run both arms and return their summaries (bare first).

    Both arms launch llama-server from the same settings, so with the same flags and
    memory: `slots` and `ctx` 0 leave them to the fit plan, as Warmslot's defaults do.
    `alternate`: the sessions take turns instead of following one another, without a
    restart (`interleave`)."""
    from core.cache.manager import policy_factory

    trace = make_trace(sessions=sessions, turns=turns, scale=scale)
    if alternate:
        trace = interleave(trace)
    base = workdir or Path(tempfile.mkdtemp(prefix="warmslot-bench-"))
    summaries = []
    try:
        for name, factory, proxy in (("bare", None, False), ("warmslot", policy_factory, True)):
            home = base / name
            shutil.rmtree(home, ignore_errors=True)
            s = Settings().replace("server.model", model).replace("proxy.port", 0)
            s = s.replace("server.slots", slots).replace("server.ctx_per_slot", ctx)
            s = s.replace("server.chat_template_file", template)
            if cache_ram_mib is not None:
                s = s.replace("server.cache_ram_mib", cache_ram_mib)
            s = s.replace("server.binary", binary)
            # Both arms use the user's builds (`Paths.scratch`): the same binary, found or
            # built once and kept.
            paths = user.scratch(home) if user is not None else Paths.under(home)
            core = Core(paths, s, policy_factory=factory)
            core.start(wait_ready=True)
            try:
                result = replay(core, trace, name, through_proxy=proxy, log=log)
                if core.fit_plan is not None:
                    p = core.fit_plan
                    result.flags = f"-np {p.slots} -c {p.slots * p.ctx_per_slot} " + (
                        f"--cache-ram {p.cache_ram_mib}"
                    )
                summaries.append(result)
            finally:
                core.stop()
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    out = []
    for r in summaries:
        summary = r.summary()
        summary["requests"] = r.requests  # last, as the JSON has always had it
        out.append(summary)
    return out


def format_table(summaries: list[RunSummary]) -> str:
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v * 100:.1f} %"

    rows = [
        ("", *[s["run"] for s in summaries]),
        (
            "prompt tokens evaluated (client requests)",
            *[str(s["prompt_tokens"]) for s in summaries],
        ),
        ("prompt tokens reused", *[str(s["cached_tokens"]) for s in summaries]),
        ("prefill seconds (client requests)", *[f"{s['prefill_s']:.2f}" for s in summaries]),
        ("hit rate, all agent turns", *[pct(s["hit_all_agent"]) for s in summaries]),
        ("hit rate, agent turns 2..N", *[pct(s["hit_turns_2_plus"]) for s in summaries]),
        (
            "least of a turn's own previous prompt reused",
            *[pct(s.get("own_previous_min")) for s in summaries],
        ),
        (
            "hit rate, first turn after restart",
            *[pct(s["hit_first_after_restart"]) for s in summaries],
        ),
        (
            "server prefill tokens (incl. background)",
            *[str(s["server_prompt_tokens"]) for s in summaries],
        ),
        (
            "server prefill seconds (incl. background)",
            *[f"{s['server_prefill_s']:.2f}" for s in summaries],
        ),
        ("wall seconds", *[f"{s['wall_s']:.1f}" for s in summaries]),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{r[0]:<{width}}  " + "  ".join(f"{c:>10}" for c in r[1:]) for r in rows)


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("trace", help="opencode-shaped trace: bare llama-server vs Warmslot")
    p.add_argument("--model", help="GGUF to use (default: the configured or demo model)")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="size of tools/system prompt (1.0 = opencode's ~20.8k + 9.7k characters)",
    )
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument(
        "--slots", type=int, default=2, help="slots (-np) of both arms; 0: the fit plan's"
    )
    p.add_argument("--ctx", type=int, default=32768, help="context per slot; 0: the fit plan's")
    p.add_argument(
        "--alternate",
        action="store_true",
        help="the sessions take turns (no restart); with it --slots and --ctx default to 0",
    )
    p.add_argument(
        "--cache-ram", type=int, default=None, help="--cache-ram MiB of both arms (-1: plan)"
    )
    p.add_argument(
        "--chat-template",
        default="",
        help="template file (default: the "
        "configured one, or Warmslot's tool-capable template for the demo model)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    import sys

    from core import config as config_mod
    from core.server import model as model_mod

    paths = Paths.default(getattr(args, "dev_dir", None))
    from core.server.launch import chat_template_for

    settings = config_mod.load(paths.config_file)
    resolved = model_mod.resolve(paths, args.model or settings.server.model)
    model = str(resolved.path)
    template = args.chat_template or str(chat_template_for(settings.server, resolved) or "")
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    pinned = {a for a in ("--slots", "--ctx") if any(x.startswith(a) for x in sys.argv)}
    summaries = run(
        model,
        template=template,
        scale=args.scale,
        sessions=args.sessions,
        turns=args.turns,
        slots=args.slots if not args.alternate or "--slots" in pinned else 0,
        ctx=args.ctx if not args.alternate or "--ctx" in pinned else 0,
        log=log,
        alternate=args.alternate,
        cache_ram_mib=args.cache_ram,
        binary=settings.server.binary,
        user=paths,
    )
    if args.json:
        print(json.dumps(summaries, indent=2))
    else:
        flags = summaries[-1].get("flags") or ""
        print(f"model: {model}\nllama-server (both arms): {flags}\n" + format_table(summaries))
    return 0


__all__ = ["RequestRow", "RunResult", "RunSummary", "add_parser", "format_table", "run"]
