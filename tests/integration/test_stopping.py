"""Stopping in stages, as a client sees it: a request under way when the stop begins is
finished, one that comes during the stop is answered 503 with Retry-After in its API's
own error shape (the socket stays open until llama-server is stopped), and a new
`warmslot serve` waits for a Warmslot that is still stopping instead of failing on its
port. Real llama-server, real tiny model.

The request "under way" is held by its client (`HeldRequest`: headers sent, the body only
once the stop is seen to have begun), so the test needs no timing assumptions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import config
from core.cache.manager import policy_factory
from core.local_api import running_instance
from core.paths import Paths
from tests.conftest import MakeCore
from tests.helpers import HeldRequest, chat_body, free_port, wait_until

pytestmark = pytest.mark.integration

WARMSLOT = Path(sys.executable).parent / "warmslot"


def stopping(paths: Paths) -> bool:
    inst = running_instance(paths)
    return inst is not None and inst.stopping


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def messages_body(text: str) -> dict[str, Any]:
    return {
        "model": "warmslot-test",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
    }


def test_a_request_during_the_stop_gets_503_and_one_under_way_is_finished(
    make_core: MakeCore,
) -> None:
    core = make_core(policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None
    port = core.proxy.port
    base = f"http://127.0.0.1:{port}"
    # A session the cache saves at the stop (the save stage has work to do).
    warm = httpx.post(
        f"{base}/v1/chat/completions",
        json=chat_body("a session that is saved when Warmslot stops", max_tokens=2),
        headers={"x-session-id": "stopping-1"},
        timeout=60,
    )
    assert warm.status_code == 200
    held = HeldRequest(port, "/v1/chat/completions", chat_body("under way at the stop"))
    assert held.continued

    stopper = threading.Thread(target=core.stop, name="stopper")
    stopper.start()
    wait_until(lambda: stopping(core.paths), 30, message="the runtime file never said stopping")

    late = httpx.post(f"{base}/v1/chat/completions", json=chat_body("too late"), timeout=30)
    assert late.status_code == 503
    assert late.headers["Retry-After"] == "5"
    err = late.json()["error"]
    assert (err["type"], err["code"]) == ("unavailable_error", 503)
    assert "shutting down" in err["message"]
    anthropic = httpx.post(f"{base}/v1/messages", json=messages_body("too late"), timeout=30)
    assert anthropic.status_code == 503 and anthropic.headers["Retry-After"] == "5"
    body = anthropic.json()
    assert (body["type"], body["error"]["type"]) == ("error", "overloaded_error")
    health = httpx.get(f"{base}/health", timeout=30)
    assert health.status_code == 503 and "Retry-After" in health.headers
    assert stopper.is_alive()  # the stop waits for the request under way

    status, _headers, answer = held.finish()
    assert status == 200, answer[:500]
    assert json.loads(answer)["choices"][0]["message"]["role"] == "assistant"
    stopper.join(120)
    assert not stopper.is_alive()
    assert not core.paths.runtime_file.exists()
    with pytest.raises(httpx.ConnectError):  # closed once llama-server was stopped
        httpx.get(f"{base}/health", timeout=5)


@pytest.fixture
def tiny_home(tmp_path: Path, tiny_model: Path) -> Path:
    home = tmp_path / "home"
    path = home / "config" / "warmslot.toml"
    for key, value in (
        ("server.model", str(tiny_model)),
        ("server.threads", 2),
        ("server.ctx_per_slot", 4096),
        ("server.cache_ram_mib", 256),
    ):
        config.set_value(path, key, value)
    return home


@pytest.fixture
def serves(tiny_home: Path, tmp_path: Path) -> Iterator[Any]:
    """``serves(name)`` → a `warmslot serve --port P` (all on one port, one home)."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []

    def start(name: str) -> tuple[subprocess.Popen[str], Path]:
        err = tmp_path / f"{name}.stderr"
        with err.open("w") as errf:
            proc = subprocess.Popen(
                [str(WARMSLOT), "serve", "--port", str(port)],
                env={**os.environ, "WARMSLOT_HOME": str(tiny_home)},
                stdout=subprocess.DEVNULL,
                stderr=errf,
                text=True,
            )
        procs.append(proc)
        return proc, err

    start.port = port  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_waits_for_a_warmslot_that_is_still_stopping(serves: Any, tiny_home: Path) -> None:
    paths = Paths.under(tiny_home)
    port = serves.port
    first, first_err = serves("first")
    wait_until(
        lambda: healthy(port),
        120,
        interval=0.3,
        message=lambda: first_err.read_text()[-2000:],
    )
    held = HeldRequest(port, "/v1/chat/completions", chat_body("under way while serve restarts"))
    assert held.continued
    first.send_signal(signal.SIGINT)
    wait_until(lambda: stopping(paths), 30, message=lambda: first_err.read_text()[-2000:])

    second, second_err = serves("second")
    wait_until(
        lambda: "is still stopping" in second_err.read_text(),
        60,
        interval=0.1,
        message=lambda: second_err.read_text()[-2000:],
    )
    assert second.poll() is None  # waiting, not failed on the port the first still holds
    status, _headers, answer = held.finish()
    assert status == 200, answer[:500]
    assert first.wait(120) == 0
    inst = wait_until(
        lambda: (i := running_instance(paths)) is not None and i.pid == second.pid and i,
        120,
        interval=0.1,
        message=lambda: second_err.read_text()[-2000:],
    )
    assert inst.state == "running" and inst.port == port
    ok = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body("after"), timeout=120
    )
    assert ok.status_code == 200
    second.send_signal(signal.SIGINT)
    assert second.wait(120) == 0
    assert f"pid {first.pid}) is still stopping" in second_err.read_text()
