"""`warmslot bench overhead`: the latency the proxy adds to a request.

One run starts a Core (its own temporary folders, an ephemeral proxy port) and
sends identical small requests to llama-server directly and through the proxy,
alternating which goes first in each round so drift (CPU frequency, other load,
the server's own state) hits both sides alike. Each case reuses one cached
prompt, so llama-server's share stays small and steady and the difference is the
proxy's: parsing, validation, forwarding, streaming and recording the request.

Cases: ``/completion`` with ``n_predict`` 1; ``/v1/chat/completions`` not
streamed (``max_tokens`` 1); and streamed (``max_tokens`` 8), measured to the
first event and to the end of the stream. Clients are plain keep-alive
``http.client`` connections (one per side), so client overhead is small and equal.

Reported per case and side: p50/p90/p99 in ms, the added ms at each percentile
(proxy − direct), the ratio of the p50s and the median of the per-round
differences. The goal: p50 added ≤ 1 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NotRequired, TypedDict

from core.config import Settings
from core.paths import Paths

GOAL_P50_ADDED_MS = 1.0
PERCENTILES = (50, 90, 99)
PROMPT = (
    "You are a coding assistant. The repository uses Python 3.11, pytest and ruff. "
    "Answer in one short sentence."
)
MESSAGES = [
    {"role": "system", "content": PROMPT},
    {"role": "user", "content": "Which test runner does the project use?"},
]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Mapping[str, object]  # sent as is, with cache_prompt added
    stream: bool = False


CASES: tuple[Case, ...] = (
    Case("completion, n_predict 1", "/completion", {"prompt": PROMPT, "n_predict": 1}),
    Case(
        "chat, non-streamed",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1, "temperature": 0},
    ),
    Case(
        "chat, streamed",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True},
        stream=True,
    ),
)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = sum(values) / len(values)
    return out


class _Side:
    """One keep-alive connection to one target (llama-server or the proxy)."""

    def __init__(self, name: str, host: str, port: int, auth: dict[str, str] | None = None) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.auth = dict(auth or {})  # llama-server's per-launch key, for the direct side
        self.conn = http.client.HTTPConnection(host, port, timeout=120)

    def send(self, case: Case) -> tuple[float, float]:
        """One request; returns (ms to the first event or whole body, ms to the end)."""
        body = json.dumps({**case.body, "cache_prompt": True}).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "warmslot-bench/1",
            **self.auth,
        }
        t0 = time.perf_counter()
        try:
            self.conn.request("POST", case.path, body=body, headers=headers)
            resp = self.conn.getresponse()
        except (http.client.HTTPException, OSError):
            # A dropped keep-alive connection: reconnect once (not timed twice: start over).
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            t0 = time.perf_counter()
            self.conn.request("POST", case.path, body=body, headers=headers)
            resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{self.name} {case.path} → {resp.status}: {resp.read()[:300]!r}")
        first = 0.0
        if case.stream:
            while True:
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data: ") and not first:
                    first = (time.perf_counter() - t0) * 1000
            resp.read()
            # llama-server closes the connection after a stream (the proxy does not pool
            # those either): reconnect for the next request instead of failing on it.
            self.conn.close()
        else:
            resp.read()
        total = (time.perf_counter() - t0) * 1000
        return (first or total), total

    def close(self) -> None:
        self.conn.close()


class CaseReport(TypedDict):
    """One case of the report: times (ms) by percentile, direct and through the proxy."""

    case: str
    n: int
    direct_ms: dict[str, float]  # p50, p90, p99, mean
    proxy_ms: dict[str, float]
    added_ms: dict[str, float]
    ratio_p50: float | None
    paired_median_added_ms: float


class ServedBy(TypedDict):
    binary: str
    version: str
    commit: str
    argv: list[str]


class ModelSize(TypedDict):
    path: str
    bytes: int


class Machine(TypedDict):
    """The machine a bench ran on (`machine`), as its report shows it."""

    cpu: str
    cpus: int | None  # os.cpu_count(): None where it cannot tell
    system: str
    python: str
    ram_gib: NotRequired[float]  # these two need psutil
    load_avg: NotRequired[list[float]]


class OverheadReport(TypedDict):
    """`warmslot bench overhead --json`."""

    requests_per_case: int
    cache_manager: bool
    machine: Machine
    server: ServedBy
    model: ModelSize
    cases: list[CaseReport]
    goal_p50_added_ms: float
    goal_met: bool


@dataclass
class CaseResult:
    name: str
    direct: list[float] = field(default_factory=list)
    proxy: list[float] = field(default_factory=list)

    def report(self) -> CaseReport:
        d, p = summarize(self.direct), summarize(self.proxy)
        paired = sorted(b - a for a, b in zip(self.direct, self.proxy, strict=True))
        return {
            "case": self.name,
            "n": len(self.direct),
            "direct_ms": d,
            "proxy_ms": p,
            "added_ms": {k: p[k] - d[k] for k in d},
            "ratio_p50": p["p50"] / d["p50"] if d["p50"] else None,
            "paired_median_added_ms": percentile(paired, 50),
        }


def measure(
    direct: tuple[str, int],
    proxy: tuple[str, int],
    *,
    requests: int,
    warmup: int = 10,
    cases: Sequence[Case] = CASES,
    progress: Callable[[str], None] | None = None,
    direct_auth: dict[str, str] | None = None,
) -> list[CaseReport]:
    """Interleave `requests` rounds of every case against both targets (`direct_auth`:
    the headers llama-server's key needs, `Supervisor.auth_headers`)."""
    sides = {
        "direct": _Side("llama-server", *direct, auth=direct_auth),
        "proxy": _Side("proxy", *proxy),
    }
    results: dict[str, CaseResult] = {}
    for case in cases:
        results[case.name] = CaseResult(case.name)
        if case.stream:
            results[case.name + " (first event)"] = CaseResult(case.name + " (first event)")
    try:
        for i in range(warmup + requests):
            for case in cases:
                order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
                timed = {side: sides[side].send(case) for side in order}
                if i < warmup:
                    continue
                res = results[case.name]
                res.direct.append(timed["direct"][1])
                res.proxy.append(timed["proxy"][1])
                if case.stream:
                    first = results[case.name + " (first event)"]
                    first.direct.append(timed["direct"][0])
                    first.proxy.append(timed["proxy"][0])
            if progress is not None and i >= warmup and (i - warmup + 1) % 50 == 0:
                progress(f"  {i - warmup + 1}/{requests} rounds")
    finally:
        for side in sides.values():
            side.close()
    return [r.report() for r in results.values()]


def machine() -> Machine:
    """The CPU, its count, the system, Python, and (with psutil) memory and load."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: Machine = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except (ImportError, OSError):
        pass
    return info


def run(
    model: str,
    *,
    requests: int = 200,
    binary: str = "",
    threads: int = 0,
    with_cache: bool = False,
    progress: Callable[[str], None] | None = None,
    user: Paths | None = None,
) -> OverheadReport:
    """Start a Core on `model`, measure, stop it; returns the report. `user`: the
    installation whose llama-server builds the run uses (`Paths.scratch`)."""
    from core.engine import Core

    settings = Settings()
    settings.proxy.port = 0
    settings.server.model = model
    settings.server.binary = binary
    settings.server.slots = 2
    settings.server.ctx_per_slot = 4096
    settings.server.threads = threads
    settings.server.cache_ram_mib = 256
    policy_factory = None
    if with_cache:
        from core.cache.manager import policy_factory as cache_policy

        policy_factory = cache_policy
    with tempfile.TemporaryDirectory(prefix="warmslot-bench-") as tmp:
        home = user.scratch(Path(tmp)) if user is not None else Paths.under(Path(tmp))
        core = Core(home, settings, policy_factory=policy_factory)
        core.start(wait_ready=True, timeout=600)
        try:
            sup, proxy = core.supervisor, core.proxy
            assert sup is not None and proxy is not None and sup.port is not None
            snap = sup.snapshot()
            served = snap["binary"]
            assert served is not None  # resolved: the server is ready
            if progress is not None:
                progress(f"llama-server ready (pid {sup.pid}); {requests} rounds per case")
            cases = measure(
                (settings.server.host, sup.port),
                ("127.0.0.1", proxy.port),
                requests=requests,
                progress=progress,
                direct_auth=sup.auth_headers(),
            )
        finally:
            core.stop()
    met = all(c["added_ms"]["p50"] <= GOAL_P50_ADDED_MS for c in cases)
    return {
        "requests_per_case": requests,
        "cache_manager": with_cache,
        "machine": machine(),
        "server": {
            "binary": served["path"],
            "version": served["version"],
            "commit": served["commit"],
            "argv": snap["argv"],
        },
        "model": {"path": model, "bytes": os.path.getsize(model)},
        "cases": cases,
        "goal_p50_added_ms": GOAL_P50_ADDED_MS,
        "goal_met": met,
    }


def format_report(report: OverheadReport) -> str:
    def trio(d: dict[str, float], sign: bool = False) -> str:
        fmt = "{:+.2f}" if sign else "{:.2f}"
        return " / ".join(fmt.format(d[f"p{p}"]) for p in PERCENTILES)

    m = report["machine"]
    lines = [
        f"proxy overhead: {report['requests_per_case']} interleaved rounds per case"
        + (" (with the cache manager)" if report["cache_manager"] else " (plain proxy)"),
        f"machine: {m['cpu']}, {m['cpus']} CPUs, {m.get('ram_gib', '?')} GiB, {m['system']}, "
        f"Python {m['python']}, load {m.get('load_avg', '?')}",
        f"server:  llama-server {report['server']['version']} "
        f"(commit {report['server']['commit'] or '?'}); model "
        f"{Path(report['model']['path']).name} ({report['model']['bytes'] / 1e6:.1f} MB)",
        "",
        f"{'case':<34} {'direct p50/p90/p99':>22} {'proxy p50/p90/p99':>22} "
        f"{'added p50/p90/p99':>24} {'ratio':>6} {'paired':>7}",
    ]
    for c in report["cases"]:
        ratio = f"{c['ratio_p50']:.2f}×" if c["ratio_p50"] else "—"
        lines.append(
            f"{c['case']:<34} {trio(c['direct_ms']):>22} {trio(c['proxy_ms']):>22} "
            f"{trio(c['added_ms'], sign=True):>24} {ratio:>6} "
            f"{c['paired_median_added_ms']:>+7.2f}"
        )
    lines.append("")
    lines.append(
        "all times in ms; 'paired' = median of per-round (proxy − direct); goal: p50 added ≤ "
        f"{report['goal_p50_added_ms']:.0f} ms — " + ("met" if report["goal_met"] else "NOT met")
    )
    return "\n".join(lines)


def main_overhead(
    model: str,
    requests: int,
    as_json: bool,
    binary: str = "",
    threads: int = 0,
    with_cache: bool = False,
    user: Paths | None = None,
) -> int:
    progress = None if as_json else (lambda s: print(s, file=sys.stderr, flush=True))
    report = run(
        model,
        requests=requests,
        binary=binary,
        threads=threads,
        with_cache=with_cache,
        progress=progress,
        user=user,
    )
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
