"""The llama-server `warmslot bench restore` launched, spoken to directly with the
launch's key (the proxy adds nothing here): slot actions, completions, and prompts of
code-like text at an exact token count."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from core.bench.common import post_json
from core.chat import JsonObject
from core.server.client import CompletionAnswer, SlotActionAnswer

__all__ = ["REQUEST_TIMEOUT_S", "Server", "prompt_tokens"]

REQUEST_TIMEOUT_S = 3600.0  # longest one request to llama-server may take
_VOCAB = (
    "def class return import self None True False value cache slot token server model "
    "request prompt window layer memory thread buffer stream result status kernel process "
    "network record table paper letter city market garden winter summer number simple "
    "careful report the a of to in and for with on is this that from by"
)
_WORDS = _VOCAB.split()


class Server:
    """The launched llama-server, spoken to directly (the proxy adds nothing here)."""

    def __init__(self, base: str, auth: dict[str, str], slot_dir: Path) -> None:
        self.base = base
        self.auth = auth
        self.slot_dir = slot_dir

    def post(self, path: str, body: Mapping[str, object]) -> tuple[JsonObject, float]:
        """POST and return (answer, wall ms)."""
        t0 = time.perf_counter()
        # A cold 32k-token prefill of Gemma 3 took 164–440 s on the 2-core machine, and
        # over 900 s while other jobs loaded it: a bench waits rather than fails.
        data = post_json(self.base + path, body, self.auth, timeout=REQUEST_TIMEOUT_S)
        return data, (time.perf_counter() - t0) * 1000

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        data, _ = self.post("/tokenize", {"content": text, "add_special": add_special})
        return [int(t) for t in cast("list[int]", data["tokens"])]

    def slot(self, action: str, filename: str | None = None) -> tuple[SlotActionAnswer, float]:
        """A slot action on slot 0: (the server's answer, wall ms)."""
        body = {"filename": filename} if filename else {}
        data, ms = self.post(f"/slots/0?action={action}", body)
        # The server's JSON as sent, read as core.server.client reads it.
        return cast(SlotActionAnswer, data), ms

    def completion(self, body: Mapping[str, object]) -> tuple[CompletionAnswer, float]:
        """`POST /completion`: (the server's answer, wall ms)."""
        data, ms = self.post("/completion", body)
        return cast(CompletionAnswer, data), ms  # as sent, read as the client reads it

    def complete(self, tokens: list[int], n_predict: int) -> tuple[CompletionAnswer, float]:
        """A greedy completion of `tokens` in slot 0, its cache reused."""
        return self.completion(
            {
                "prompt": tokens,
                "n_predict": n_predict,
                "temperature": 0.0,
                "top_k": 1,
                "samplers": ["top_k"],
                "id_slot": 0,
                "cache_prompt": True,
                "seed": 0,
            },
        )


def prompt_tokens(server: Server, n: int, seed: int) -> list[int]:
    """`n` tokens of code-like text (its own words per seed, so no two sizes share a
    prefix the server could reuse), tokenized by the model, beginning with its BOS."""
    rng = random.Random(seed)
    words = max(64, n)
    while True:
        lines = []
        for i in range(words // 8):
            body = " ".join(rng.choice(_WORDS) for _ in range(7))
            lines.append(f"{i:05d} {body} = {rng.randrange(10**6)}")
        toks = server.tokenize("\n".join(lines), add_special=True)
        if len(toks) >= n:
            return toks[:n]
        words *= 2
