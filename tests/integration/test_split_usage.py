"""A first turn whose stable prefix the cache read alone first reports that read as
prefill in what the client reads, as the headers do.

On a model that rewinds only to a checkpoint the cache manager sends a first turn's
stable prefix alone, then the request (core.cache.boundary); llama-server reports the
prefix as cached for the request. Claude Code showed cache reads of 17,038 of 19,585
tokens (and a lower cost) for a cold turn whose headers said ``miss``. Here every number
in the answer — ``timings``, each API's ``usage``, in a whole body and in every stream
event — must equal the headers' ``X-Warmslot-Cached-Tokens`` and
``X-Warmslot-Prefilled-Tokens``.

The tiny model is dense, so its disk tier is made to rewind (what it is for a
sliding-window model): the split then runs on a real llama-server, as on Gemma 3, in a
fraction of the time.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from core.cache import boundary, warmup
from core.cache.manager import policy_factory
from core.chat import ROUTES
from core.proxy.headers import reuse_from
from tests.conftest import MakeCore
from tests.helpers import WORDS, post_chat

pytestmark = pytest.mark.integration

PATHS = {endpoint: path for path, (endpoint, _) in ROUTES.items() if path.startswith("/v1/")}


def _system(seed: int) -> str:
    rng = random.Random(seed)
    return "You are a coding agent.\n" + " ".join(rng.choice(WORDS) for _ in range(250))


def _body(endpoint: str, k: int, stream: bool) -> dict[str, Any]:
    # Another conversation each time (its own system text and question): the slot's
    # last request is no part of it, so its prefix is read alone first.
    system, user = _system(k), f"Fix parser bug {k}."
    common: dict[str, Any] = {"max_tokens": 2, "temperature": 0, "stream": stream}
    if endpoint == "chat":
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        return {"messages": messages, **common, **extra}
    if endpoint == "messages":
        return {"system": system, "messages": [{"role": "user", "content": user}], **common}
    common["max_output_tokens"] = common.pop("max_tokens")
    return {"instructions": system, "input": user, **common}


def _numbered(text: str, stream: bool) -> list[dict[str, Any]]:
    """The answer's objects: the body, or each stream event's data."""
    if not stream:
        return [json.loads(text)]
    events = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
    return events


@pytest.mark.timeout(300)
def test_a_split_first_turn_reports_its_prefix_as_prefill(
    make_core: MakeCore, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = warmup.disk_tier

    def rewinding(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(tier(*args, **kwargs), rewinds=True)

    monkeypatch.setattr(warmup, "disk_tier", rewinding)
    marks: list[bool] = []
    needs_mark = boundary.needs_mark

    def noted(*args: Any, **kwargs: Any) -> bool:
        marks.append(needs_mark(*args, **kwargs))
        return marks[-1]

    monkeypatch.setattr(boundary, "needs_mark", noted)
    core = make_core(policy_factory=policy_factory, server__cache_ram_mib=0)
    core.start(wait_ready=True, timeout=120)
    seen: dict[str, tuple[int, int, int]] = {}
    for k, (endpoint, stream) in enumerate(
        (e, s) for e in ("chat", "messages", "responses") for s in (False, True)
    ):
        case = f"{endpoint}{' streamed' if stream else ''}"
        marks.clear()
        r = post_chat(
            core,
            _body(endpoint, k, stream),
            path=PATHS[endpoint],
            # A client of its own each: its first request learns its stable prefix.
            headers={"x-session-affinity": f"s{k}", "user-agent": f"agent{k}/1.0"},
        )
        assert marks == [True], f"{case}: the prefix was not read alone first"
        cached = int(r.headers["X-Warmslot-Cached-Tokens"])
        prefilled = int(r.headers["X-Warmslot-Prefilled-Tokens"])
        prefix = int(r.headers["X-Warmslot-Prefix"].split(":")[1])
        # A cold turn: at most the template's opening and the system text's first line
        # were in the slot (the last request's), never the prefix it read just before.
        assert cached < 64, case
        assert cached + prefilled > prefix > 0, case
        numbers = [n for obj in _numbered(r.text, stream) if (n := reuse_from(obj))]
        assert numbers, f"{case}: no usage or timings in the answer"
        for n in numbers:
            assert (n.cached, n.prefilled) == (cached, prefilled), f"{case}: {n}"
        seen[case] = (prefix, prefilled, len(numbers))
    print("\n(prefix, prefilled, objects with numbers):", seen)
