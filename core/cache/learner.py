"""The prefix learner: a chat request's stable prefix, from the server's own rendering.

A client profile gives the head before the first volatile marker; sessions of the
same client and tools teach a longer boundary (their longest common rendered
prefix). Every new prefix is fingerprinted for the running server, remembered
(its definition kept across restarts) and announced as a ``prefix_learned`` cache
event. A chat template that drops tools or system text is reported once per
server start (``template_drops_tools`` and a `Notice`).

Split out of `core.cache.manager`, which asks it for each request's prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from core import chat as apis
from core.cache import prefix as pfx
from core.cache.boot import Emit
from core.cache.fingerprint import ServerIdentity, fingerprint
from core.chat import ChatView, JsonObject
from core.events import CacheEventKind, Event, Notice
from core.proxy.types import ProxyRequest
from core.routing import profiles
from core.server.client import LlamaClient

# Bodies larger than this are not rendered and tokenized to learn their prefix: an
# 8 MiB conversation cost the proxy +250 MiB and a 1.2 s stall in doing so (measured,
# docs/security.md#large-bodies), while a 262k-token agent context is 1–2 MB of JSON.
# Such a request still runs in its session's slot with llama-server's own reuse.
LEARN_MAX_BYTES = 2 * 1024 * 1024


def renderable(req: ProxyRequest) -> bool:
    """Whether the cache may render `req` through the server (learning its prefix,
    diagnosing a divergence, matching a saved conversation): not above LEARN_MAX_BYTES."""
    return req.body_bytes <= LEARN_MAX_BYTES


def render_body(body: Mapping[str, object]) -> JsonObject:
    """The fields `/apply-template` needs to render a chat request (in chat-completions
    form: a request's chat view, `chat_of`) as the server will."""
    return {k: v for k, v in body.items() if k in apis.RENDER_FIELDS}


def chat_of(req: ProxyRequest) -> JsonObject:
    """The request as chat completions (`core.chat.ChatView`): what the cache reads for
    messages and tools whichever API the client spoke; {} when it has no chat view."""
    return req.chat.body if req.chat is not None else {}


def system_end(chat: ChatView, rendered: str) -> int | None:
    """Where the system message and tools end in `rendered`: the start of the first
    user message's text (the turn header before it is the template's, stable too), or
    the end of the system text. None without a system message or tools."""
    system = chat.system_text
    if not system and not chat.tools:
        return None
    start = rendered.find(system) + len(system) if system and system in rendered else 0
    first_user = chat.first_user_text
    if first_user.strip():
        pos = rendered.find(first_user, start)
        if pos > 0:
            return pos
    return start or None


class PrefixLearner:
    """Known prefixes by request shape, what sessions taught, and the template check."""

    def __init__(
        self,
        emit: Emit,
        publish: Callable[[Event], None],
        remember: Callable[[pfx.PrefixInfo], None],
        identity: Callable[[], ServerIdentity | None],
        by_fp: Callable[[], dict[str, pfx.PrefixInfo]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._emit = emit  # a cache event (the manager's `emit`)
        self._publish = publish  # any event as it is
        self._remember = remember  # keep a new prefix's definition across restarts
        self._identity = identity  # the running server's (None while it is not known)
        self._by_fp = by_fp  # every known prefix by fingerprint (the manager's)
        self._clock = clock  # wall-clock seconds: first sightings feed TTLs and retention
        self.prefixes: dict[str, pfx.PrefixInfo] = {}  # shape key → prefix
        self.learn: dict[str, list[tuple[str, list[int]]]] = {}  # tools key → first turns
        self._no_prefix: set[tuple[str, str]] = set()  # (shape, session) without a prefix
        self.template_warning: str | None = None  # set when the template drops tools
        # The model file and chat template the known prefixes' tokens belong to.
        self._tokens_of: tuple[str, str] | None = None

    def server_gone(self) -> None:
        """The server stopped or restarts: its template is checked again."""
        self.template_warning = None

    def adopt(self, identity: ServerIdentity) -> bool:
        """A server with `identity` is ready: keep the known prefixes when their tokens
        are this model's and this template's (True: re-fingerprint them for it, as after
        a new build or other flags); forget them otherwise — another model's token ids
        mean nothing to this one, and its rendering of the same request differs."""
        mine = (identity.model, identity.chat_template)
        same = self._tokens_of is None or self._tokens_of == mine
        if not same:
            self.prefixes.clear()
            self.learn.clear()
            self._no_prefix.clear()
        self._tokens_of = mine
        return same

    async def prefix_for(
        self,
        req: ProxyRequest,
        client: LlamaClient,
        session: str,
    ) -> pfx.PrefixInfo | None:
        """The stable prefix of a chat request, from the server's own rendering.

        A profile gives the head before the first volatile marker; sessions of the
        same client and tools teach a longer boundary (their longest common rendered
        prefix, e.g. when the <env> block is the same all day). The longer one wins.
        Rendering happens once per new session and request shape, not per turn.
        """
        if not renderable(req) or req.chat is None:
            return None
        chat = req.chat
        body = chat.body
        key = chat.shape_key(req.client)
        tkey = chat.tools_key(req.client)
        known = self.prefixes.get(key)
        group = self.learn.setdefault(tkey, [])
        if known is not None and any(s == session for s, _ in group):
            return known
        if (key, session) in self._no_prefix:
            return None  # this session's shape was rendered before and had none
        rendered = await client.apply_template(render_body(body))
        self.check_template(req, rendered)
        full = await client.tokenize(rendered, add_special=True)
        head: list[int] = []
        source = "none"
        cut = profiles.profile_cut(req.client, rendered, chat.system_text)
        if cut is not None:
            head_tokens = await client.tokenize(rendered[: cut[0]], add_special=True)
            # Tokenizing at a boundary can differ from tokenizing the whole text: keep
            # only the tokens both agree on (docs/llama-server-facts.md#tokenizing-at-a-boundary).
            head = full[: pfx.common_prefix_len(head_tokens, full)]
            source = cut[1]
        learned: list[int] = []
        for other_session, other in group:
            if other_session != session:
                n = pfx.common_prefix_len(other, full)
                learned = full[:n] if n > len(learned) else learned
        if cut is None and all(s == session for s, _ in group):
            # No marker and only one conversation yet: its system message and tools are
            # the stable prefix, so the first conversation is persisted too; a second
            # session's common prefix refines it (docs/cache.md#what-survives-a-restart).
            end = system_end(chat, rendered)
            if end is not None:
                head_tokens = await client.tokenize(rendered[:end], add_special=True)
                head = full[: pfx.common_prefix_len(head_tokens, full)]
                cut = (end, "system")
                source = "system"
        if not any(s == session for s, _ in group):
            group.append((session, full))
            del group[:-4]
        tokens = head
        if len(learned) >= len(head) + pfx.MIN_PREFIX_TOKENS:
            tokens, source = learned, "learned"
        if known is not None and known.n_tokens >= len(tokens):
            return known
        if len(tokens) < pfx.MIN_PREFIX_TOKENS and known is None:
            # Remember, so later turns of this session skip the render round trips.
            if len(self._no_prefix) > 10_000:
                self._no_prefix.clear()
            self._no_prefix.add((key, session))
        if len(tokens) < pfx.MIN_PREFIX_TOKENS:
            self._emit(
                CacheEventKind.NO_BOUNDARY,
                "no stable prefix found for this client yet",
                client=req.client,
                tokens=len(tokens),
            )
            return known
        identity = self._identity()
        assert identity is not None
        info = pfx.PrefixInfo(
            key=key,
            tokens=tokens,
            text=rendered[: cut[0]] if cut else "",
            source=source,
            client=req.client,
            fingerprint=fingerprint(identity, tokens),
            first_seen=self._clock(),
            meta={"rendered_tokens": len(full), "head_n": len(head)},
        )
        self.prefixes[key] = info
        self._remember(info)
        by_fp = self._by_fp()
        if info.fingerprint not in by_fp:
            by_fp[info.fingerprint] = info
            share = round(len(tokens) / max(1, len(full)), 4)
            self._emit(
                CacheEventKind.PREFIX_LEARNED,
                f"stable prefix of {len(tokens)} of {len(full)} rendered tokens ({source})",
                fp=info.fingerprint,
                tokens=len(tokens),
                client=req.client,
                source=source,
                share=share,
                first_volatile_char=cut[0] if cut else None,
            )
        return info

    def check_template(self, req: ProxyRequest, rendered: str) -> None:
        """Say loudly when the server's chat template drops tools or system text."""
        lost = pfx.dropped_parts(chat_of(req), rendered)
        if not lost:
            return
        text = (
            f"the server's chat template dropped {', '.join(lost[:5])}"
            f"{' …' if len(lost) > 5 else ''} from the prompt: the model never sees them"
        )
        if self.template_warning is None:
            self.template_warning = text
            self._emit(CacheEventKind.TEMPLATE_DROPS_TOOLS, text, client=req.client, lost=lost)
            self._publish(
                Notice(
                    level="warning",
                    text=text,
                    hint=(
                        "set server.chat_template_file to a tool-capable template (see "
                        "resources/templates/) — `warmslot doctor` suggests one"
                    ),
                )
            )
