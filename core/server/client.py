"""A typed client for llama-server's HTTP API (the calls Warmslot makes itself).

Client requests from agents do not go through here: the proxy streams those
byte for byte. This is for health, props, slots, metrics, tokenizing,
rendering templates, prewarm completions and slot save/restore/erase.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from aiohttp.connector import Connection

from core.errors import UpstreamError

log = logging.getLogger("warmslot.server")

# llama-server's own rules for slot file names, checked before we send one, so a bad
# name is our bug and never reaches the server (docs/llama-server-facts.md#slot-file-names).
_BAD_NAME = re.compile(r'[/\\:*?"<>|\x00-\x1f\x7f-\x9f\ufffd\ufeff\uff0e\u2215\u2216]')


def valid_slot_filename(name: str) -> bool:
    """True if llama-server accepts `name` as a slot file name."""
    return (
        0 < len(name.encode("utf-8")) <= 255
        and not _BAD_NAME.search(name)
        and name == name.strip(" ")
        and not name.endswith(".")
        and ".." not in name
        and name != "."
    )


# Methods that may go again even once sent: sending them twice does what once does
# (RFC 9110, section 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
# Resends of one request at most: each meets another pooled connection (a dead one is
# dropped from the pool) or, once the pool is empty, a new connection.
RESENDS = 3


@dataclass
class Attempt:
    """One try of a request, as its session's `AttemptRequest` saw it."""

    reused: bool = False  # it went out on a pooled keep-alive connection
    written: bool = False  # its body was handed to the connection


class RequestLost(aiohttp.ClientConnectionError):
    """The connection failed after the request had gone out and before any answer:
    llama-server may have run it, so it is not sent again."""


# The try `send` is making, for `AttemptRequest` (which runs in that task, and its body
# writer in a task that inherits the context).
_ATTEMPT: ContextVar[Attempt | None] = ContextVar("warmslot_attempt", default=None)
# The connections (their protocols) that have carried a request: seeing one again is a
# reuse from the pool.
_CARRIED: weakref.WeakSet[object] = weakref.WeakSet()


def current_attempt() -> Attempt | None:
    """The try `send` is making in this task, None outside one."""
    return _ATTEMPT.get()


class AttemptRequest(aiohttp.ClientRequest):
    """The request class of a session to llama-server (``request_class``): it notes on
    the `Attempt` `send` is making whether its connection came from the pool, and when
    its body starts to go out. A class rather than trace hooks, which cost about a
    tenth of a millisecond per request.

    The body is written by `write_bytes`, and aiohttp holds a request's headers back to
    send them with its first body bytes; so before `write_bytes` runs nothing of a POST
    has left. (Its headers alone could not have run anything either: llama-server reads
    the whole body before it starts.)
    """

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        proto = conn.protocol
        if proto is not None:
            if (attempt := current_attempt()) is not None:
                attempt.reused = proto in _CARRIED
            _CARRIED.add(proto)
        return await super().send(conn)

    async def write_bytes(
        self, writer: AbstractStreamWriter, conn: Connection, *args: Any, **kwargs: Any
    ) -> None:
        if (attempt := current_attempt()) is not None:
            attempt.written = True
        await super().write_bytes(writer, conn, *args, **kwargs)


