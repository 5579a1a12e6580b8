"""Fakes for the background-core tests: a Core stand-in and a tiny llama-server model.

`FakeCore` has what `CacheManager` needs (settings, paths, an in-memory
telemetry, emit/subscribe, a supervisor whose slot directory names the server
identity) and a `FakeClock`. `FakeLlama` models the part of llama-server the
keep-alive and persist paths use: per-slot token contents, longest-common-prefix
reuse (one token always re-evaluated), `/slots`, save/restore/erase of files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from core.cache import prefix as pfx
from core.cache.deps import CacheDeps, DiskTier, deps_from
from core.cache.fingerprint import ServerIdentity, fingerprint, state_filename
from core.cache.index import CacheIndex
from core.cache.manager import CacheManager
from core.cache.store import StateRecord
from core.clock import FakeClock
from core.config import Settings
from core.errors import UpstreamError
from core.events import CacheEvent, Event
from core.machine.pressure import PressureMonitor
from core.machine.sweeps import Sweeps
from core.paths import Paths
from core.server.client import SlotInfo
from core.telemetry import Telemetry
from core.telemetry.rates import PrefillRates

IDENT = "0123456789abcdef"  # the running server's slot directory (launch id)
OTHER = "fedcba9876543210"  # another server identity
SERVER = ServerIdentity(model="m", binary="b", kv_flags=("-np", "2"), chat_template="t")
MB = 1 << 20


class FakeCore:
    def __init__(self, home: Path, settings: Settings | None = None) -> None:
        self.settings = settings if settings is not None else Settings()
        self.paths = Paths.under(home)
        self.paths.ensure()
        self.clock = FakeClock()
        self.telemetry: Telemetry | None = Telemetry(":memory:", clock=self.clock.time)
        self.cache_index: CacheIndex | None = CacheIndex.memory()
        self.events: list[Event] = []
        self.supervisor = SimpleNamespace(
            resolved=SimpleNamespace(slot_dir=self.paths.slot_dir / IDENT),
            base_url=None,
            pid=None,
            run_id="run",
        )
        self.upstream = None  # FakeManager's client is a FakeLlama, not HTTP
        # The engine's: one pressure monitor (no sampler: tests feed it readings) and
        # one scheduler.
        self.pressure = PressureMonitor(
            lambda: self.settings.pressure,
            None,
            self.emit,
            self.clock,
            telemetry=lambda: self.telemetry,
        )
        self.sweeps = Sweeps(self.clock, self.emit)
        self.prefill_rates = PrefillRates()  # the engine's one prefill-rate estimator

    def subscribe(self, callback: Any, types: Any = None) -> Any:
        return lambda: None

    def cache_managers(self) -> list[Any]:
        return []

    def emit(self, event: Event) -> None:
        self.events.append(event)
        if self.telemetry is not None:
            self.telemetry.record(event)

    def cache_events(self, kind: str | None = None) -> list[CacheEvent]:
        return [
            e for e in self.events if isinstance(e, CacheEvent) and (kind is None or e.kind == kind)
        ]


@dataclass
class FakeLlama:
    """Slots as token lists; completion reuses the longest common prefix."""

    slot_dir: Path
    n_slots: int = 2
    base_url: str = "http://fake"
    contents: dict[int, list[int]] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    fail_save: bool = False
    # Write slot files as llama-server does (sequence-state header and its packed token
    # list, core.cache.conversation_pick.read_tokens); off: the bare token list.
    llama_format: bool = False

    def held(self, slot: int) -> list[int]:
        return self.contents.setdefault(slot, [])

    async def slots(self) -> list[SlotInfo]:
        self.calls.append(("slots", None))
        return [SlotInfo(i, 4096, False, len(self.held(i))) for i in range(self.n_slots)]

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("completion", body.get("id_slot")))
        slot = int(body["id_slot"]) % self.n_slots
        prompt = [int(t) for t in body["prompt"]]
        cached = self.held(slot)
        lcp = pfx.common_prefix_len(cached, prompt)
        cache_n = min(lcp, len(prompt) - 1)  # the last token is always re-evaluated
        n_predict = int(body.get("n_predict", 0))
        self.contents[slot] = prompt + list(range(max(0, n_predict - 1)))
        # The probe's reference and check compare these top-k lists (core/cache/probe.py).
        top = [{"id": 7, "logprob": -1.0}, {"id": 8, "logprob": -3.0}]
        probs = [{"id": 7, "logprob": -1.0, "top_logprobs": top} for _ in range(max(1, n_predict))]
        return {
            "timings": {
                "cache_n": cache_n,
                "prompt_n": len(prompt) - cache_n,
                "prompt_ms": 0.5 * (len(prompt) - cache_n),
                "predicted_n": max(1, n_predict),
                "predicted_ms": 1.0,
            },
            "completion_probabilities": probs,
            "tokens_cached": len(self.contents[slot]),
        }

    async def slot_action(
        self, slot: int, action: str, filename: str | None = None
    ) -> dict[str, Any]:
        self.calls.append((action, slot))
        if action == "save":
            assert filename is not None
            path = self.slot_dir / filename
            path.parent.mkdir(parents=True, exist_ok=True)
            data = b"".join(t.to_bytes(4, "little") for t in self.held(slot))
            if self.llama_format:
                n = len(self.held(slot))
                words = [-1, 1, n, *self.held(slot), 0]
                data = struct.pack(f"<III{len(words)}i", 0x67677371, 4, len(words), *words)
            if self.fail_save:  # the server dies half-way through writing
                path.write_bytes(data[: len(data) // 2])
                raise UpstreamError("POST /slots/0?action=save failed: connection reset")
            path.write_bytes(data)
            return {"n_saved": len(self.held(slot)), "timings": {"save_ms": 1.0}}
        if action == "restore":
            assert filename is not None
            data = (self.slot_dir / filename).read_bytes()
            if self.llama_format:
                data = data[12 + 12 : -4]  # the tokens of the packed list
            tokens = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
            self.contents[slot] = tokens
            return {"n_restored": len(tokens), "timings": {"restore_ms": 1.0}}
        self.contents[slot] = []
        return {"n_erased": 1}


class _FakeUpstream:
    """Stands for the HTTP session to llama-server: its client is a `FakeLlama` (or None)."""

    def __init__(self) -> None:
        self.fake: FakeLlama | None = None

    def client(self) -> Any:
        return self.fake

    def served_model(self) -> str:
        return ""


class FakeManager(CacheManager):
    """A CacheManager whose llama-server client is a `FakeLlama` (or None)."""

    def __init__(self, deps: CacheDeps) -> None:
        self._fake_upstream = _FakeUpstream()
        super().__init__(dataclasses.replace(deps, upstream=self._fake_upstream))  # type: ignore[arg-type]

    @property
    def fake(self) -> FakeLlama | None:
        return self._fake_upstream.fake

    @fake.setter
    def fake(self, fake: FakeLlama | None) -> None:
        self._fake_upstream.fake = fake


def make_manager(
    home: Path, settings: Settings | None = None, *, server: bool = True, slots: int = 2
) -> tuple[FakeCore, FakeManager]:
    core = FakeCore(home, settings)
    core.settings.server.slots = slots
    mgr = FakeManager(deps_from(core))  # type: ignore[arg-type]
    mgr.retention._default_cap = 1 << 40
    if server:
        mgr.fake = FakeLlama(core.paths.slot_dir / IDENT, n_slots=slots)
        mgr.state.identity = SERVER
        mgr.state.disk = DiskTier(True, "dense model")
        mgr.state.probe_suffix = [900, 901, 902]
    return core, mgr


def prefix(tokens: list[int], client: str = "opencode") -> pfx.PrefixInfo:
    return pfx.PrefixInfo(
        key=f"k{len(tokens)}-{tokens[:1]}",
        tokens=tokens,
        text="",
        source="profile:opencode",
        client=client,
        fingerprint=fingerprint(SERVER, tokens),
    )


def add_state(
    core: FakeCore,
    mgr: CacheManager,
    *,
    name_seed: str,
    size: int = MB,
    age: float = 0.0,
    ttl_class: str = "extended",
    pinned: bool = False,
    identity: str = IDENT,
    kind: str = "prefix",
    fp: str | None = None,
    write_file: bool = True,
) -> StateRecord:
    """Index a state file of `size` bytes last used `age` seconds ago (and write it)."""
    fp = fp or hashlib.sha256(name_seed.encode()).hexdigest()
    name = state_filename(fp)
    path = core.paths.slot_dir / identity / name
    if write_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
    now = core.clock.time()
    rec = StateRecord(
        filename=name,
        identity=identity,
        fingerprint=fp,
        client="opencode",
        source="profile:opencode",
        prefix_n=10,
        n_tokens=10,
        bytes=size,
        sha256="0" * 64,
        ttl_class=ttl_class,
        pinned=pinned,
        created=now - age,
        last_used=now - age,
        verified_at=None,
        verify_result="reference",
        probe={},
        kind=kind,
    )
    mgr.state.store.add(rec)
    return rec
