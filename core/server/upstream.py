"""One llama-server as an HTTP peer: where it listens now, and the one session to it.

The engine makes one `Upstream` per supervised llama-server (the model pool one
per pooled model) and injects it into everything that talks to that server: the
proxy's forwarding and the cache manager's `LlamaClient`. So each server has one
connection pool, created once and closed once at shutdown by whoever made it,
and tests can hand the proxy or the cache manager an upstream that points at a
fake server.

The address is read through a callable on every use: a supervised server gets a
new port on each (re)start, while the session (not bound to any address) lives
as long as the engine. So is the server's API key: each launch gets a new one
(`core.server.supervisor`), and a client middleware puts the current one on every
request sent over the session — the proxy's forwarding and `LlamaClient` alike — so
no caller needs to know it (docs/security.md#llama-servers-port).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import aiohttp
from aiohttp import ClientHandlerType, ClientRequest, ClientResponse

from core.server.client import AttemptRequest, LlamaClient
from core.server.quarantine import CrashQuarantine

__all__ = ["KEEPALIVE_S", "Upstream"]

# Seconds an idle pooled connection is kept: under llama-server's own keep-alive timeout
# of 5 s (docs/llama-server-facts.md#keep-alive), with room for a busy loop.
KEEPALIVE_S = 2.0


class Upstream:
    """The current address of one llama-server and the aiohttp session to it.

    Callers pass their own timeout with each request (the proxy waits for long
    generations, Warmslot's own calls have theirs); the session sets none.
    """

    def __init__(
        self,
        base_url: Callable[[], str | None],
        *,
        name: str = "",
        api_key: Callable[[], str | None] | None = None,
        quarantine: Callable[[], CrashQuarantine | None] | None = None,
        served: Callable[[], str] | None = None,
    ) -> None:
        self._base_url = base_url
        self._api_key = api_key  # the running server's key, read on every request
        self._quarantine = quarantine
        self._served = served
        self._n_vocab: tuple[str, int | None] | None = None  # (base URL, its vocabulary size)
        self.name = name  # the model profile's name; "" for the primary server
        self._session: aiohttp.ClientSession | None = None
        self._client: LlamaClient | None = None
        self._closed = False
        # Every request sent over the session, by path: the proxy's forwards and
        # Warmslot's own calls alike (what a request costs the server, docs/benchmarks.md).
        self.calls: Counter[str] = Counter()

    @property
    def base_url(self) -> str | None:
        """``http://host:port`` of the server while it runs, else None."""
        return self._base_url()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session to this server, created on first use (on the running loop)."""
        if self._closed:
            raise RuntimeError(f"upstream {self.name or 'primary'} is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # No limit on connections: each streamed request holds one for its
                # whole generation, and the server's slot count is the real bound.
                # Idle ones are dropped well before llama-server closes them itself
                # (docs/llama-server-facts.md#keep-alive), so a pooled connection is
                # never one the server is closing just as a request goes out on it.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                middlewares=(self._count, self._authorize),
                # Which try of a request went out on a pooled connection, and whether
                # any of it was sent: what `core.server.client.send` resends on.
                request_class=AttemptRequest,
            )
        return self._session

    async def _count(self, req: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        self.calls[req.url.path] += 1
        return await handler(req)

    async def _authorize(self, req: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        """Send the server's current key with every request (set, never added: a header a
        caller copied from its own client must not reach the server)."""
        key = self._api_key() if self._api_key is not None else None
        if key:
            req.headers["Authorization"] = f"Bearer {key}"
            req.headers.popall("X-Api-Key", None)
        return await handler(req)

    def served_model(self) -> str:
        """The model this server runs, by file name ("" when Warmslot does not run it, or
        before it started): what a request's accounting and prefill rate are kept under."""
        return self._served() if self._served is not None else ""

    def quarantine(self) -> CrashQuarantine | None:
        """The supervising server's record of request bodies in flight and of those that
        crashed it (`core.server.quarantine`); None for a server Warmslot does not run."""
        return self._quarantine() if self._quarantine is not None else None

    async def n_vocab(self) -> int | None:
        """The running model's vocabulary size (``meta.n_vocab`` of ``GET /v1/models``),
        asked once per server address; None when the server does not say."""
        base = self.base_url
        if base is None:
            return None
        if self._n_vocab is not None and self._n_vocab[0] == base:
            return self._n_vocab[1]
        found: int | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=10)
            async with self.session.get(f"{base}/v1/models", timeout=timeout) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
            models = data.get("data") if isinstance(data, dict) else None
            meta = models[0].get("meta") if isinstance(models, list) and models else None
            value = meta.get("n_vocab") if isinstance(meta, dict) else None
            found = value if isinstance(value, int) and value > 0 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None  # not remembered: asked again next time
        self._n_vocab = (base, found)
        return found

    def client(self) -> LlamaClient | None:
        """A `LlamaClient` for the server's current address; None while it is not running."""
        base = self.base_url
        if base is None or self._closed:
            return None
        if self._client is None or self._client.base_url != base.rstrip("/"):
            self._client = LlamaClient(self.session, base)
        return self._client

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Close the session (idempotent); later use raises."""
        self._closed = True
        self._client = None
        if self._session is not None:
            await self._session.close()
            self._session = None
