"""The stable prefix: what is known of one (`PrefixInfo`) and how prompts compare.

The stable prefix is the part of the *rendered* prompt (as llama-server's own
template renders it) that does not change between turns and sessions: the tool
schemas and the fixed head of the system prompt. Known clients have profiles
that name the first volatile marker (core.routing.profiles); unknown clients get a
boundary learned from the longest common rendered prefix of different sessions
(core.cache.learner). When no boundary can be found, nothing is cached for that
client — never a wrong prefix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from core.chat import objects, system_text
from core.status import DivergenceWhere

MIN_PREFIX_TOKENS = 32


class PrefixMeta(TypedDict, total=False):
    """What is known of a prefix besides its tokens (a key is absent while unknown)."""

    rendered_tokens: int  # tokens of the whole rendered request it was learned from
    head_n: int  # tokens of the profile's or system's head (the prefix may reach past it)
    definition: str  # its stored definition's id (core.cache.definitions)


@dataclass
class PrefixInfo:
    """A detected stable prefix, as tokens the server will see."""

    key: str  # identifies the request shape it was derived from (client, tools, system)
    tokens: list[int]
    text: str  # rendered text of the prefix (for diagnosis and display)
    source: str  # profile:<name> | learned | generic
    client: str
    fingerprint: str = ""
    first_seen: float = 0.0
    last_used: float = 0.0
    meta: PrefixMeta = field(default_factory=lambda: PrefixMeta())

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: prompts share thousands of tokens.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def divergence(old: str, new: str, context: int = 60) -> DivergenceWhere | None:
    """Where two rendered prompts first differ, with the text around it."""
    i = common_prefix_len(old, new)
    if i == len(old) and i <= len(new):
        return None  # the new prompt extends the old one: no divergence
    return {
        "char_index": i,
        "before": old[max(0, i - context) : i],
        "old": old[i : i + context],
        "new": new[i : i + context],
    }


def dropped_parts(body: Mapping[str, object], rendered: str) -> list[str]:
    """What of the request the rendered prompt lost: tool names, the system text.

    A chat template without tool support (llama-server's generic fallback) renders
    the messages but silently leaves the tools out.
    """
    missing = []
    for tool in objects(body.get("tools")):
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        # Names are short words that may appear anywhere; the description is the
        # tool's own text, so look for both. Templates render it raw or JSON-escaped
        # (newlines as \\n, non-ASCII as \\uXXXX), so compare its first plain words.
        if fn["name"] not in rendered or not _description_present(fn.get("description"), rendered):
            missing.append(f"tool {fn['name']}")
    system = system_text(body).strip()
    if system and system[:64] not in rendered:
        missing.append("system message")
    return missing


def _description_present(description: object, rendered: str) -> bool:
    text = str(description or "")
    plain = re.match(r"[A-Za-z0-9 ,.;:()'-]{12,48}", text)
    if plain is None:
        return True  # nothing distinctive and safe to look for: trust the name
    return plain.group(0) in rendered
