"""What the cache manager decided for one request: the `SlotPlan`.

`CacheManager.prepare` returns it; the proxy keeps it with the request and hands
it back to `completed` once the response is done, so nothing travels in an
untyped side channel.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.cache.prefix import PrefixInfo
from core.router import Kind

__all__ = ["SlotPlan"]


@dataclass(frozen=True)
class SlotPlan:
    """The slot a request runs in, and what the cache knows of it."""

    slot: int
    why: str  # why this slot, in words
    session: str  # the session the slot is pinned to (the router's key)
    kind: Kind
    prefix: PrefixInfo | None = None  # the stable prefix, when one is known

    @property
    def prefix_fp(self) -> str:
        return self.prefix.fingerprint if self.prefix is not None else ""
