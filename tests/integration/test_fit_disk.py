"""`warmslot fit`'s disk figures are the sizes of the slot files the server writes.

A slot file holds the full-attention layers' cells of every token, the sliding-window
layers' cells of one sequence's window, and — on a server with Warmslot's checkpoint
patch — every context checkpoint of the slot (docs/llama-server-facts.md
#slot-file-contents). The planner said "2.9 MiB per 1k tokens" for Gemma 3 270M where
agents' files were 89–155 MB for 6.6k–19.7k tokens: it counted neither the window's
batch nor the checkpoints. Here the pinned llama-server saves a slot after each of a
few growing prompts (each request adds two checkpoints), and the plan's breakdown —
per 1k tokens, the window, per checkpoint, as `warmslot fit` prints them — must give
each file's size within 20 %.
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from core.machine.devices import HostInfo
from core.server.fit import FitRequest, plan
from core.server.gguf_facts import read_facts
from core.server.sizing import GIB, Config, saved_state_bytes
from tests.helpers import bare_llama_server

pytestmark = pytest.mark.integration

HOST = HostInfo(64 * GIB, 60 * GIB, 0, 0, 500 * GIB)
TOLERANCE = 0.20


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_fit_gives_the_slot_file_sizes(
    which: str, request: pytest.FixtureRequest, server_binary: Path, tmp_path: Path
) -> None:
    model: Path = request.getfixturevalue(f"{which}_model")
    ctx, sizes = (4096, (1000, 3000)) if which == "tiny" else (16384, (1000, 3000, 6000, 9000))
    facts = read_facts(model)
    p = plan(
        facts,
        [],
        HOST,
        FitRequest(slots=1, ctx_per_slot=ctx, cache_type_k="f16", cache_type_v="f16"),
    )
    b = p.breakdown
    cfg = Config(1, ctx, "f16", "f16", False, 0, p.ctx_checkpoints)
    slots = tmp_path / "slots"
    slots.mkdir()
    rng = random.Random(1)
    ids = [rng.randrange(5, 250) for _ in range(max(sizes))]  # within both vocabularies
    rows = []
    args = ("-np", "1", "-c", str(ctx), "--slot-save-path", str(slots), "-t", "2")
    with bare_llama_server(server_binary, model, tmp_path, *args) as base:
        for n in sizes:  # each prompt extends the last: the slot keeps its checkpoints
            _post(base, "/completion", {"prompt": ids[:n], "n_predict": 1, "id_slot": 0})
            saved = _post(base, "/slots/0?action=save", {"filename": f"s{n}.bin"})
            assert saved["n_saved"] == n
            size = (slots / f"s{n}.bin").stat().st_size
            n_ckpt = int(saved.get("n_checkpoints", 0))
            told = b.disk_per_1k_tokens_bytes * n / 1000 + b.disk_window_bytes * (
                1 if n >= facts.n_swa + 512 else n / (facts.n_swa + 512)
            )
            told += n_ckpt * b.disk_checkpoint_bytes
            exact = saved_state_bytes(facts, cfg, n, n_ckpt, 512)
            rows.append((n, n_ckpt, size, round(told), exact))
    print(f"\n{which}: (tokens, checkpoints, file bytes, fit's figures, saved_state_bytes)")
    for row in rows:
        print("  ", row)
    for n, n_ckpt, size, told, exact in rows:
        assert abs(told - size) <= TOLERANCE * size, (n, n_ckpt, size, told)
        assert abs(exact - size) <= TOLERANCE * size, (n, n_ckpt, size, exact)
    if which == "gemma":  # a sliding-window model on the patched server: checkpoints saved
        assert rows[-1][1] >= 2 and b.disk_checkpoint_bytes > 0
        assert any("refuses to save a prefix alone" in n for n in p.notes), p.notes
