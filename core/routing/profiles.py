"""Client profiles: where each known client's volatile system text starts, and which of
its calls are side calls (title, summary, commit message).

Keyed by the client name of the User-Agent (`core.routing.router.client_name`). The router
classifies with `classify_aux`; the prefix learner cuts the stable prefix with
`profile_cut` (docs/clients.md says what each client sends).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from core.chat import content_text, messages_of

__all__ = ["GENERIC_MARKERS", "PROFILES", "classify_aux", "profile_cut"]

# Markers that start the volatile tail of a system prompt, per client profile, keyed
# by the client name of its User-Agent. Learned from real traffic: the recorded
# requests in tests/fixtures/clients/ and what each client sends (docs/clients.md).
# opencode: the <env> block (cwd, platform, date), "Instructions from:" (AGENTS.md
# files), MCP instructions (they change every turn) and the skills list.
# Claude Code's attribution line ("x-anthropic-billing-header: cc_version=…") opens its
# system text and its stamp changes with each session, not each turn: no marker for it
# (a cut at 0 leaves no prefix for a system-first template). The proxy takes the line
# out of the body before anything reads it (core.proxy.billing.strip_billing_header), so the
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