async def send(
    session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> aiohttp.ClientResponse:
    """``session.request(method, url, **kwargs)``, sent again only when it provably did
    not run: it failed on a pooled connection (one llama-server had just closed) before
    any of its body went out, or it is a GET. A request that went out and then lost its
    connection before an answer raises `RequestLost`: it may have run, and a POST sent
    twice is a generation run twice. Other failures raise as aiohttp raised them.

    The session must make its requests with `AttemptRequest`; on one that does not, no
    request is ever sent twice. Pooled connections are kept for a shorter time than
    llama-server keeps idle ones open (`core.server.upstream`), so a pooled connection
    the server has closed is rare: llama-server closes one only on its own errors, on
    its 100th request, or after a stream.
    """
    idempotent = method.upper() in _IDEMPOTENT
    # Without a body, a request's headers go out at once, with no hook to tell.
    bodyless = kwargs.get("data") is None and kwargs.get("json") is None
    for tries_left in range(RESENDS, -1, -1):
        attempt = Attempt(written=bodyless)
        token = _ATTEMPT.set(attempt)
        try:
            return await session.request(method, url, **kwargs)
        except aiohttp.ClientConnectionError as e:
            if isinstance(e, TimeoutError):
                raise
            if attempt.written and not idempotent:
                raise RequestLost(
                    f"llama-server closed the connection before it answered ({e!r}); the "
                    "request had gone out, so it was not sent again: it may have run"
                ) from e
            if not attempt.reused or not tries_left:
                raise  # a new connection that failed: the server's trouble, not the pool's
            log.debug("a pooled connection to llama-server was closed (%r); resending", e)
        finally:
            _ATTEMPT.reset(token)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Timings:
    """The `timings` object of a completion response (docs/llama-server-facts.md#timings)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float

    @classmethod
    def parse(cls, data: object) -> Timings | None:
        """The timings in `data` (a response's ``timings`` value, any JSON), or None when
        it is not an object with ``prompt_n``."""
        if not isinstance(data, dict) or "prompt_n" not in data:
            return None
        return cls(
            cache_n=int(data.get("cache_n", 0)),
            prompt_n=int(data.get("prompt_n", 0)),
            prompt_ms=float(data.get("prompt_ms", 0.0)),
            predicted_n=int(data.get("predicted_n", 0)),
            predicted_ms=float(data.get("predicted_ms", 0.0)),
        )

    def with_split(self, before: Timings | None) -> Timings:
        """These timings counting `before` — a part of the same prompt read into the same
        slot by a request just before this one (core.cache.boundary) — as read by this
        request: its prefill is not reuse."""
        if before is None:
            return self
        moved = min(before.prompt_n, self.cache_n)
        return Timings(
            cache_n=self.cache_n - moved,
            prompt_n=self.prompt_n + moved,
            prompt_ms=round(self.prompt_ms + before.prompt_ms, 3),
            predicted_n=self.predicted_n,
            predicted_ms=self.predicted_ms,
        )


class CompletionTimings(TypedDict, total=False):
    """A `/completion` answer's ``timings`` (docs/llama-server-facts.md#timings), the
    fields Warmslot reads; `Timings.parse` reads them checked."""

    cache_n: int  # prompt tokens reused from the slot's cache
    prompt_n: int  # prompt tokens evaluated
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


class TopLogprob(TypedDict, total=False):
    """One of a step's ``top_logprobs`` (with ``n_probs``)."""

    id: int
    token: str
    logprob: float | None  # null: a non-finite log-prob (a broken state)


class CompletionProbability(TypedDict, total=False):
    """One generated token of ``completion_probabilities`` (with ``n_probs``)."""

    id: int
    token: str
    logprob: float | None  # null: non-finite
    top_logprobs: list[TopLogprob]


class CompletionAnswer(TypedDict, total=False):
    """llama-server's non-streamed `/completion` answer, the fields Warmslot reads (a
    request's ``response_fields`` may leave any of them out, so all are optional; the
    values are its JSON as sent)."""

    content: str
    tokens_cached: int
    timings: CompletionTimings
    completion_probabilities: list[CompletionProbability]


class SlotTimings(TypedDict, total=False):
    """A slot save's or restore's ``timings``."""

    save_ms: float
    restore_ms: float


class SlotActionAnswer(TypedDict, total=False):
    """llama-server's answer to `POST /slots/{id}?action=...`: a save's ``n_saved`` and
    ``n_written``, a restore's ``n_restored`` and ``n_read``, an erase's ``n_erased``."""

    id_slot: int
    filename: str
    n_saved: int  # tokens saved
    n_written: int  # bytes written
    n_restored: int  # tokens restored
    n_read: int  # bytes read
    n_erased: int  # tokens erased
    timings: SlotTimings


class GenerationSettings(TypedDict):
    """The part of ``GET /props`` → ``default_generation_settings`` Warmslot reads."""

    n_ctx: NotRequired[int]  # tokens one slot holds


class Props(TypedDict):
    """The fields of llama-server's ``GET /props`` that Warmslot reads (the server sends
    more; the values are its JSON as sent, so readers still check their types)."""

    chat_template: NotRequired[str]
    total_slots: NotRequired[int]
    default_generation_settings: NotRequired[GenerationSettings]
    warmslot_patches: NotRequired[list[str]]  # a patched build's patch levels (docs/patches.md)


@dataclass(frozen=True)
class SlotInfo:
    id: int
    n_ctx: int
    is_processing: bool
    n_prompt_tokens: int  # tokens currently cached in the slot
    id_task: int = -1  # the slot's current or last task (-1: none yet); a new task changes it
    # The running task's counters (0 again once it ended): prompt tokens read so far and
    # tokens generated; the prompt's moves once per batch
    # (docs/llama-server-facts.md#slots-endpoint).
    n_prompt_tokens_processed: int = 0
    n_decoded: int = 0

    @property
    def progress(self) -> tuple[int, int, int, int]:
        """What changes while the slot's task gets anywhere (core.server.watchdog)."""
        return (self.id_task, self.n_prompt_tokens, self.n_prompt_tokens_processed, self.n_decoded)


def _decoded(slot: dict[str, Any]) -> int:
    """``next_token[0].n_decoded`` of a `/slots` entry (0 when it is not there)."""
    nxt = slot.get("next_token")
    first = nxt[0] if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict) else {}
    return int(first.get("n_decoded", 0))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text (llama-server's `/metrics`) as ``{name: value}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


class LlamaClient:
    """Calls to one llama-server at `base_url`, over that server's one aiohttp session
    (`core.server.upstream.Upstream` makes it and closes it)."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, timeout: float = 600.0
    ) -> None:
        self._session = session
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def _call(
        self, method: str, path: str, body: Any = None, *, expect_json: bool = True
    ) -> Any:
        url = self.base_url + path
        try:
            # Sent again only when it provably did not run (`send`).
            resp = await send(self._session, method, url, json=body, timeout=self._timeout)
            async with resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise UpstreamError(f"{method} {path} failed: {e!r}") from e
        if resp.status >= 400:
            raise UpstreamError(
                f"{method} {path} → {resp.status}: {_message(text)}",
                status=resp.status,
                body=text,
            )
        return json.loads(text) if expect_json else text

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
        except UpstreamError:
            return False
        return True

    async def props(self) -> Props:
        """`GET /props`."""
        result: Props = await self._call("GET", "/props")
        return result

    async def slots(self) -> list[SlotInfo]:
        """`GET /slots`.

        Note: it wakes a sleeping server (docs/llama-server-facts.md#slots-endpoint).
        """
        data = await self._call("GET", "/slots")
        return [
            SlotInfo(
                id=int(s["id"]),
                n_ctx=int(s.get("n_ctx", 0)),
                is_processing=bool(s.get("is_processing")),
                n_prompt_tokens=int(s.get("n_prompt_tokens", 0)),
                id_task=int(s.get("id_task", -1)),
                n_prompt_tokens_processed=int(s.get("n_prompt_tokens_processed", 0)),
                n_decoded=_decoded(s),
            )
            for s in data
        ]

    async def metrics(self) -> dict[str, float]:
        """`GET /metrics` parsed into ``{name: value}`` (needs ``--metrics``)."""
        return parse_metrics(await self._call("GET", "/metrics", expect_json=False))

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        data = await self._call(
            "POST",
            "/tokenize",
            {"content": content, "add_special": add_special, "parse_special": parse_special},
        )
        return [int(t) for t in data["tokens"]]

    async def tokenize_pieces(
        self, content: str, *, add_special: bool = False
    ) -> list[tuple[int, bytes]]:
        """Tokens with the bytes each one stands for (``with_pieces``): a piece that is
        not whole UTF-8 comes back from llama-server as a list of byte values."""
        data = await self._call(
            "POST",
            "/tokenize",
            {"content": content, "add_special": add_special, "with_pieces": True},
        )
        out: list[tuple[int, bytes]] = []
        for t in data["tokens"]:
            piece = t["piece"]
            raw = piece.encode("utf-8") if isinstance(piece, str) else bytes(piece)
            out.append((int(t["id"]), raw))
        return out

    async def detokenize(self, tokens: list[int]) -> str:
        data = await self._call("POST", "/detokenize", {"tokens": tokens})
        return str(data["content"])

    async def apply_template(self, body: Mapping[str, object]) -> str:
        """Render a chat request exactly as the server would (`/apply-template`)."""
        data = await self._call("POST", "/apply-template", body)
        return str(data["prompt"])

    async def completion(self, body: Mapping[str, object]) -> CompletionAnswer:
        """`POST /completion` (non-streamed): the server's answer as sent."""
        result: CompletionAnswer = await self._call("POST", "/completion", body)
        return result

    async def slot_action(
        self, slot: int, action: str, filename: str | None = None, *, n_tokens: int | None = None
    ) -> dict[str, Any]:
        """`POST /slots/{id}?action=save|restore|erase`.

        Slot ids are checked here: the server wraps out-of-range ids modulo the
        slot count (docs/llama-server-facts.md#slot-ids-wrap), and file names are
        checked against its rules. `n_tokens` (a save only, Warmslot's patch 0004,
        "prefix-save-v1") saves just the first N tokens the slot holds.
        """
        if slot < 0:
            raise ValueError(f"slot id {slot} out of range")
        if action not in ("save", "restore", "erase"):
            raise ValueError(f"unknown slot action {action!r}")
        body: dict[str, str | int] = {}
        if filename is not None:
            if not valid_slot_filename(filename):
                raise ValueError(f"invalid slot file name {filename!r}")
            body["filename"] = filename
        if n_tokens is not None:
            if action != "save" or n_tokens < 1:
                raise ValueError(f"n_tokens {n_tokens} is for a save of at least 1 token")
            body["n_tokens"] = n_tokens
        result: dict[str, Any] = await self._call("POST", f"/slots/{slot}?action={action}", body)
        return result


def _message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", text[:200]))
    return text[:200]
