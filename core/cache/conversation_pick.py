"""Which saved conversation a request gets (`choose`), and what a conversation state
file holds (`read_tokens`): the pure part of `core.cache.conversations`, no I/O but
reading a file's head.

A saved state counts for the tokens it shares with the request's prompt beyond what
its stable prefix gives anyway, and only when restoring and verifying it (priced from
this machine's measured costs, core.cache.costs) costs less than prefilling those
tokens (docs/cache.md#conversations).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.cache import prefix as pfx
from core.cache.costs import Estimate
from core.cache.store import StateRecord

SEQ_MAGIC = 0x67677371  # "ggsq": llama.cpp's sequence state file (llama_state_seq_save_file)
MIN_GAIN_TOKENS = 64  # a conversation state must give this many tokens beyond the prefix


def read_tokens(path: Path) -> list[int]:
    """The slot's tokens from the head of a llama.cpp sequence state file (magic, version,
    count, token words): what the slot held when it was saved.

    The server writes its token list packed (`server_tokens::serialize`): a -1 marker, a
    format version, the u32-counted tokens, then u32-counted media keys; older servers
    wrote the plain list. Media (multimodal) states are refused: their tokens are not
    all text.
    """
    with path.open("rb") as f:
        head = f.read(12)
        if len(head) < 12:
            raise ValueError("state file shorter than its header")
        magic, _version, n = struct.unpack("<III", head)
        if magic != SEQ_MAGIC:
            raise ValueError(f"not a sequence state file (magic {magic:#x})")
        data = f.read(4 * n)
    if len(data) != 4 * n:
        raise ValueError("state file shorter than its token list")
    words = list(struct.unpack(f"<{n}i", data))
    if not words or words[0] != -1:
        return words  # a plain token list
    if n < 4 or words[2] != n - 4 or words[n - 1] != 0:
        raise ValueError("packed token list with media or of an unknown layout")
    return words[3 : n - 1]


@dataclass(frozen=True)
class Choice:
    """The saved conversation to restore for a request, and why."""

    rec: StateRecord
    match: int  # tokens of the request the state covers
    by: str  # "session" (same session id) or "tokens" (another session's, same tokens)
    estimate: Estimate  # its predicted cost against the prefill it saves


@dataclass(frozen=True)
class Skip:
    """A saved conversation that would cover the request but costs more to restore than
    the prefill it saves."""

    rec: StateRecord
    estimate: Estimate

    @property
    def reason(self) -> str:
        """The ``prewarm_skipped`` event's reason."""
        return (
            f"{self.rec.n_tokens}-token conversation {self.rec.filename} not restored: "
            f"{self.estimate.words()}"
        )

    @property
    def header(self) -> str:
        """``X-Warmslot-Conversation`` for the request it was skipped for."""
        e = self.estimate
        return (
            f"not restored: restoring the saved {self.rec.n_tokens}-token conversation "
            f"(~{e.cost_ms:.0f} ms) would take longer than prefilling the {e.gain} "
            f"tokens it covers (~{e.prefill_ms:.0f} ms)"
        )


Price = Callable[[StateRecord, int], Estimate]  # a state and the tokens it would save


def choose(
    candidates: Sequence[StateRecord],
    prompt: Sequence[int],
    session: str,
    base_n: int,
    price: Price,
) -> tuple[Choice | None, Skip | None]:
    """The state covering most of `prompt`, or None and the state skipped as too slow to
    restore (None: nothing fits).

    A state counts for the tokens it shares with the prompt; it must give at least
    `MIN_GAIN_TOKENS` more than `base_n` (what the stable prefix gives anyway). The
    longest match wins; on a tie the same session's, then the newest. A state whose
    restore `price` predicts (core.cache.costs: this machine's measured costs) to cost
    more than the prefill of the tokens it saves is skipped — a too-large state never
    holds up a request longer than prefilling would.
    """
    best: Choice | None = None
    skipped: Skip | None = None
    for rec in candidates:
        tokens = rec.probe.get("prefix")
        if not isinstance(tokens, list):
            continue
        match = pfx.common_prefix_len(tokens, prompt)
        gain = match - base_n
        if gain < MIN_GAIN_TOKENS:
            continue
        estimate = price(rec, gain)
        if not estimate.pays:
            skipped = Skip(rec, estimate)
            continue
        by = "session" if rec.session == session else "tokens"
        c = Choice(rec, match, by, estimate)
        if best is None or (match, by == "session", rec.created) > (
            best.match,
            best.by == "session",
            best.rec.created,
        ):
            best = c
    return best, (None if best is not None else skipped)
