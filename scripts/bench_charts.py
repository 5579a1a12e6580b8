#!/usr/bin/env python3
"""Benchmark: how long each dashboard chart takes to refresh with 1 million requests.

    .venv/bin/python scripts/bench_charts.py [--rows 1000000] [--days 30] [--repeat 5]

Fills a temporary telemetry database with `--rows` request rows spread over
`--days` (plus a day of 5-second memory samples and some events), then for
every tab times

- each telemetry query it needs, run directly (as the core thread would);
- drawing the results on the GUI thread (`Tab.apply`);
- the whole refresh as the dashboard does it (futures → GUI thread → draw).

Prints a Markdown table (median and worst of `--repeat` runs). Not a test: the
target is ≤ 200 ms per chart refresh; see docs/gui.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.backend import TelemetryBackend, status_from_telemetry  # noqa: E402
from app.bridge import Bridge  # noqa: E402
from app.dashboard import Dashboard, Tab, ViewContext  # noqa: E402
from app.qt import QtCore, QtWidgets  # noqa: E402
from app.tasks import Tasks  # noqa: E402
from core.telemetry import Telemetry  # noqa: E402
from tests.fixtures import demo_data as demo  # noqa: E402

CLIENTS = ("opencode", "openai-python", "aider", "curl")
COLUMNS = (
    "ts, request_id, client, session, endpoint, stream, has_tools, kind, status, slot, "
    "prompt_n, cache_n, prompt_ms, predicted_n, ttfb_ms, total_ms, error"
)
TARGET_MS = 200.0


def fill(path: Path, rows: int, days: float, now: float, seed: int = 1) -> None:
    """`rows` requests over `days` up to `now` (bulk insert), plus samples and events."""
    tel = Telemetry(path, clock=lambda: now)
    for ev in demo.pressure(now, hours=24, every=5.0):
        tel.record(ev)
    for ev in demo.events(now):
        tel.record(ev)
    tel.flush()
    rng = random.Random(seed)
    conn = tel.db.conn
    span = days * 86400
    batch: list[tuple[Any, ...]] = []
    placeholders = ", ".join("?" for _ in COLUMNS.split(","))
    sql = f"INSERT INTO requests ({COLUMNS}) VALUES ({placeholders})"
    conn.execute("BEGIN")
    for i in range(rows):
        ts = now - span * (i / rows) + rng.random()
        client = CLIENTS[rng.randrange(4)]
        warm = rng.random() < 0.85
        prompt_n = rng.randint(50, 2000) if warm else rng.randint(3000, 14000)
        cache_n = rng.randint(4000, 12000) if warm else rng.randint(0, 40)
        ttfb = prompt_n * 0.4 + rng.uniform(40, 120)
        batch.append(
            (
                ts,
                f"r{i}",
                client,
                f"{client}-{i // 40}",
                "chat",
                1,
                1,
                "agent",
                200,
                rng.randrange(3),
                prompt_n,
                cache_n,
                prompt_n * 0.35,
                rng.randint(10, 500),
                ttfb,
                ttfb + 2000,
                "",
            )
        )
        if len(batch) == 20000:
            conn.executemany(sql, batch)
            batch.clear()
    if batch:
        conn.executemany(sql, batch)
    conn.execute("COMMIT")
    tel.close()


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(median ms, worst ms, last result)."""
    times = []
    result: Any = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), max(times), result


