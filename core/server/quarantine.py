"""Request bodies that crashed llama-server, refused for a while instead of forwarded.

A request that crashes llama-server (a grammar of 20,000 nested parentheses makes it
die of SIGSEGV: docs/llama-server-facts.md#a-request-that-crashes-the-server) crashes it
again each time it is sent, and a client that retries on errors sends it again at once:
six of them in 21 s used to exhaust the supervisor's restarts and leave every client
with 503s. So the proxy tells the server's `CrashQuarantine` which bodies it has in
flight (`begin` / `end`, by the hash of the client's bytes), the supervisor tells it
when the server crashed or was found stuck (`crashed`), and from then on the same body
is answered with a 422 for `window_s` (`refusal`) while every other request is served
(docs/security.md#requests-that-crash-the-server).

Which body did it: one that was alone in flight is quarantined at once. Of several in
flight together each gets a strike, and a body with `STRIKES` of them is quarantined —
an innocent request that happened to run beside the crashing one is not refused for it
unless it was there again at the next crash.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["WINDOW_S", "CrashQuarantine", "Quarantined", "body_digest"]

# How long a body that crashed the server is refused.
WINDOW_S = 600.0
# Strikes (crashes while in flight beside others) that quarantine a body.
STRIKES = 2
# A request whose connection broke this shortly before the supervisor saw the crash
# still counts as in flight: the proxy often hears of the death first.
GRACE_S = 10.0
# Bodies remembered at most (quarantined ones and strikes): a flood of distinct
# crashing bodies cannot grow the memory.
MAX_BODIES = 1000


def body_digest(raw: bytes | bytearray) -> str:
    """The hash that names a request body: SHA-256 of the client's bytes."""
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class Quarantined:
    """A body that was in flight when the server crashed: refused until `until`."""

    digest: str
    what: str  # how the server died: "signal SIGSEGV", "no progress for 120 s" …
    at: float  # clock time of the crash
    until: float

    def text(self) -> str:
        """What the user is told about it."""
        return (
            f"llama-server died ({self.what}) while answering a request; the same request "
            f"(body sha256 {self.digest[:16]}…) is refused for "
            f"{(self.until - self.at) / 60:.0f} min"
        )


@dataclass
class _InFlight:
    digest: str
    failed_at: float | None = None  # when its exchange broke; None while it runs


@dataclass
class CrashQuarantine:
    """Bodies in flight on one llama-server, and those refused after it crashed."""

    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _inflight: dict[int, _InFlight] = field(default_factory=dict)
    _strikes: dict[str, tuple[int, float]] = field(default_factory=dict)  # count, last at
    _refused: dict[str, Quarantined] = field(default_factory=dict)
    _tokens: itertools.count[int] = field(default_factory=itertools.count)

    def begin(self, digest: str) -> int:
        """Note a body forwarded to the server; returns the token for `end`."""
        token = next(self._tokens)
        self._inflight[token] = _InFlight(digest)
        return token

    def end(self, token: int, *, failed: bool) -> None:
        """Its exchange is over. A `failed` one (the server's connection broke, no
        answer) stays a suspect for `GRACE_S`, until the supervisor says why."""
        entry = self._inflight.get(token)
        if entry is None:
            return
        if failed:
            entry.failed_at = self.clock()
        else:
            del self._inflight[token]
        self._forget_old_failures()

    def crashed(self, what: str) -> list[Quarantined]:
        """The server died (or was killed as stuck): quarantine what was in flight, as
        the module docstring says. Returns the bodies quarantined now."""
        now = self.clock()
        self._forget_old_failures()
        suspects = sorted({e.digest for e in self._inflight.values()})
        self._inflight.clear()  # the run they were sent to is gone
        found: list[Quarantined] = []
        for digest in suspects:
            count, last = self._strikes.pop(digest, (0, now))
            strikes = (count if now - last < self.window_s else 0) + 1
            if len(suspects) == 1 or strikes >= STRIKES:
                hit = Quarantined(digest, what, now, now + self.window_s)
                self._refused[digest] = hit
                found.append(hit)
            else:
                self._strikes[digest] = (strikes, now)
        self._bound()
        return found

    def excused(self) -> None:
        """The server died of something outside the requests (an RPC worker was lost):
        what was in flight is not to blame, and the run it was sent to is gone."""
        self._inflight.clear()

    def refusal(self, digest: str) -> Quarantined | None:
        """The quarantine entry for this body while it holds, else None."""
        hit = self._refused.get(digest)
        if hit is not None and hit.until <= self.clock():
            del self._refused[digest]
            self._strikes.pop(digest, None)
            return None
        return hit

    @property
    def refused(self) -> int:
        """Bodies refused right now."""
        now = self.clock()
        return sum(1 for q in self._refused.values() if q.until > now)

    def _forget_old_failures(self) -> None:
        cutoff = self.clock() - GRACE_S
        for token in [
            t for t, e in self._inflight.items() if e.failed_at is not None and e.failed_at < cutoff
        ]:
            del self._inflight[token]

    def _bound(self) -> None:
        now = self.clock()
        for digest in [d for d, q in self._refused.items() if q.until <= now]:
            del self._refused[digest]
        while len(self._refused) > MAX_BODIES:  # the oldest go first (insertion order)
            del self._refused[next(iter(self._refused))]
        while len(self._strikes) > MAX_BODIES:
            del self._strikes[next(iter(self._strikes))]
