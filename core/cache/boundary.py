"""A context checkpoint at the stable prefix's end, on models that rewind
(docs/cache.md#a-checkpoint-at-the-stable-boundary).

On a sliding-window model (without ``--swa-full``) or a recurrent/hybrid one, llama-server
can go back into a slot's cache only to a context checkpoint, and it makes checkpoints
only near the end of each prompt it reads (n − 4 − n_ubatch and n − 4) and at user-message
starts when the chat template tells it where they are
(docs/llama-server-facts.md#context-checkpoints). A second agent session that shares the
first one's 7,420-token system text and tools therefore went back to the checkpoint at
6,922 and read 510 tokens again, every time (Gemma 3 270M, opencode's recorded requests).

So where a request is about to read its stable prefix into a slot (an empty slot, or one
holding another session's conversation), the cache manager first sends the prefix alone
(`core.cache.slot_ops.prewarm_body`): the server reads it as the request would have,
and takes its n − 4 checkpoint right at the boundary. The request then continues from
there. Later sessions with the same prefix go back at most 4 tokens. What the split
costs: one more HTTP round trip and a batch cut at n − 4; what the request reads is
unchanged, and the prefix's reading is counted as the request's own
(`Timings.with_split`), never as reuse.

Never for a request of the conversation the slot holds (same session, or the same opening
message): sending the prefix alone would cut the conversation off the slot.
"""

from __future__ import annotations

from collections.abc import Mapping

from core.cache.slots import SlotState

CHECKPOINT_TAIL = 4  # a prompt's last checkpoint is 4 tokens before its end (server rule)


def _opening(chat: Mapping[str, object]) -> object:
    """A chat's first message after its system messages (None: it has none)."""
    msgs = chat.get("messages")
    for m in msgs if isinstance(msgs, list) else []:
        if not (isinstance(m, dict) and m.get("role") in ("system", "developer")):
            return m
    return None


def same_conversation(last: Mapping[str, object] | None, chat: Mapping[str, object]) -> bool:
    """Whether the chat request `chat` belongs to the conversation `last` (a slot's last
    request): same tools and the same opening message after the system text. Then the
    slot may hold more of the request than its stable prefix — a resumed conversation
    with a new session id, or one whose client rewrote a later message — and llama-server
    is left to go back to its own best checkpoint."""
    if last is None or last.get("tools") != chat.get("tools"):
        return False
    opening = _opening(chat)
    return opening is not None and opening == _opening(last)


def needs_mark(
    st: SlotState, fp: str, n_tokens: int, chat: Mapping[str, object], session: str
) -> bool:
    """Whether a request with the stable prefix `fp` (`n_tokens` long) should have its
    prefix sent alone into slot `st` first: the slot is idle and will read the prefix or
    diverge after it without continuing its own conversation."""
    if st.inflight:
        return False
    if not st.tokens_hint:
        return True  # an empty slot: the request reads everything
    if st.prefix_fp == fp and st.tokens_hint <= n_tokens:
        return False  # exactly the prefix (re-warmed or restored): its checkpoints came with it
    if session and st.session_of_last == session:
        return False  # this session's own conversation
    return not same_conversation(st.last_body, chat)
