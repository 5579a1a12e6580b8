"""An opencode-shaped agent trace, generated deterministically.

Shaped after a real opencode 1.18 agent: ~10 tool schemas (~20.8k characters,
identical in every agent request), a ~9.7k-character system prompt whose first
~8.5k characters never change and whose tail holds a volatile ``<env>`` block,
``Instructions from:`` and a skills list; a title-generation call (no tools)
before each session's first agent turn; session ids in ``x-session-id``.
`scale` shrinks every size for fast tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

USER_AGENT = "opencode/1.18.33 ai-sdk/provider-utils/3.0.0 runtime/bun/1.2.0"
_WORDS = [
    "file",
    "path",
    "line",
    "content",
    "search",
    "pattern",
    "result",
    "command",
    "output",
    "directory",
    "read",
    "write",
    "edit",
    "replace",
    "string",
    "match",
    "glob",
    "grep",
    "bash",
    "tool",
    "agent",
    "session",
    "model",
    "token",
    "cache",
    "prefix",
    "slot",
    "server",
    "request",
    "response",
    "error",
    "value",
    "option",
    "default",
    "parameter",
    "type",
    "number",
    "boolean",
    "array",
    "object",
    "description",
    "required",
    "property",
    "format",
    "example",
]


def _text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14)))
        sentence = sentence.capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class FunctionSpec(TypedDict):
    """A tool's ``function``: its name, description and JSON-Schema parameters."""

    name: str
    description: str
    parameters: dict[str, object]  # a JSON Schema (written by make_tools)


class Tool(TypedDict):
    """A chat-completions tool in OpenAI function form."""

    type: str  # "function"
    function: FunctionSpec


class Message(TypedDict):
    """A chat message of the trace (text content only)."""

    role: str
    content: str


class ChatBody(TypedDict):
    """A trace request's chat-completions body."""

    messages: list[Message]
    tools: NotRequired[list[Tool]]  # agent turns only; the title call has none
    max_tokens: int
    temperature: float


def make_tools(scale: float = 1.0, seed: int = 7, count: int = 10) -> list[Tool]:
    """`count` function tools whose JSON totals ≈ 20.8k × scale characters."""
    rng = random.Random(seed)
    names = [
        "bash",
        "read",
        "write",
        "edit",
        "glob",
        "grep",
        "list",
        "webfetch",
        "todowrite",
        "task",
        "patch",
        "todoread",
    ][:count]
    per_tool = int(20_800 * scale / count)
    tools = []
    for name in names:
        tool: Tool = {
            "type": "function",
            "function": {
                "name": name,
                "description": "",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": _text(rng, 120)},
                        "content": {"type": "string", "description": _text(rng, 80)},
                    },
                    "required": ["path"],
                },
            },
        }
        overhead = len(json.dumps(tool))
        tool["function"]["description"] = _text(rng, max(40, per_tool - overhead))
        tools.append(tool)
    return tools


def make_system(
    scale: float = 1.0,
    seed: int = 11,
    cwd: str = "/home/user/project",
    date: str = "Sun Nov 29 2026",
) -> str:
    """A system prompt: ~8.5k × scale stable characters, then the volatile tail."""
    rng = random.Random(seed)
    head = (
        "You are opencode, an interactive CLI tool that helps users with software "
        "engineering tasks. " + _text(rng, int(8_500 * scale))
    )
    tail = (
        f"\n<env>\n  Working directory: {cwd}\n  Is directory a git repo: yes\n"
        f"  Platform: linux\n  Today's date: {date}\n</env>\n"
        f"Instructions from: {cwd}/AGENTS.md\n"
        + _text(rng, int(700 * scale))
        + "\n<available_skills>\n  - review: code review checklist\n"
        "  - release: how to cut a release\n</available_skills>\n"
    )
    return head + tail


@dataclass
class TraceRequest:
    session: str
    kind: str  # title | agent
    turn: int
    body: ChatBody
    headers: dict[str, str] = field(default_factory=dict)
    restart_before: bool = False


def make_trace(
    *,
    sessions: int = 3,
    turns: int = 3,
    scale: float = 1.0,
    restart_before_session: int | None = 3,
    max_tokens: int = 8,
    seed: int = 3,
    vary_env: bool = False,
) -> list[TraceRequest]:
    """The trace: per session a title call, then `turns` agent turns that grow."""
    rng = random.Random(seed)
    tools = make_tools(scale)
    out: list[TraceRequest] = []
    for s in range(1, sessions + 1):
        sid = f"ses_{s:04d}{rng.randrange(16**8):08x}"
        # Sessions of one project on one day share the <env> block; `vary_env` gives each
        # its own working directory (a different project).
        system = make_system(
            scale, cwd=f"/home/user/project-{s}" if vary_env else "/home/user/project"
        )
        headers = {"x-session-id": sid, "x-session-affinity": sid, "User-Agent": USER_AGENT}
        first = f"Task {s}: " + _text(rng, int(300 * max(scale, 0.2)))
        out.append(
            TraceRequest(
                sid,
                "title",
                0,
                {
                    "messages": [
                        {
                            "role": "system",
                            "content": "You are a title generator. You output ONLY a "
                            "thread title of at most 50 characters.",
                        },
                        {
                            "role": "user",
                            "content": "Generate a title for this conversation:\n" + first,
                        },
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                },
                dict(headers),
                restart_before=restart_before_session == s,
            )
        )
        messages: list[Message] = [
            {"role": "system", "content": system},
            {"role": "user", "content": first},
        ]
        for t in range(1, turns + 1):
            out.append(
                TraceRequest(
                    sid,
                    "agent",
                    t,
                    {
                        "messages": [m.copy() for m in messages],
                        "tools": tools,
                        "max_tokens": max_tokens,
                        "temperature": 0.0,
                    },
                    dict(headers),
                )
            )
            messages.append(
                {"role": "assistant", "content": _text(rng, int(400 * max(scale, 0.2)))}
            )
            messages.append({"role": "user", "content": _text(rng, int(200 * max(scale, 0.2)))})
    return out


def iter_agent_turns(trace: list[TraceRequest]) -> Iterator[TraceRequest]:
    return (r for r in trace if r.kind == "agent")


def interleave(trace: list[TraceRequest]) -> list[TraceRequest]:
    """The same requests with the sessions taking turns (two agents on one server, never worse
    off than on a bare llama-server with the same memory): every session's
    title call, then turn 1 of each session, turn 2 of each, …; no restart. Two agents
    working side by side on one server send their turns like this."""
    order = {sid: i for i, sid in enumerate(dict.fromkeys(r.session for r in trace))}
    out = sorted(trace, key=lambda r: (r.turn, order[r.session]))
    for r in out:
        r.restart_before = False
    return out
