"""The router: the one place that classifies a request.

From what the proxy parsed (endpoint, headers, body) it returns a frozen
`Decision`: which model serves the request and over which upstream, the session
key the cache pins a slot by, the kind of call (an agent turn, a side call such
as a title or summary, or a plain request the cache leaves alone) and why, in
words. Everything after the router — the model pool's admission, the cache
manager's `prepare`, the accounting — reads the Decision and classifies nothing.

Single-model mode is a pool of one: `Router.single(upstream)`. With a model pool
the request's ``model`` field picks the target (unknown names go to the primary,
or are refused when ``pool.strict_models`` is set), and a side call addressed to
the primary goes to the pool's ``side`` profile when ``pool.side_calls`` is on.

With several backends for the primary model (``[[backends]]``, alone or beside
``[[models]]``), a Decision for the primary model also names the backend: the router
asks the backend chooser (`core.routing.choice`'s rule, by session, kind and the stable
prefix's affinity key) and takes its upstream.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from core import chat as apis
from core.chat import ChatView
from core.routing import profiles
from core.routing.choice import Pick, affinity_key
from core.server.upstream import Upstream

__all__ = [
    "AUX_HEADER",
    "SESSION_HEADERS",
    "BackendChooser",
    "Decision",
    "Kind",
    "Refused",
    "Router",
    "Target",
    "client_name",
    "metadata_session",
    "session_key",
]

SESSION_HEADERS = (
    "x-session-id",
    "x-session-affinity",
    "x-litellm-session-id",
    "x-opencode-session",
    "x-conversation-id",
    "x-claude-code-session-id",  # Claude Code (also in metadata.user_id)
    "session-id",  # Codex CLI (also its body's prompt_cache_key)
)
AUX_HEADER = "x-warmslot-aux"
_YES = ("1", "true", "yes")


class _Auto:
    """`Router.decide`'s default for `chat`: compute the chat view from the body."""


_AUTO = _Auto()
_WHAT = {"chat": "chat request", "messages": "Messages request", "responses": "Responses request"}


class Kind(enum.Enum):
    """What a request is to the cache."""

    AGENT = "agent"  # an agent turn: its stable prefix is kept warm in its session's slot
    SIDE = "side"  # a side call (title, summary …): kept off the agent's slots
    PLAIN = "plain"  # not a chat request: the server's own prefix reuse applies

    @property
    def label(self) -> str:
        """The word in telemetry, events and the ``X-Warmslot-Kind`` header."""
        return "aux" if self is Kind.SIDE else "agent"


@dataclass(frozen=True)
class Target:
    """One model the router can send a request to."""

    name: str  # the model profile's name; "" for the single server of single-model mode
    upstream: Upstream | None
    primary: bool = False
    side: bool = False  # the pool's profile for side calls


@dataclass(frozen=True)
class Decision:
    """Where a request goes and what it is; computed once, read by every later step."""

    model: str  # the target's name ("" in single-model mode)
    upstream: Upstream | None
    kind: Kind
    why: str  # in words: why this kind (and why this model, when a side call moved)
    session: str  # the slot pinning key: the client's session header, else derived
    client: str  # the client's product name, from its User-Agent
    routed_to_side: bool = False  # a side call moved from the primary to the side model
    backend: str = ""  # the backend that serves it, with several backends ("" otherwise)
    backend_why: str = ""  # why that backend, in words

    @property
    def side(self) -> bool:
        return self.kind is Kind.SIDE


@dataclass(frozen=True)
class Refused:
    """The router's answer for a request it cannot route (an unknown model, strict)."""

    status: int
    error: str


def client_name(user_agent: str) -> str:
    """The product name of a User-Agent ('opencode/1.18 ai-sdk/…' → 'opencode')."""
    first = user_agent.strip().split(" ", 1)[0] if user_agent.strip() else ""
    name = first.split("/", 1)[0].lower()
    return name[:64] or "unknown"


# Claude Code's metadata.user_id: "user_<hash>_account_<uuid>_session_<uuid>" (older
# releases), or a JSON object with a "session_id" (newer ones).
_SESSION_IN_USER_ID = re.compile(r"session_([0-9A-Za-z-]{8,})")


def metadata_session(user_id: str) -> str:
    """The session named in an Anthropic ``metadata.user_id`` ("" when none)."""
    if not user_id:
        return ""
    if user_id.lstrip().startswith("{"):
        try:
            obj = json.loads(user_id)
        except ValueError:
            obj = None
        sid = obj.get("session_id") if isinstance(obj, dict) else None
        if isinstance(sid, str) and sid:
            return "session-" + sid[:120]
    m = _SESSION_IN_USER_ID.search(user_id)
    if m:
        return "session-" + m.group(1)[:120]
    return "user-" + user_id[:120]