def wait_refresh(tab: Tab) -> float:
    loop = QtCore.QEventLoop()
    tab.refreshed.connect(loop.quit)
    done = tab.refresh_count
    t0 = time.perf_counter()
    tab.refresh()
    while tab.refresh_count == done or tab.busy:
        loop.exec()
    ms = (time.perf_counter() - t0) * 1000
    tab.refreshed.disconnect(loop.quit)
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--days", type=float, default=30.0, help="spread the rows over this many days")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--db", type=Path, help="keep the database here (reused if it exists)")
    args = ap.parse_args()

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["bench"])
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "telemetry.sqlite3"
        if not db.exists():
            t0 = time.perf_counter()
            fill(db, args.rows, args.days, now)
            print(
                f"filled {args.rows:,} requests over {args.days:g} days in "
                f"{time.perf_counter() - t0:.1f} s ({db.stat().st_size / 2**20:.0f} MiB)"
            )
        backend = TelemetryBackend(db, snapshot=demo.status(now), clock=lambda: now)
        tasks = Tasks()
        ctx = ViewContext(backend=backend, tasks=tasks, bridge=Bridge(), clock=lambda: now)
        dash = Dashboard(ctx)
        dash.resize(1280, 860)
        dash.show()
        direct = Telemetry(db, clock=lambda: now)

        def run_query(name: str, kw: dict[str, Any]) -> Any:
            if name == "server_status":  # server and cache state: no telemetry work
                return demo.status(now)
            if name == "status":  # Core.status(): the all-time aggregates included
                return status_from_telemetry(demo.status(now), direct, now)
            return getattr(direct, name)(**kw)

        scenarios: list[tuple[str, Tab, Callable[[], None]]] = []
        pages = dash.pages
        scenarios.append(("Overview", pages["overview"], lambda: None))
        reuse = pages["reuse"]
        for i, label in enumerate(("minute / 1 h", "hour / 24 h", "day / 30 d")):
            scenarios.append(
                (f"Reuse ({label})", reuse, lambda i=i: reuse.bucket.setCurrentIndex(i))  # type: ignore[attr-defined]
            )
        memory = pages["memory"]
        for i, label in ((1, "1 h"), (3, "24 h")):
            scenarios.append(
                (f"Memory ({label})", memory, lambda i=i: memory.period.setCurrentIndex(i))  # type: ignore[attr-defined]
            )
        scenarios += [
            ("Cache", pages["cache"], lambda: None),
            ("Events (24 h)", pages["events"], lambda: None),
            ("Server", pages["server"], lambda: None),
        ]

        print()
        print(
            "| chart refresh | first load ms | refresh ms (median / worst) "
            "| queries ms | slowest query (ms) | draw ms | ≤ 200 ms |"
        )
        print("|---|---|---|---|---|---|---|")
        slow: dict[str, float] = {}
        for title, tab, select in scenarios:
            dash.tabs.setCurrentWidget(tab.parentWidget().parentWidget())
            select()
            while tab.busy:  # the selection's own refresh
                wait_refresh(tab)
            cache = getattr(tab, "buckets", None)
            if cache is not None:
                cache.clear()
            first = wait_refresh(tab)
            e2e = [wait_refresh(tab) for _ in range(args.repeat)]
            reqs = dict(tab.last_requests)
            per_query: dict[str, float] = {}
            for name, kw in reqs.values():
                med, _worst, _res = timed(lambda n=name, k=kw: run_query(n, k), args.repeat)
                per_query[f"{name}{_short(kw)}"] = med
            got = dict(tab.last_results)
            draw_med, _w, _r = timed(lambda t=tab, g=got: t.apply(g), args.repeat)
            worst_q = max(per_query.items(), key=lambda kv: kv[1])
            for q, ms in per_query.items():
                slow[q] = max(slow.get(q, 0.0), ms)
            ok = "yes" if statistics.median(e2e) <= TARGET_MS else "**no**"
            print(
                f"| {title} | {first:.0f} | {statistics.median(e2e):.0f} / {max(e2e):.0f} "
                f"| {sum(per_query.values()):.0f} | {worst_q[0]} {worst_q[1]:.0f} "
                f"| {draw_med:.0f} | {ok} |"
            )
        print()
        poll, _w, _r = timed(lambda: direct.totals(now - 3600), args.repeat)
        full, _w, _r = timed(lambda: status_from_telemetry(demo.status(now), direct, now), 1)
        print(f"tray status poll (server state + totals of the last hour): {poll:.0f} ms")
        print(f"Core.status() telemetry part (all-time totals, per client): {full:.0f} ms")
        print()
        print("Queries slower than 50 ms (as refreshed above):")
        for q, ms in sorted(slow.items(), key=lambda kv: -kv[1]):
            if ms > 50:
                print(f"  {ms:7.0f} ms  {q}")
        direct.close()
        dash.close()
        backend.close()
        tasks.shutdown()
        for obj in (dash, tasks, ctx.bridge):
            obj.deleteLater()
        QtCore.QCoreApplication.sendPostedEvents(None, QtCore.QEvent.Type.DeferredDelete.value)
        app.processEvents()
        del dash, tasks, ctx, scenarios, pages
        gc.collect()
    return 0


def _short(kw: dict[str, Any]) -> str:
    keep = {k: v for k, v in kw.items() if k in ("bucket", "category", "kind", "limit")}
    return f"({', '.join(f'{k}={v}' for k, v in keep.items())})" if keep else "()"


if __name__ == "__main__":
    sys.exit(main())
