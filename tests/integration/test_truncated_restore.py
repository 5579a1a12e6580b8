"""A truncated slot file is a 400 that leaves the slot alone, not an abort (docs/patches.md).

llama.cpp's buffered file reader reads short at the end of a file without an error, so a
slot file cut inside its KV state made the server parse bytes it never read and abort on
``GGML_ASSERT(nread <= state_size)``. Warmslot's patch ``0001-safe-slot-api.patch`` (as
``slot-api-v2``) makes it a 400 naming the cause (docs/patches.md).

A real prefix is saved by the real patched llama-server, then restored cut short at
several points (inside the header, the token list, the KV cell metadata, the KV payload,
and one byte before the llama state ends) through ``POST /slots/N?action=restore``: each
must be a 400 that names the truncation, with the server still up (same pid) and the
slot keeping its tokens. Then the saved file itself is cut, its index row rewritten to
match (the case the store's size and hash checks cannot catch), and restored through
Warmslot's own path: it must be rejected (``restore_rejected``, file and row deleted) and
the next request served cold.

``WARMSLOT_PATCHED_SERVER`` names the binary to test (default: the one the session found).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.cache import prefix as pfx
from core.cache.fingerprint import fingerprint
from core.cache.manager import CacheManager, policy_factory
from core.cache.store import StateRecord, file_sha256
from core.engine import Core
from core.errors import UpstreamError, VerificationFailed
from core.events import CacheEvent, CacheEventKind
from core.paths import Paths
from core.server import discover
from tests.conftest import settings_for
from tests.helpers import EventLog, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

_TEXT = " ".join(["the server saved a slot file and the disk filled up before the end"] * 12)
HEADER = 12  # magic, version, token count (u32 each)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Core]:
    configured = os.environ.get("WARMSLOT_PATCHED_SERVER", "")
    settings = settings_for(tiny_model)
    if configured:
        settings.server.binary = configured
    c = Core(
        Paths.under(tmp_path_factory.mktemp("truncated")), settings, policy_factory=policy_factory
    )
    c.start(wait_ready=True, timeout=300)
    try:
        sup = c.supervisor
        assert sup is not None and sup.resolved is not None
        binary = sup.resolved.binary.path
        levels = discover.patch_levels(binary)
        assert "slot-api-v2" in levels, (
            f"{binary} has patch levels {levels}, not slot-api-v2: rebuild the patched server "
            "(`warmslot build`, or the test cache's build)"
        )
        yield c
    finally:
        c.stop()


def _mgr(core: Core) -> CacheManager:
    assert isinstance(core.policy, CacheManager)
    return core.policy


def _run(core: Core, coro: Any) -> Any:
    return core.submit(coro).result(120)


def _server_pid(core: Core) -> int:
    sup = core.supervisor
    assert sup is not None
    pid: int = core.call(lambda: sup.snapshot()["pid"]).result(10)
    return pid


def _slot_tokens(core: Core, slot: int) -> int:
    async def n() -> int:
        client = _mgr(core).state.client
        assert client is not None
        return {s.id: s.n_prompt_tokens for s in await client.slots()}.get(slot, -1)

    out: int = _run(core, n())
    return out


def _saved(core: Core) -> tuple[pfx.PrefixInfo, StateRecord]:
    mgr = _mgr(core)
    wait_until(lambda: mgr.state.identity is not None, 120, message="identity")

    async def go() -> pfx.PrefixInfo:
        client = mgr.state.client
        assert client is not None and mgr.state.identity is not None
        toks = await client.tokenize(_TEXT)
        info = pfx.PrefixInfo(
            key="truncated",
            tokens=toks,
            text="",
            source="test",
            client="test",
            fingerprint=fingerprint(mgr.state.identity, toks),
        )
        mgr.state.by_fp[info.fingerprint] = info
        if mgr.state.store.for_fingerprint(info.fingerprint) is None:
            mgr.ops.persist_soon(info)
        return info

    info: pfx.PrefixInfo = _run(core, go())

    def get() -> StateRecord | None:
        if info.fingerprint in mgr.ops.persisting:
            return None  # a save under way: wait for it
        return mgr.state.store.for_fingerprint(info.fingerprint)

    rec: StateRecord = wait_until(lambda: core.call(get).result(10), 180, message="a save")
    return info, rec


def _answer(core: Core, tokens: list[int], slot: int, *, cache: bool) -> list[int]:
    mgr = _mgr(core)

    async def ask() -> list[int]:
        client = mgr.state.client
        assert client is not None
        async with mgr.ops.lock(slot):
            resp = await client.completion(
                {
                    "prompt": tokens,
                    "n_predict": 6,
                    "temperature": 0.0,
                    "top_k": 1,
                    "samplers": ["top_k"],
                    "id_slot": slot,
                    "cache_prompt": cache,
                    "seed": 0,
                    "return_tokens": True,
                }
            )
        return [int(t) for t in resp.get("tokens") or []]

    out: list[int] = _run(core, ask())
    return out


def test_truncated_slot_files_are_refused_and_leave_the_slot(core: Core) -> None:
    mgr = _mgr(core)
    info, rec = _saved(core)
    good = mgr.state.store.path(rec).read_bytes()
    slot_dir = mgr.state.store.path(rec).parent
    n_tok = len(info.tokens)

    async def action(slot: int, what: str, name: str | None = None) -> dict[str, Any]:
        client = mgr.state.client
        assert client is not None
        async with mgr.ops.lock(slot):
            return await client.slot_action(slot, what, name)

    # Where the llama state ends (our checkpoint section follows it): a good restore says.
    whole = _run(core, action(1, "restore", rec.filename))
    assert whole["n_restored"] == n_tok
    state_end = int(whole["n_read"])
    n_packed = struct.unpack("<I", good[8:12])[0]  # the stored token list (with its header)
    kv_start = HEADER + 4 * n_packed
    assert kv_start + 64 < state_end <= len(good)

    # Slot 1 holds something else (a shorter prompt) that a failed restore must not touch.
    _answer(core, info.tokens[: n_tok // 3], 1, cache=True)
    held = _slot_tokens(core, 1)
    assert held > 0
    pid = _server_pid(core)

    cuts = {
        "inside the header": (6, "not a sequence state file"),
        "inside the token list": (HEADER + 4 * (n_packed // 2), "truncated file: it declares"),
        "inside the KV cell metadata": (kv_start + 6, "bytes needed at offset"),
        "inside the KV payload": ((kv_start + state_end) // 2, "bytes needed at offset"),
        "one byte short of the KV state": (state_end - 1, "bytes needed at offset"),
    }
    results = {}
    for where, (cut, cause) in cuts.items():
        name = "ws-" + hashlib.sha256(where.encode()).hexdigest()[:32] + ".bin"
        path = slot_dir / name
        path.write_bytes(good[:cut])
        try:
            with pytest.raises(UpstreamError) as err:
                _run(core, action(1, "restore", name))
        finally:
            path.unlink()
        message = str(err.value)
        results[where] = (err.value.status, message)
        assert err.value.status == 400, (where, message)
        assert cause in message and "(the slot was not changed)" in message, (where, message)
        # The server is up (the same process) and the slot kept its tokens.
        client = mgr.state.client
        assert client is not None and _run(core, client.health()), where
        assert _server_pid(core) == pid, where
        assert _slot_tokens(core, 1) == held, where
    print("\n" + "\n".join(f"{w}: {s} {m}" for w, (s, m) in results.items()))


def test_a_truncated_file_with_a_matching_row_is_rejected_and_served_cold(core: Core) -> None:
    mgr = _mgr(core)
    events = EventLog()
    core.subscribe(events.append, (CacheEvent,))
    info, rec = _saved(core)
    path = mgr.state.store.path(rec)
    good = path.read_bytes()
    question = info.tokens[:8]
    prompt = [*info.tokens, *question]
    cold = _answer(core, prompt, 0, cache=False)
    pid = _server_pid(core)

    # Cut inside the KV payload, and make the index row match the cut file.
    cut = (HEADER + 4 * struct.unpack("<I", good[8:12])[0] + len(good)) // 2
    path.write_bytes(good[:cut])

    def fix() -> StateRecord | None:
        mgr.state.store.table.update(
            rec.filename, {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        )
        return mgr.state.store.get(rec.filename)

    matching = core.call(fix).result(10)
    assert matching is not None and matching.bytes == cut

    async def restore() -> str:
        async with mgr.ops.lock(0):
            with pytest.raises(VerificationFailed) as err:
                await mgr.ops.restore(matching, 0)
        return str(err.value)

    reason = _run(core, restore())
    assert "server refused the file" in reason and "bytes needed at offset" in reason, reason
    rejected = [
        e
        for e in events.of(CacheEvent)
        if e.kind is CacheEventKind.RESTORE_REJECTED and e.fingerprint == info.fingerprint[:16]
    ]
    assert len(rejected) == 1 and rejected[0].bytes == cut, rejected  # the cut file deleted
    assert _server_pid(core) == pid

    # The manager saves the prefix again in the background: a whole new file, never the cut.
    async def idle() -> bool:
        return mgr.idle() and not mgr.ops.persisting

    wait_until(lambda: _run(core, idle()), 180, message="cache work done")
    again = core.call(lambda: mgr.state.store.get(rec.filename)).result(10)
    if again is not None:
        assert again.bytes == len(good) and file_sha256(path) == again.sha256
    else:
        assert not path.exists()
    # The request is served cold, with the same answer as a cold slot.
    assert _answer(core, prompt, 0, cache=True) == cold
