"""What patch 0005 (``cancel-check-v1``) changes, on the real server.

A request whose client hangs up must stop at llama-server's next batch. The HTTP thread
of a request checks its client only when its wait for results times out, and on a stock
server every result of any other task — a GET /slots answer, another slot's streamed
token — started that wait again: while something polled the server more than once a
second, an abandoned prompt was read to its end. Here GET /slots is polled every 0.2 s,
as Warmslot's probe and a dashboard do, while a client gives up on a long prompt.

Nothing here assumes a speed: the server runs on two CPU threads (``--device none``, so a
GPU build reads on the CPU too), the prompt is sized from the prefill rate measured first
(long enough that reading it takes several times the one-second check), and the client
leaves once ``GET /slots`` shows its prompt being read, not after a fixed time.

docs/patches.md#0005--an-abandoned-request-is-noticed-while-other-slots-work
"""

from __future__ import annotations

import json
import random
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.server import discover
from tests.helpers import bare_llama_server, metric_values, post_chat, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEVEL = "cancel-check-v1"
SLOT_CTX = 32768  # per slot: -c 65536 -np 2 (Gemma 3 270M's trained context)
N_BATCH = 512  # -b/-ub: a stop between batches comes this many tokens apart at most
POLL_S = 0.2  # how often GET /slots is polled meanwhile (more than once a second)
READ_S = 10.0  # how long the abandoned prompt would take to read at the measured rate
CHECK_S = 1.0  # a patched server checks its client at least this often
PROMPTED = "llamacpp:prompt_tokens_total"


@pytest.fixture(scope="module")
def server(
    server_binary: Path, gemma_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if LEVEL not in discover.patch_levels(server_binary):
        pytest.skip(f"{server_binary} was built without patch 0005")
    args = ["-c", str(2 * SLOT_CTX), "-np", "2", "-t", "2", "--device", "none"]
    args += ["-b", str(N_BATCH), "-ub", str(N_BATCH), "--cache-ram", "0", "--metrics"]
    with bare_llama_server(
        server_binary, gemma_model, tmp_path_factory.mktemp("p0005"), *args
    ) as base:
        yield base


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def _prompted(server: str) -> float:
    text = _get(server + "/metrics").decode()
    return metric_values(text, [PROMPTED])[PROMPTED]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 200_000) for _ in range(n)]


def test_an_abandoned_request_stops_while_the_server_is_polled(server: str) -> None:
    rng = random.Random(3)
    # The prefill rate here, on slot 1: the abandoned prompt is sized from it.
    timed = {"prompt": _prompt(rng, 2 * N_BATCH), "n_predict": 1, "id_slot": 1}
    timings = post_chat(server, timed, path="/completion").json()["timings"]
    rate = float(timings["prompt_per_second"])
    n = min(SLOT_CTX - 64, max(4 * N_BATCH, int(rate * READ_S)))
    if n / rate < 4 * CHECK_S:
        pytest.skip(
            f"{rate:.0f} tokens/s on 2 threads: a whole slot ({n} tokens) is read in "
            f"{n / rate:.1f} s, too soon to tell a {CHECK_S:.0f}-second check from none"
        )
    prompt = _prompt(rng, n)
    before = _prompted(server)

    reading = threading.Event()  # GET /slots shows slot 0 at work on the prompt
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            slots = json.loads(_get(server + "/slots"))
            if any(s["id"] == 0 and s["is_processing"] for s in slots):
                reading.set()
            stop.wait(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        # A client that sends the prompt and hangs up once it is being read (a socket of
        # its own: tests.helpers.post_chat waits for the whole answer).
        url = urllib.parse.urlsplit(server)
        body = json.dumps({"prompt": prompt, "n_predict": 1, "id_slot": 0}).encode()
        head = (
            f"POST /completion HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection((url.hostname, url.port), timeout=60) as client:
            client.sendall(head.encode() + body)
            wait_until(reading.is_set, 60, message="slot 0 never started on the prompt")
        wait_until(
            lambda: not any(s["is_processing"] for s in json.loads(_get(server + "/slots"))),
            60,
            message="slot 0 still processing",
        )
    finally:
        stop.set()
        poller.join(10)
    read = _prompted(server) - before
    print(f"\n{rate:.0f} tokens/s: {read:.0f} of the abandoned {n}-token prompt read")
    # Stopped soon after the client left, not at the prompt's end (a stock server read all
    # of it here): reading the rest would have taken several one-second checks.
    assert read < n
