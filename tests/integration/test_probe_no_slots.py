"""Probe references on a llama-server without ``GET /slots`` (core.cache.probe).

A reference is taken from a probe that ran alone, which the `ProbeGate` reads from
``GET /slots``. A server started with ``--no-slots`` answers that with 501 (save and
restore still work), so whether a probe ran alone cannot be known; the gate then takes
two probes of the same restore that agree bit for bit, and no reference when none agree
(a reference that differs from the next look would reject the correct state forever).
Here on a real server: a good state gives its reference after exactly two probes, and one
whose restores alternate with a corrupted copy gives none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from core.cache.probe import (
    REFERENCE_TRIES,
    ProbeGate,
    ProbeRecord,
    check_answer,
    probe_reference,
    probe_request,
)
from core.chat import JsonObject
from core.errors import UpstreamError
from core.server.client import LlamaClient, Timings
from tests.helpers import WORDS, bare_llama_server
from tests.integration.test_restore_mutations import parse_layout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def no_slots_server(
    server_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    work = tmp_path_factory.mktemp("noslots")
    slots = work / "slots"
    slots.mkdir()
    args = ["-c", "4096", "-np", "2", "-t", "2", "--no-slots"]
    args += ["--slot-save-path", str(slots), "--cache-ram", "0"]
    with bare_llama_server(server_binary, tiny_model, work, *args) as base:
        yield base, slots


def _corrupt(good: Path, bad: Path) -> None:
    """`good` with its first K/V data run zeroed: same tokens, another state."""
    data = bytearray(good.read_bytes())
    start, end = parse_layout(bytes(data)).payload[0]
    data[start:end] = bytes(end - start)
    bad.write_bytes(bytes(data))


async def _check(
    client: LlamaClient, name: str, body: JsonObject, prefix_n: int, reference: ProbeRecord
) -> str | None:
    """Why a probe of the state in `name` fails against `reference`, or None."""
    await client.slot_action(0, "restore", name)
    resp = await client.completion(body)
    t = Timings.parse(resp.get("timings"))
    return check_answer(resp, t.cache_n if t else None, prefix_n, reference)


async def _scenario(base: str, slots: Path) -> None:
    async with aiohttp.ClientSession() as session:
        client = LlamaClient(session, base)
        with pytest.raises(UpstreamError):
            await client.slots()  # the premise: this server has no GET /slots
        text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(300))
        prefix = await client.tokenize(text, add_special=True)
        suffix = await client.tokenize(" and the capital of France is", add_special=False)
        await client.completion({"prompt": prefix, "n_predict": 0, "id_slot": 0})
        await client.slot_action(0, "save", "good.bin")
        _corrupt(slots / "good.bin", slots / "bad.bin")
        body = probe_request(prefix, suffix, 0)
        gate = ProbeGate()

        restores: list[str] = []

        def restore_from(names: list[str]) -> Callable[[], Awaitable[None]]:
            async def restore() -> None:
                name = names[len(restores) % len(names)]
                restores.append(name)
                await client.slot_action(0, "restore", name)

            return restore

        answer, times = await gate.reference(client, body, 0, restore_from(["good.bin"]))
        assert answer is not None and len(times) == 2  # two probes that agreed
        reference = probe_reference(answer)
        # The reference holds: the good state checks against it, the corrupted one does not.
        assert await _check(client, "good.bin", body, len(prefix), reference) is None
        assert await _check(client, "bad.bin", body, len(prefix), reference) is not None
        # Restores that alternate between the two never give two agreeing probes in a row.
        restores.clear()
        answer, times = await gate.reference(client, body, 0, restore_from(["good.bin", "bad.bin"]))
        assert answer is None and len(times) == REFERENCE_TRIES
        assert restores == ["good.bin", "bad.bin", "good.bin"][:REFERENCE_TRIES]


def test_references_without_slots_endpoint_need_two_agreeing_probes(
    no_slots_server: tuple[str, Path],
) -> None:
    base, slots = no_slots_server
    asyncio.run(_scenario(base, slots))
