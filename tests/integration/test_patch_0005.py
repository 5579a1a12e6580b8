"""What patch 0005 (``cancel-check-v1``) changes, on the real server.

A request whose client hangs up must stop at llama-server's next batch. The HTTP thread
of a request checks its client only when its wait for results times out, and on a stock
server every result of any other task — a GET /slots answer, another slot's streamed
token — started that wait again: while something polled the server more than once a
second, an abandoned prompt was read to its end. Here GET /slots is polled every 0.2 s,
as Warmslot's probe and a dashboard do, while a client gives up on a long prompt.

docs/patches.md#0005--an-abandoned-request-is-noticed-while-other-slots-work
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from core.server import discover
from tests.helpers import bare_llama_server, metric_values, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEVEL = "cancel-check-v1"
PROMPT_TOKENS = 6000  # three 2,048-token batches, ~5 s each for Gemma 3 270M on 2 cores


@pytest.fixture(scope="module")
def server(
    server_binary: Path, gemma_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if LEVEL not in discover.patch_levels(server_binary):
        pytest.skip(f"{server_binary} was built without patch 0005")
    args = ["-c", "16384", "-np", "2", "-t", "2", "--cache-ram", "0", "--metrics"]
    with bare_llama_server(
        server_binary, gemma_model, tmp_path_factory.mktemp("p0005"), *args
    ) as base:
        yield base


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def test_an_abandoned_request_stops_while_the_server_is_polled(server: str) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 200_000) for _ in range(PROMPT_TOKENS)]
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            _get(server + "/slots")
            stop.wait(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()

    async def give_up() -> None:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(TimeoutError):
                async with s.post(
                    server + "/completion",
                    json={"prompt": prompt, "n_predict": 1, "id_slot": 0},
                    timeout=aiohttp.ClientTimeout(total=1.5),
                ) as r:
                    await r.read()

    try:
        asyncio.run(give_up())
        wait_until(
            lambda: not any(s["is_processing"] for s in json.loads(_get(server + "/slots"))),
            60,
            message="slot 0 still processing",
        )
    finally:
        stop.set()
        poller.join(10)
    text = _get(server + "/metrics").decode()
    read = metric_values(text, ["llamacpp:prompt_tokens_total"])["llamacpp:prompt_tokens_total"]
    # Stopped at a batch boundary soon after the client left, not at the prompt's end
    # (a stock server read all 6,000 tokens here).
    assert read < PROMPT_TOKENS
