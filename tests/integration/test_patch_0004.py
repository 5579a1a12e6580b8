"""What patch 0004 (``api-parity-v1``, ``prefix-save-v1``) changes, on the real server.

* ``/v1/messages`` honours ``id_slot``: stock llama-server drops it in its Anthropic →
  chat conversion and picks a slot itself (upstream PR #26758).
* ``timings`` in the non-streamed Anthropic and Responses answers and in the Anthropic
  stream's ``message_delta`` event.
* ``POST /slots/N?action=save`` with ``"n_tokens": N`` writes only the first N tokens' cells:
  restored into another slot, a request that shares only those N tokens reuses all of them
  and answers exactly as a cold server does; bad counts are 400s, a sliding-window model
  without ``--swa-full`` is a 501 (its early cells are gone).

docs/patches.md#0004--one-slot-api-for-every-route-and-prefix-saves
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.server import discover
from tests.helpers import free_port, post_chat, raw_server_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEVELS = ("api-parity-v1", "prefix-save-v1")
_TEXT = "the tool reads a file and writes the answer to the user in a short reply"
_WORDS = _TEXT.split()


@dataclass
class Server:
    base: str
    slots: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Status and JSON (or the text of an answer that is not an object)."""
        r = post_chat(self.base, body, path=path, timeout=120, expect=None)
        return r.status_code, r.json() if r.text.lstrip().startswith("{") else r.text

    def ok(self, path: str, body: dict[str, Any]) -> Any:
        status, data = self.post(path, body)
        assert status == 200, (status, data)
        return data