def session_key(headers: Mapping[str, str]) -> str:
    """The session the client names in a header ("" when it names none)."""
    for h in SESSION_HEADERS:
        value = headers.get(h)
        if value:
            return value.strip()[:200]
    return ""


# Several backends: (session, side call?, affinity key) → the pick and its upstream.
BackendChooser = Callable[[str, bool, str], tuple[Pick, Upstream | None]]


class Router:
    """Classifies each request once and picks its target among `targets` (and, with
    several backends, the backend through `backend`)."""

    def __init__(
        self,
        targets: Callable[[], Sequence[Target]],
        *,
        strict: Callable[[], bool] = lambda: False,
        side_calls: Callable[[], bool] = lambda: False,
        backend: BackendChooser | None = None,
    ) -> None:
        self._targets = targets
        self._backend = backend
        self._strict = strict
        self._side_calls = side_calls
        # (target, client) pairs whose agent turns carried tools: a tool-less chat
        # request from such a client is a side call.
        self._uses_tools: set[tuple[str, str]] = set()

    @classmethod
    def single(cls, upstream: Upstream | None) -> Router:
        """Single-model mode: a pool of one, the primary server."""
        only = (Target("", upstream, primary=True),)
        return cls(lambda: only)

    def decide(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        body: Mapping[str, object],
        chat: ChatView | _Auto | None = _AUTO,
    ) -> Decision | Refused:
        """The decision for one request (`headers` with lower-case names).

        `chat` is the request's chat view (`core.chat.chat_view`); the proxy passes the
        one it computed (None: the body could not be read as chat, so the request is
        plain). Left out, it is computed here."""
        if isinstance(chat, _Auto):
            try:
                chat = apis.chat_view(endpoint, body)
            except apis.ConversionError:
                chat = None
        targets = self._targets()
        asked = body.get("model")
        target = next((t for t in targets if t.name == asked), None)
        if target is None:
            if self._strict() and asked:
                known = ", ".join(repr(t.name) for t in targets)
                return Refused(
                    404,
                    f"Warmslot: model {asked!r} is not configured; the models here are {known} "
                    "(GET /v1/models lists them)",
                )
            target = next(t for t in targets if t.primary)
        client = client_name(headers.get("user-agent", ""))
        kind, why = self._classify(target.name, client, endpoint, headers, chat)
        session = session_key(headers)
        if chat is not None and not session:
            session = metadata_session(chat.user_id) or chat.derived_session(client)
        routed = False
        side = next((t for t in targets if t.side), None)
        if (
            kind is Kind.SIDE
            and chat is not None
            and target.primary
            and side is not None
            and self._side_calls()
        ):
            target, routed = side, True
            why = f"{why}; sent to the side model {side.name!r}"
        if self._backend is not None and target.primary:  # the primary model's backends
            key = affinity_key(client, chat.body) if chat is not None and kind is Kind.AGENT else ""
            pick, upstream = self._backend(session, kind is Kind.SIDE, key)
            return Decision(
                target.name, upstream, kind, why, session, client, routed, pick.backend, pick.why
            )
        return Decision(target.name, target.upstream, kind, why, session, client, routed)

    def _classify(
        self,
        model: str,
        client: str,
        endpoint: str,
        headers: Mapping[str, str],
        chat: ChatView | None,
    ) -> tuple[Kind, str]:
        # Chat completions, Anthropic Messages and OpenAI Responses alike: by their chat
        # view (a client's tool-less call is a side call whichever API it used).
        has_tools = chat is not None and bool(chat.tools)
        seen = (model, client) in self._uses_tools
        if has_tools:
            self._uses_tools.add((model, client))
        if headers.get(AUX_HEADER, "") in _YES:
            return Kind.SIDE, f"marked as side call ({AUX_HEADER} header)"
        if chat is None:
            if endpoint in apis.CHAT_ENDPOINTS:
                return Kind.PLAIN, f"{endpoint} request not readable as chat: left to the server"
            return Kind.PLAIN, f"{endpoint} request: the server's own prefix reuse applies"
        what = _WHAT[chat.api]
        why = profiles.classify_aux(chat.body, has_tools, seen)
        if why:
            return Kind.SIDE, why
        if has_tools:
            return Kind.AGENT, f"agent turn: {what} with tools"
        return Kind.AGENT, f"agent turn: {what}"
