"""What the requests around a killed backend get (docs/scale.md#when-a-backend-fails).

Starts a Core with two backends ('main' and a launched 'b1') on a small model, puts a
session on each, then SIGKILLs b1's llama-server while a long generation runs on it and
sends that session's next turn at once. Prints each request's status and backend, and
when Warmslot saw the exit (its ServerStateChanged for b1).

    .venv/bin/python scripts/measure_backend_kill.py --binary PATH/llama-server \\
        --model ~/.cache/warmslot-tests/tiny.gguf [--home /tmp/kill-home]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from core.cache.manager import policy_factory
from core.config import BackendSettings, Settings
from core.engine import Core
from core.events import Event, ServerStateChanged
from core.paths import Paths

Result = tuple[int, str | None, float, str]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--home", default="")
    args = ap.parse_args()
    s = Settings()
    s.proxy.port = 0
    s.server.binary, s.server.model, s.server.build = args.binary, args.model, "off"
    s.server.slots, s.server.ctx_per_slot, s.server.threads = 3, 4096, 2
    s.backends = [BackendSettings(name="b1")]
    home = Path(args.home or tempfile.mkdtemp(prefix="warmslot-kill-"))
    core = Core(Paths.under(home), s, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=300)
    try:
        run(core)
    finally:
        core.stop()


def run(core: Core) -> None:
    assert core.proxy is not None
    port = core.proxy.port

    def rows() -> dict[str, Any]:
        st = core.server_status().result(30)
        backends = st.get("backends")
        assert backends is not None
        return {r["name"]: r for r in backends["backends"]}

    def post(session: str, project: str, n: int = 4) -> Result:
        body = {
            "messages": [
                {"role": "system", "content": f"project {project} " * 50},
                {"role": "user", "content": "go"},
            ],
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "x-session-id": session},
        )
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
                return r.status, r.headers.get("X-Warmslot-Backend"), time.monotonic() - t0, ""
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")[:90]
            return e.code, e.headers.get("X-Warmslot-Backend"), time.monotonic() - t0, text

    ready = threading.Event()
    while not all(r["ready"] for r in rows().values()):
        ready.wait(0.2)
    print("first turns:", post("s-a", "A")[:2], post("s-b", "B")[:2])
    seen: list[tuple[float, str, str]] = []

    def on_state(e: Event) -> None:
        if isinstance(e, ServerStateChanged) and e.model == "backend b1":
            seen.append((time.monotonic(), e.state, e.previous))

    core.subscribe(on_state, (ServerStateChanged,))
    out: dict[str, Result] = {}
    long = threading.Thread(target=lambda: out.update(r=post("s-b", "B", 3000)))
    long.start()
    ready.wait(2.0)
    print("b1 requests in flight before the kill:", rows()["b1"]["inflight"])
    os.kill(rows()["b1"]["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    at_once = post("s-b", "B")
    long.join()
    print("in flight at the kill:", out["r"])
    print("sent at once after the kill:", at_once)
    changes = [(round(t - t_kill, 3), a, b) for t, a, b in seen]
    print("b1 state changes (s after the kill):", changes)
    print("then, s-b again:", post("s-b", "B")[:3], "a new session:", post("s-c", "B")[:3])


if __name__ == "__main__":
    main()
