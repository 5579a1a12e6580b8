"""Synthetic but realistic telemetry and status, for screenshots and benchmarks.

`fill(tel, now)` writes a month of requests from a few agent clients (warm
turns reuse a long stable prefix; cold ones after restarts and divergences do
not), cache and server events, memory-pressure samples with a few low/critical
spells and some server runs — all through `Telemetry.record`, like the core.
`status(now)` is a `Core.status()`-shaped snapshot to go with it.
"""

from __future__ import annotations

import math
import random
from typing import Any

from core.events import (
    CacheEvent,
    Notice,
    PressureSample,
    RequestCompleted,
    ServerExited,
    ServerLaunched,
    ServerStateChanged,
)
from core.telemetry import Telemetry

CLIENTS = (("opencode", 0.55), ("openai-python", 0.2), ("aider", 0.15), ("curl", 0.1))
GiB = 2**30
MODEL = "/home/me/models/Qwen3-Coder-30B-A3B-Instruct-Q4_K_M.gguf"
BINARY = "/home/me/.cache/warmslot/builds/b7e41c2/llama-server"
ARGV = [
    BINARY,
    "-m",
    MODEL,
    "--host",
    "127.0.0.1",
    "--port",
    "38411",
    "-np",
    "4",
    "-c",
    "131072",
    "--cache-ram",
    "8192",
    "--slot-save-path",
    "/home/me/.local/state/warmslot/slots/3f9c0a1d2b4e5f60",
    "--metrics",
    "--no-webui",
    "-ngl",
    "99",
    "--n-cpu-moe",
    "12",
    "-fa",
    "on",
]


def _activity(ts: float) -> float:
    """Requests per minute at a time of day: busy office hours, quiet nights."""
    hour = (ts / 3600.0) % 24
    return 0.3 + 5.0 * max(0.0, math.sin((hour - 7) / 12 * math.pi)) ** 1.5


