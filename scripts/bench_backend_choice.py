"""What choosing a backend costs per request (docs/scale.md#several-backends).

Times `Router.decide` on opencode's recorded agent turn (tests/fixtures/clients/opencode,
a 31 KB body) without backends and with 2, 10 and 100 backends, each with 10,000
remembered sessions of which `--active` were active in the last 10 minutes: a new
session (affinity key + placement) and a session that sticks. Also the cost of one
backend failing (its sessions unpinned). Nothing is launched.

    .venv/bin/python scripts/bench_backend_choice.py [--active 1000] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from core import chat as apis
from core.routing.choice import Affinity, BackendView, Pick
from core.routing.router import Router, Target
from core.server.upstream import Upstream

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/clients/opencode/requests.json"
HEADERS = {"user-agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23"}


def _median_us(fn: Any, repeat: int) -> float:
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--active", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    body: dict[str, Any] = json.loads(FIXTURE.read_text())[1]["body"]
    chat = apis.chat_view("chat", body)
    target = (Target("", None, primary=True),)
    single = Router(lambda: target)
    base = _median_us(
        lambda i: single.decide("chat", {**HEADERS, "x-session-id": f"s{i}"}, body, chat),
        args.repeat,
    )
    print(f"Router.decide, no backends: {base:.1f} µs")
    for n in (2, 10, 100):
        print(_with_backends(n, args.active, args.repeat, body, chat, base))


def _with_backends(
    n: int, active: int, repeat: int, body: dict[str, Any], chat: Any, base: float
) -> str:
    target = (Target("", None, primary=True),)
    views = [BackendView(f"b{i}", True, inflight=i % 3) for i in range(n)]
    aff = Affinity()
    now = time.monotonic()
    for i in range(10_000):  # remembered sessions, the last `active` of them active
        age = 0.0 if i >= 10_000 - active else 3600.0
        aff.choose(views, session=f"old{i}", side=False, key=f"k{i % 50}", now=now - age)
    up = Upstream(lambda: None)

    def chooser(session: str, side: bool, key: str) -> tuple[Pick, Upstream | None]:
        pick = aff.choose(views, session=session, side=side, key=key, now=time.monotonic())
        return pick, up

    router = Router(lambda: target, backend=chooser)
    new = _median_us(
        lambda i: router.decide("chat", {**HEADERS, "x-session-id": f"new{i}"}, body, chat),
        repeat,
    )
    stick = _median_us(
        lambda i: router.decide("chat", {**HEADERS, "x-session-id": "new0"}, body, chat),
        repeat,
    )
    t0 = time.perf_counter()
    aff.backend_down("b1", time.monotonic())
    down_ms = (time.perf_counter() - t0) * 1000
    return (
        f"{n:>3} backends, 10,000 sessions ({active} active): new session "
        f"{new:.1f} µs (+{new - base:.1f}), sticky {stick:.1f} µs (+{stick - base:.1f}); "
        f"a backend failing {down_ms:.2f} ms"
    )


if __name__ == "__main__":
    main()
