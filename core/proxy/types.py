"""What the proxy and the cache policy hand each other: the request as the policy
sees it (`ProxyRequest`), a model router's answer (`Route`), and the policy's
protocols (`CachePolicy` for the request path, `CacheService` for the core)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from core import chat as apis
from core.chat import ChatView
from core.routing.router import Decision, Kind
from core.server.client import Timings
from core.server.upstream import Upstream
from core.status import CacheStatus, EvictResult, PinResult, RewarmResult

if TYPE_CHECKING:  # stream.py reads the headers, which read these types
    from core.proxy.stream import Heartbeat


@dataclass(frozen=True)
class SlotPlan:
    """What a cache policy decided for one request (`CachePolicy.prepare`): the slot it
    runs in and why, and what the response's ``X-Warmslot-*`` headers say of it
    (`core.proxy.headers.cache_headers`). The proxy keeps it with the request and hands
    it back to `completed` once the response is done, so nothing travels in an untyped
    side channel."""

    slot: int
    why: str  # why this slot, in words
    session: str  # the session the slot is pinned to (the router's key)
    kind: Kind
    prefix_fp: str = ""  # the stable prefix's fingerprint, when one is known
    prefix_tokens: int = 0  # its length in tokens
    restored: int = 0  # tokens restored from disk (and verified) into the slot for it
    warning: str = ""  # what the cache warns the client of (the chat template drops tools …)
    conversation: str = ""  # what became of a saved conversation it continues ("" none)


@dataclass
class ProxyRequest:
    """One client request as the cache policy sees it: what the client sent, the
    router's `Decision`, and what later steps decided (the slot plan, the slot)."""

    request_id: str
    path: str
    endpoint: str
    client: str
    user_agent: str
    session: str  # as the client's header names it ("" when none; see decision.session)
    headers: Mapping[str, str]
    body: dict[str, Any]
    stream: bool
    has_tools: bool
    decision: Decision
    slot: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    plan: SlotPlan | None = None  # the cache manager's, from `prepare`
    model: str = ""  # the model profile that serves it (when a model pool routes)
    upstream: Upstream | None = None
    policy: CachePolicy | None = None
    body_bytes: int = 0  # the size of the body the client sent
    body_digest: str = ""  # its hash (core.server.quarantine.body_digest)
    # The client's own bytes, kept only until the cache policy has prepared the request
    # (failing open parses them again); then dropped, so a large body is not held twice.
    raw_body: bytes | bytearray | None = field(default=None, repr=False)
    # The request as chat completions (`core.chat.ChatView`): what everything that reads
    # messages or tools reads. None for other endpoints, or when the body could not be
    # converted (the cache then leaves the request alone).
    chat: ChatView | None = None
    # Who sent it: the name of its API key ("" when the proxy needs none;
    # docs/security.md#serving-a-team). Never the key itself.
    user: str = ""
    # What the proxy changed in the client's body before anything read it (the names,
    # e.g. core.proxy.billing.BILLING_HEADER_EDIT); sent back in X-Warmslot-Edited, kept in explain.
    edits: tuple[str, ...] = ()
    # The part of its own prompt the cache read into its slot just before it (its stable
    # prefix alone, for a checkpoint there: core.cache.boundary); counted as its prefill.
    split: Timings | None = None
    # The proxy asked for `timings` in every streamed event (for the headers' numbers):
    # they are taken out of the stream again (core.proxy.stream.SSEScanner).
    strip_timings: bool = False
    # Returns once the client has hung up (the proxy's watch of its socket): long work
    # done for the request before it is forwarded stops then.
    gone: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    # A streamed generation's keep-alives while it waits before llama-server's first
    # event (core.proxy.stream.Heartbeat); its response is the stream's once opened.
    heartbeat: Heartbeat | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.chat is None and self.endpoint == "chat":
            self.chat = apis.chat_view("chat", self.body)

    @property
    def kind(self) -> str:
        """The kind's word in telemetry and headers: "agent" or "aux" (a side call)."""
        return self.decision.kind.label


@dataclass
class Route:
    """A router's answer: where a request goes, or the error to give instead."""

    model: str = ""
    upstream: Upstream | None = None
    policy: CachePolicy | None = None
    release: Callable[[], None] | None = None  # call once the response is complete
    load_ms: float | None = None  # how long it waited for its server to come up
    status: int = 200
    error: str = ""
    retry_after: int | None = None


# The admission (`core.models.servers.ServerSet.route`): bring up the decided server,
# count the request in flight.
Admit = Callable[[Decision], Awaitable[Route]]


class CachePolicy(Protocol):
    """What the proxy asks of the prefix-cache manager."""

    async def prepare(self, req: ProxyRequest) -> SlotPlan | None:
        """Pick a slot, make sure it holds the prefix; may edit `req.body`. The plan
        (None: the cache leaves the request alone) comes back to `completed`."""

    async def completed(self, req: ProxyRequest, timings: Timings | None, status: int) -> None:
        """Learn from a finished request (runs after the response is complete)."""


class CacheService(CachePolicy, Protocol):
    """What the core asks of the prefix-cache manager besides the proxy's two calls:
    its status, the user's commands on saved states, and a clean shutdown."""

    async def status(self) -> CacheStatus:
        """The cache inventory and its background work."""

    async def pin(self, filename: str, pinned: bool = True) -> PinResult:
        """Pin (never expires, never swept, kept warm) or unpin a saved state."""

    async def evict(self, filename: str) -> EvictResult:
        """Delete a saved state now (only files Warmslot wrote)."""

    async def rewarm(self, fingerprint: str) -> RewarmResult:
        """Bring a prefix back into its slot (re-warm, or restore into a free slot)."""

    async def close(self) -> None:
        """At shutdown, the server still running: save what must be saved, then stop."""