def requests(now: float, days: int = 30, seed: int = 7) -> list[RequestCompleted]:
    rng = random.Random(seed)
    out: list[RequestCompleted] = []
    t = now - days * 86400
    restarts = {int(now - d * 86400 - 5 * 3600) for d in range(0, days, 3)}
    cold_until = 0.0
    n = 0
    while t < now:
        minute = int(t // 60) * 60
        if any(abs(minute - r) < 60 for r in restarts):
            cold_until = t + 180
        rate = _activity(t) * (1.6 if now - t < 86400 else 1.0)
        t += rng.expovariate(rate / 60.0)
        if t >= now:
            break
        n += 1
        client = rng.choices([c for c, _ in CLIENTS], [w for _, w in CLIENTS])[0]
        prefix = {"opencode": 11800, "aider": 6400, "openai-python": 2100, "curl": 0}[client]
        convo = rng.randint(200, 9000)
        new = rng.randint(60, 1800)
        cold = t < cold_until or rng.random() < 0.06 or client == "curl"
        if cold:
            cache_n = rng.randint(0, 40)
            new += prefix + convo
        else:
            cache_n = prefix + convo
        prompt_ms = new * 0.42 + rng.uniform(5, 30)
        ttfb = prompt_ms + rng.uniform(40, 120)
        status = 200 if rng.random() > 0.004 else 500
        out.append(
            RequestCompleted(
                request_id=f"r{n}",
                client=client,
                session=f"{client}-{int(t // 5400)}",
                endpoint="chat",
                stream=True,
                has_tools=client in ("opencode", "aider"),
                status=status,
                slot=rng.randint(0, 2),
                prompt_n=new,
                cache_n=cache_n,
                prompt_ms=prompt_ms,
                predicted_n=rng.randint(20, 600),
                ttfb_ms=ttfb,
                total_ms=ttfb + rng.uniform(300, 9000),
                kind="agent" if client != "curl" else "aux",
                error="" if status == 200 else "upstream 500",
                ts=t,
            )
        )
    return out


def pressure(now: float, hours: int = 24, every: float = 30.0, seed: int = 3) -> list[Any]:
    rng = random.Random(seed)
    out = []
    t = now - hours * 3600
    ram, swap, vram = 42.0, 3.0, 0.78
    spells = [(now - 17 * 3600, now - 16.2 * 3600), (now - 3.2 * 3600, now - 2.9 * 3600)]
    while t < now:
        pressure_on = any(a <= t < b for a, b in spells)
        target = 9.0 if pressure_on else 38.0 + 6 * math.sin(t / 5000)
        ram += (target - ram) * 0.08 + rng.uniform(-0.8, 0.8)
        swap += ((21.0 if pressure_on else 4.0) - swap) * 0.05 + rng.uniform(-0.2, 0.2)
        vram += ((0.96 if pressure_on else 0.81) - vram) * 0.1 + rng.uniform(-0.004, 0.004)
        level = "critical" if ram < 7 else ("low" if ram < 15 else "nominal")
        total = 24 * GiB
        out.append(
            PressureSample(
                level=level,
                ram_available_pct=max(0.5, ram),
                swap_used_pct=max(0.0, swap),
                server_rss_bytes=int((21.5 + (ram < 15) * 1.5 + rng.uniform(-0.1, 0.1)) * GiB),
                disk_free_pct=41.0,
                gpus=((0, total, int(total * (1 - min(0.99, vram)))),),
                ts=t,
            )
        )
        t += every
    return out


def events(now: float) -> list[Any]:
    fp = ["3f9c0a1d2b4e5f60", "a71e03bc55d2e981", "0c44f1e9d3a8b672", "e5d2a0c9b8f71634"]
    ev: list[Any] = []
    for d in range(30, -1, -3):
        base = now - d * 86400 - 5 * 3600
        run = f"run{d:02d}"
        ev += [
            ServerStateChanged(
                state="starting", previous="stopped", reason="requested by user", ts=base
            ),
            ServerLaunched(
                run_id=run,
                pid=41000 + d,
                port=38411,
                argv=tuple(ARGV),
                binary=BINARY,
                binary_version="b7e41c2",
                model=MODEL,
                ts=base + 1,
            ),
            ServerStateChanged(
                state="ready", previous="starting", reason="healthy on port 38411", ts=base + 19
            ),
            CacheEvent(
                kind="restore_ok",
                reason="restored and verified",
                fingerprint=fp[0],
                slot=0,
                tokens=11800,
                bytes=1_184_000_000,
                ts=base + 23,
            ),
            CacheEvent(
                kind="prewarm_hit",
                reason="after server start",
                fingerprint=fp[1],
                slot=1,
                tokens=6400,
                ts=base + 27,
            ),
        ]
        if d:
            ev.append(
                ServerExited(
                    run_id=run,
                    pid=41000 + d,
                    returncode=0,
                    signal=None,
                    outcome="requested",
                    requested_by="user",
                    ts=base + 3 * 86400 - 60,
                )
            )
    ev += [
        CacheEvent(
            kind="save",
            reason="saved the 11800-token prefix",
            fingerprint=fp[0],
            slot=3,
            tokens=11800,
            bytes=1_184_000_000,
            ts=now - 7200,
        ),
        CacheEvent(
            kind="divergence",
            reason="reused 2113 tokens; expected ≥ 11795 (the stable prefix); diverged at "
            "token 2113 (char 9120): …'</tools>\\n\\n' then 'Today is Mon' → 'Today is Tue'",
            fingerprint=fp[0],
            slot=0,
            tokens=2113,
            details={"client": "opencode"},
            ts=now - 5400,
        ),
        CacheEvent(
            kind="divergence",
            reason="reused 640 tokens; expected ≥ 6395 (the stable prefix); diverged at "
            "token 640 (char 2710): …'files:\\n' then 'src/a.py' → 'src/b.py'",
            fingerprint=fp[1],
            slot=1,
            tokens=640,
            details={"client": "aider"},
            ts=now - 2600,
        ),
        CacheEvent(
            kind="evicted",
            reason="disk cap 8.0 GiB reached; least recently used",
            fingerprint=fp[3],
            tokens=3100,
            bytes=310_000_000,
            details={"rule": "cap"},
            ts=now - 4000,
        ),
        CacheEvent(
            kind="evicted",
            reason="TTL class short (5 min) elapsed",
            fingerprint=fp[2],
            tokens=900,
            bytes=90_000_000,
            details={"rule": "ttl"},
            ts=now - 1800,
        ),
        CacheEvent(
            kind="invalidated",
            reason="saved for a different server identity (chat template, build or flags "
            "changed); it will be rebuilt once",
            fingerprint="9b1d77c0e4a3f215",
            tokens=11790,
            bytes=1_183_000_000,
            ts=now - 86400 * 2,
        ),
        CacheEvent(
            kind="displaced",
            reason="a side call ran in the primary slot (one slot only); the server's RAM "
            "cache brings the prefix back",
            fingerprint=fp[0],
            slot=0,
            ts=now - 900,
        ),
        Notice(
            level="warning",
            text="memory pressure is low: keep-alive paused for non-pinned prefixes",
            ts=now - 3 * 3600,
        ),
    ]
    return ev


def fill(tel: Telemetry, now: float, *, days: int = 30) -> int:
    """Write a month of synthetic history into `tel`; returns the number of requests."""
    reqs = requests(now, days)
    for e in sorted([*reqs, *pressure(now), *events(now)], key=lambda e: e.ts):
        tel.record(e)
    tel.flush()
    return len(reqs)


def status(now: float) -> dict[str, Any]:
    """A `Core.status()`-shaped snapshot (server, cache) matching `fill`."""
    fps = ["3f9c0a1d2b4e5f60", "a71e03bc55d2e981", "0c44f1e9d3a8b672"]
    return {
        "warmslot": {
            "pid": 40210,
            "started": now - 5 * 3600,
            "proxy": "http://127.0.0.1:8089",
            "config": "~/.config/warmslot/warmslot.toml",
        },
        "server": {
            "state": "ready",
            "reason": "healthy on port 38411",
            "pid": 41000,
            "port": 38411,
            "argv": ARGV,
            "run_id": "run00",
            "restarts": 0,
            "no_repack": False,
            "binary": {
                "path": BINARY,
                "source": "build-cache",
                "version": "b7e41c2",
                "commit": "7e4c0a9",
                "identity": "a4ccce00",
            },
            "model": {
                "path": MODEL,
                "source": "configured",
                "size": 18_556_000_000,
                "identity": "x",
            },
            "exits": [
                {
                    "ts": now - 3 * 86400,
                    "outcome": "requested",
                    "returncode": 0,
                    "signal": None,
                    "requested_by": "user",
                    "last_lines": [],
                }
            ],
        },
        "cache": {
            "enabled": True,
            "identity": "3f9c0a1d2b4e5f60",
            "disk_tier": {"usable": True, "reason": "dense model"},
            "aux_slot": 3,
            "slots": [
                {
                    "id": 0,
                    "session": "opencode-ses_8f2a",
                    "prefix": fps[0],
                    "tokens": 23410,
                    "inflight": 1,
                    "kind": "agent",
                    "ttl_class": "long",
                    "expires_in_s": 3480.0,
                },
                {
                    "id": 1,
                    "session": "aider-7c1e",
                    "prefix": fps[1],
                    "tokens": 9120,
                    "inflight": 0,
                    "kind": "agent",
                    "ttl_class": "long",
                    "expires_in_s": 1190.0,
                },
                {
                    "id": 2,
                    "session": "",
                    "prefix": fps[2],
                    "tokens": 2100,
                    "inflight": 0,
                    "kind": "agent",
                },
                {"id": 3, "session": "", "prefix": "", "tokens": 310, "inflight": 0, "kind": "aux"},
            ],
            "prefixes": [
                {
                    "fingerprint": fps[0],
                    "client": "opencode",
                    "tokens": 11800,
                    "source": "profile",
                    "share": 0.82,
                },
                {
                    "fingerprint": fps[1],
                    "client": "aider",
                    "tokens": 6400,
                    "source": "learned",
                    "share": 0.64,
                },
                {
                    "fingerprint": fps[2],
                    "client": "openai-python",
                    "tokens": 2100,
                    "source": "learned",
                    "share": 0.47,
                },
            ],
            "saved": [
                {
                    "file": f"ws-{fps[0]}{'0' * 16}.bin",
                    "fingerprint": fps[0],
                    "tokens": 11800,
                    "bytes": 1_184_000_000,
                    "ttl_class": "extended",
                    "pinned": True,
                    "last_used": now - 120,
                    "verified": "ok",
                    "current": True,
                },
                {
                    "file": f"ws-{fps[1]}{'0' * 16}.bin",
                    "fingerprint": fps[1],
                    "tokens": 6400,
                    "bytes": 642_000_000,
                    "ttl_class": "extended",
                    "pinned": False,
                    "last_used": now - 2600,
                    "verified": "ok",
                    "current": True,
                },
                {
                    "file": f"ws-{fps[2]}{'0' * 16}.bin",
                    "fingerprint": fps[2],
                    "tokens": 2100,
                    "bytes": 211_000_000,
                    "ttl_class": "long",
                    "pinned": False,
                    "last_used": now - 3000,
                    "verified": "reference",
                    "current": True,
                },
                {
                    "file": f"ws-9b1d77c0e4a3f215{'0' * 16}.bin",
                    "fingerprint": "9b1d77c0e4a3f215",
                    "tokens": 11790,
                    "bytes": 1_183_000_000,
                    "ttl_class": "extended",
                    "pinned": False,
                    "last_used": now - 86400 * 2,
                    "verified": "ok",
                    "current": False,
                },
            ],
            "divergences": [],
            "disk": {
                "used_bytes": 3_220_000_000,
                "cap_bytes": 8 * GiB,
                "cap_source": "cache.disk_cap_mb",
            },
            "pressure": {"level": "nominal", "causes": [], "ram_available_pct": 34.0},
            "paused": [],
        },
    }
