"""Stable-prefix detection and request classification.

The stable prefix is the part of the *rendered* prompt (as llama-server's own
template renders it) that does not change between turns and sessions: the tool
schemas and the fixed head of the system prompt. Known clients have profiles
that name the first volatile marker; unknown clients get a boundary learned
from the longest common rendered prefix of different sessions. When no boundary
can be found, nothing is cached for that client — never a wrong prefix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from core.apis import content_text, messages_of, objects, system_text
from core.status import DivergenceWhere

# Markers that start the volatile tail of a system prompt, per client profile, keyed
# by the client name of its User-Agent. Learned from real traffic: the recorded
# requests in tests/fixtures/clients/ and what each client sends (docs/clients.md).
# opencode: the <env> block (cwd, platform, date), "Instructions from:" (AGENTS.md
# files), MCP instructions (they change every turn) and the skills list.
# Claude Code's attribution line ("x-anthropic-billing-header: cc_version=…") opens its
# system text and its stamp changes with each session, not each turn: no marker for it
# (a cut at 0 leaves no prefix for a system-first template). The proxy takes the line
# out of the body before anything reads it (core.apis.strip_billing_header), so the
# profile sees the system text without it.
_CLAUDE_CODE = (
    # The memory folder is named after the working directory.
    "You have a persistent file-based memory at",
    # cwd, git or not, platform, shell, OS version, model name.
    "You have been invoked in the following environment",
    # Branch, status and recent commits: they change as the user works.
    "gitStatus:",
)
# Codex CLI (Responses API): the developer messages (base instructions, skills) are
# stable; cwd, date and timezone come in the first user message's
# <environment_context>, never in the system text: its boundary is where the system
# text ends (the learner's rule for a prompt without markers).
_CODEX = ("<environment_context>",)
PROFILES: dict[str, tuple[str, ...]] = {
    "opencode": (
        "<env>",
        "Instructions from:",
        "<mcp_instructions>",
        "<available_skills>",
        "<skills>",
    ),
    "claude-cli": _CLAUDE_CODE,  # claude-cli/2.1.197 (external, sdk-cli)
    "codex_exec": _CODEX,  # codex_exec/0.171.0 (Debian 12.0.0; x86_64) dumb …
    "codex_cli_rs": _CODEX,  # the interactive Codex CLI (same prompt; not recorded here)
}
# Markers that mean "volatile from here" for any client (dates, working directories).
GENERIC_MARKERS = ("<env>", "<mcp_instructions>")
MIN_PREFIX_TOKENS = 32

_TITLE_RE = re.compile(
    r"(generate|write|create)\s+(a\s+)?(short\s+|brief\s+|concise\s+)?(title|summary)|"
    r"you are a title generator|summari[sz]e (the|this) (conversation|session)|"
    r"^\s*title\s*:",
    re.IGNORECASE | re.MULTILINE,
)
# Side calls recognised by their own prompt, for clients whose agent turns carry no
# tools (aider sends its repo map and files as messages, never `tools`).
_AUX_PROMPTS = (
    # aider's commit message call (aider/prompts.py commit_system, the weak model).
    (
        "commit message request (aider)",
        re.compile(r"generates concise,\s+one-line git commit messages", re.IGNORECASE),
    ),
    # aider's chat history summary (aider/prompts.py summarize).
    (
        "chat summary request (aider)",
        re.compile(r"summari[sz]e this partial conversation", re.IGNORECASE),
    ),
)


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


def profile_cut(client: str, rendered: str, system: str) -> tuple[int, str] | None:
    """Where the volatile tail starts in `rendered`, by the client's profile markers.

    Only markers inside the system text count: the same words in a user message
    say nothing about the prefix. Returns (char index, source) or None.
    """
    markers = PROFILES.get(client, GENERIC_MARKERS)
    source = f"profile:{client}" if client in PROFILES else "generic"
    cuts = []
    for marker in markers:
        pos_sys = system.find(marker)
        if pos_sys < 0:
            continue
        # Find this occurrence in the rendered text: the system text's head before the
        # marker must appear right before it, so anchor on a stretch of that head.
        anchor = system[max(0, pos_sys - 64) : pos_sys + len(marker)]
        pos = rendered.find(anchor)
        if pos >= 0:
            cuts.append(pos + len(anchor) - len(marker))
    if not cuts:
        return None
    return min(cuts), source


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


def classify_aux(
    body: Mapping[str, object], has_tools: bool, client_uses_tools: bool
) -> str | None:
    """Why a chat request is an auxiliary (side) call, or None for an agent turn."""
    if not has_tools and client_uses_tools:
        return "no tools from a client whose agent turns carry tools"
    msgs = messages_of(body)
    if not has_tools and msgs:
        head = " ".join(content_text(m.get("content")) for m in msgs[:2])[:2000]
        for why, pattern in _AUX_PROMPTS:
            if pattern.search(head):
                return why
        if _TITLE_RE.search(head):
            return "title/summary request shape"
    return None


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
