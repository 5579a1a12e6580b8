"""A new agent session on a sliding-window model reuses the whole shared prefix
(docs/cache.md#a-checkpoint-at-the-stable-boundary).

Gemma 3 270M (sliding window, no --swa-full) with the tools template agents use on it, on
a real llama-server through Warmslot: a first session reads its ~1,500-token system text,
then grows by ~900 tokens, far past the window. A second session with the same system
text shares the first one's prompt up to its own user message, but llama-server can go
back only to a context checkpoint, and it had one only near the end of each prompt it
read (it finds no message starts in that template): it went back to the first prompt's
n − 4 − 512 and read ~500 shared tokens again (the opencode replay of
docs/cache.md#a-checkpoint-at-the-stable-boundary: 510 of 7,432). With the stable prefix
read alone first (core.cache.boundary) the server keeps a checkpoint at its end.

Run both ways (`mark` False: `needs_mark` patched out) so the test shows the loss it
guards against on this very server, not a number remembered from elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from httpx import Headers

from core.cache import boundary
from core.cache.manager import policy_factory
from core.engine import Core
from core.events import RequestCompleted
from tests.conftest import MakeCore
from tests.helpers import WORDS, EventLog, cache_manager, metric_values, post_chat, wait_until

pytestmark = pytest.mark.integration

TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "resources/templates/gemma3-tools.jinja"


def _system(n_words: int = 1400) -> str:
    rng = random.Random(11)
    return "You are a coding agent.\n" + " ".join(rng.choice(WORDS) for _ in range(n_words))


def _gemma_core(make_core: MakeCore, gemma_model: Path) -> Core:
    core = make_core(
        policy_factory=policy_factory,
        server__model=str(gemma_model),
        server__slots=2,
        server__ctx_per_slot=8192,
        server__cache_ram_mib=0,  # what comes back comes from the slot, not from RAM
        # The template agents use on Gemma 3 (docs/clients.md). llama-server finds no
        # message starts in it, so it checkpoints only near each prompt's end; with the
        # model's own template it also checkpoints the last user message's start.
        server__chat_template_file=str(TOOLS_TEMPLATE),
    )
    core.start(wait_ready=True, timeout=300)
    assert core.proxy is not None
    return core


def _chat(port: int, messages: list[dict[str, str]], session: str) -> Headers:
    """A two-token greedy turn of `session` (``x-session-affinity``): the answer's headers."""
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "seed": 0}
    return post_chat(port, body, headers={"x-session-affinity": session}).headers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mark", [True, False], ids=["boundary-mark", "without"])
def test_a_second_session_goes_back_to_the_stable_boundary(
    make_core: MakeCore, gemma_model: Path, monkeypatch: pytest.MonkeyPatch, mark: bool
) -> None:
    if not mark:
        monkeypatch.setattr(boundary, "needs_mark", lambda *a, **k: False)
    core = _gemma_core(make_core, gemma_model)
    log = EventLog()
    core.subscribe(log.append, (RequestCompleted,))
    assert core.proxy is not None
    port = core.proxy.port
    system = {"role": "system", "content": _system()}
    first = [system, {"role": "user", "content": "Fix the parser bug."}]
    h1 = _chat(port, first, "s1")
    prefix = int(h1["X-Warmslot-Prefix"].split(":")[1])
    assert prefix >= 1200  # the system text: without a profile marker, the first session's boundary
    # The first request read everything, the split included: none of it is reuse.
    assert h1["X-Warmslot-Cached-Tokens"] == "0"
    rng = random.Random(5)
    tool_output = " ".join(rng.choice(WORDS) for _ in range(900))
    grown = [*first, {"role": "assistant", "content": "Reading it."}]
    grown.append({"role": "user", "content": tool_output})
    h2 = _chat(port, grown, "s1")
    assert h2["X-Warmslot-Slot"] == h1["X-Warmslot-Slot"]
    h3 = _chat(port, [system, {"role": "user", "content": "Write the docs."}], "s2")
    assert h3["X-Warmslot-Slot"] == h1["X-Warmslot-Slot"]  # where its prefix is
    wait_until(lambda: len(log.of(RequestCompleted)) >= 3, 60, message="3 requests recorded")
    cached = int(h3["X-Warmslot-Cached-Tokens"])
    print(f"\nprefix {prefix}, second session cached {cached} (mark={mark})")
    if mark:
        assert cached >= prefix - boundary.CHECKPOINT_TAIL - 1
    else:
        assert cached < prefix - 300  # the loss the mark prevents, on this server


@pytest.mark.timeout(600)
def test_a_client_that_hangs_up_stops_the_prefix_read(
    make_core: MakeCore, gemma_model: Path
) -> None:
    """The prefix read alone runs before the request is forwarded, where the proxy's
    watch of the client's socket does not reach: a client that gave up would leave
    llama-server reading the whole prefix (minutes for a large model on a CPU). The read
    stops with the client, as the request's own prefill does."""
    core = _gemma_core(make_core, gemma_model)
    assert core.proxy is not None and core.supervisor is not None
    sup = core.supervisor
    mgr = cache_manager(core)
    url = f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions"
    messages = [{"role": "system", "content": _system(5000)}, {"role": "user", "content": "Hi"}]

    async def give_up() -> None:  # a client that hangs up mid-request: not post_chat's job
        async with aiohttp.ClientSession() as s:
            with pytest.raises(TimeoutError):
                async with s.post(
                    url,
                    json={"messages": messages, "max_tokens": 2},
                    headers={"x-session-affinity": "s1"},
                    timeout=aiohttp.ClientTimeout(total=1.5),
                ) as r:
                    await r.read()

    asyncio.run(give_up())
    # Warmslot let go of the slot at once (the read holds its lock) …
    wait_until(
        lambda: not core.call(lambda: mgr.ops.lock(0).locked()).result(5),
        5,
        message="the prefix read still holds slot 0",
    )

    def server_slots() -> list[dict[str, object]]:
        req = urllib.request.Request(f"{sup.base_url}/slots", headers=sup.auth_headers())
        with urllib.request.urlopen(req, timeout=10) as resp:
            return list(json.loads(resp.read()))

    # … and llama-server stopped at its next batch, well before the prefix's end.
    wait_until(lambda: not any(s["is_processing"] for s in server_slots()), 30, interval=0.5)
    req = urllib.request.Request(f"{sup.base_url}/metrics", headers=sup.auth_headers())
    with urllib.request.urlopen(req, timeout=10) as resp:
        metrics = metric_values(resp.read().decode(), ["llamacpp:prompt_tokens_total"])
    prefix = sum(len(m["content"].split()) for m in messages)  # ≥ 1 token per word
    assert metrics["llamacpp:prompt_tokens_total"] < prefix
    row = wait_until(
        lambda: next(iter(core.query("recent_requests", limit=1).result(5)), None),
        60,
        message="the request was recorded",
    )
    assert row["status"] == 499
