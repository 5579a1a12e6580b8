"""Small helpers the benchmark commands share."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Mapping

from core.chat import JsonObject
from core.engine import Core


def post_json(
    url: str,
    body: Mapping[str, object],
    headers: dict[str, str] | None = None,
    timeout: float = 900,
) -> JsonObject:
    """POST a JSON body and return the JSON answer (urllib: no event loop needed)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data: JsonObject = json.loads(resp.read())  # an object: every route we call sends one
        return data


def settle(core: Core, timeout: float = 600) -> None:
    """Wait until Warmslot's background cache work (warm-up, saves, restores) is done,
    for every loaded model, and no model is loading. Checked on the core thread."""

    async def idle() -> bool:
        pool = core.pool
        if pool is not None:
            managers = [e.manager for e in pool.entries.values() if e.manager is not None]
            return all(m.idle() for m in managers) and not pool.loading
        check = getattr(core.policy, "idle", None)
        return check is None or bool(check())

    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not core.submit(idle()).result(30):
        if time.monotonic() > deadline:
            raise TimeoutError("background cache work did not finish")
        tick.wait(0.05)