def _start(binary: Path, model: Path, workdir: Path, *extra: str) -> Server:
    slots = workdir / "slots"
    slots.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "server.log"
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    args += ["-c", "4096", "-np", "2", "-t", "2", "--slot-save-path", str(slots)]
    # No RAM prompt cache: a request must find its tokens in the slot it names or nowhere.
    args += ["--cache-ram", "0", "--jinja", *raw_server_args(), *extra]
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", slots, proc, log)

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(server.base + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    wait_until(healthy, 120, interval=0.1, message=lambda: log.read_text()[-2000:])
    return server


@pytest.fixture(scope="module")
def patched(server_binary: Path) -> Path:
    levels = discover.patch_levels(server_binary)
    if not all(level in levels for level in LEVELS):
        pytest.skip(f"{server_binary} was built without patch 0004 (it lists {levels})")
    return server_binary


@pytest.fixture(scope="module")
def server(
    patched: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    s = _start(patched, tiny_model, tmp_path_factory.mktemp("p0004"))
    try:
        yield s
    finally:
        s.proc.terminate()
        s.proc.wait(30)


def _text(n: int, salt: str) -> str:
    return salt + " " + " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(n))


def _messages(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "system": "You are a careful assistant.",
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


def test_messages_route_honours_id_slot_and_reports_timings(server: Server) -> None:
    text = _text(300, "pinning")
    first = server.ok("/v1/messages", _messages(text, id_slot=0))
    assert first["timings"]["prompt_n"] > 200, first  # timings on the non-streamed answer
    # The same prompt on the other slot: nothing there to reuse. Stock llama-server ignores
    # id_slot here and picks slot 0 by prompt similarity, reusing nearly everything.
    other = server.ok("/v1/messages", _messages(text, id_slot=1))
    assert other["timings"]["cache_n"] == 0, other["timings"]
    again = server.ok("/v1/messages", _messages(text, id_slot=1))
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 2, again["timings"]
    assert again["usage"]["cache_read_input_tokens"] == again["timings"]["cache_n"]


def test_anthropic_stream_and_responses_carry_timings(server: Server) -> None:
    req = urllib.request.Request(
        server.base + "/v1/messages",
        data=json.dumps(_messages(_text(40, "stream"), stream=True, id_slot=0)).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [
            json.loads(line[6:])
            for line in r.read().decode().splitlines()
            if line.startswith("data: {")
        ]
    delta = [e for e in events if e.get("type") == "message_delta"]
    assert len(delta) == 1 and delta[0]["timings"]["prompt_n"] > 0, events[-3:]

    resp = server.ok(
        "/v1/responses",
        {"model": "tiny", "input": _text(40, "responses"), "max_output_tokens": 2, "id_slot": 1},
    )
    assert resp["object"] == "response"
    assert resp["timings"]["prompt_n"] > 0, resp


def _tokens(server: Server, text: str) -> list[int]:
    return list(server.ok("/tokenize", {"content": text})["tokens"])


def _complete(server: Server, tokens: list[int], slot: int, *, cache: bool = True) -> Any:
    body = {
        "prompt": tokens,
        "n_predict": 8,
        "temperature": 0,
        "id_slot": slot,
        "cache_prompt": cache,
        "return_tokens": True,
    }
    return server.ok("/completion", body)


def test_prefix_save_writes_only_the_first_tokens_and_restores_exactly(server: Server) -> None:
    prefix = _tokens(server, _text(200, "stable head"))
    tail_a = _tokens(server, _text(120, " conversation one"))[1:]
    tail_b = _tokens(server, _text(90, " another question"))[1:]
    _complete(server, prefix + tail_a, 0)  # slot 0 holds the prefix and a conversation

    full = server.ok("/slots/0?action=save", {"filename": "full.bin"})
    part = server.ok("/slots/0?action=save", {"filename": "prefix.bin", "n_tokens": len(prefix)})
    assert part["n_saved"] == len(prefix) and full["n_saved"] > len(prefix) + 100, (part, full)
    size_full = (server.slots / "full.bin").stat().st_size
    size_part = (server.slots / "prefix.bin").stat().st_size
    # The KV payload scales with the cells written: ~len(prefix)/n_saved of the full file.
    assert size_part < size_full * (len(prefix) + 20) / full["n_saved"], (size_part, size_full)

    restored = server.ok("/slots/1?action=restore", {"filename": "prefix.bin"})
    assert restored["n_restored"] == len(prefix)
    warm = _complete(server, prefix + tail_b, 1)
    assert warm["timings"]["cache_n"] == len(prefix), warm["timings"]

    server.ok("/slots/0?action=erase", {})
    cold = _complete(server, prefix + tail_b, 0, cache=False)
    assert cold["timings"]["cache_n"] == 0
    assert warm["content"] == cold["content"] and warm["tokens"] == cold["tokens"]


def test_prefix_save_rejects_bad_counts(server: Server) -> None:
    tokens = _tokens(server, _text(60, "counts"))
    _complete(server, tokens, 1)
    held = len(tokens)  # the slot holds at least these
    for bad in (0, -5, 10**6):
        status, data = server.post("/slots/1?action=save", {"filename": "x.bin", "n_tokens": bad})
        assert status == 400, (bad, status, data)
        assert "n_tokens" in json.dumps(data), data
    status, data = server.post("/slots/1?action=save", {"filename": "x.bin", "n_tokens": "12"})
    assert status == 400 and "integer" in json.dumps(data), data
    assert not (server.slots / "x.bin").exists()
    whole = server.ok("/slots/1?action=save", {"filename": "x.bin", "n_tokens": -1})
    assert whole["n_saved"] >= held


def test_prefix_save_refused_for_a_sliding_window_model(
    patched: Path, gemma_model: Path, tmp_path: Path
) -> None:
    s = _start(patched, gemma_model, tmp_path)
    try:
        tokens = list(s.ok("/tokenize", {"content": _text(700, "window")})["tokens"])
        _complete(s, tokens, 0)
        status, data = s.post("/slots/0?action=save", {"filename": "p.bin", "n_tokens": 100})
        assert status == 501, (status, data)
        assert "sliding-window" in data["error"]["message"], data
        assert not (s.slots / "p.bin").exists()
    finally:
        s.proc.terminate()
        s.proc.wait(30)
