"""Every message shape the chat APIs produce reaches the prompt, on a real llama-server.

The recorded conversations of Claude Code (Anthropic Messages), Codex (OpenAI Responses),
opencode and aider (chat completions) in tests/fixtures/clients, each request rendered by
a real llama-server's /apply-template — through the model's own template (the tiny model's
and Gemma 3's, which has none: the server's fallback) and through every template Warmslot
ships (resources/templates/*.jinja, on Gemma 3, the model they are for). The Messages and
Responses bodies are rendered as their chat view (core/chat.py: llama-server's own
conversion), and the server's own token count of each original body is checked against the
rendered prompt, so the prompt inspected is the one the server builds for that body.

Each earlier assistant answer's text must be in the prompt: Claude Code's assistant turns
and Codex's ``output_text`` items arrive as lists of parts, which the shipped Gemma 3
template once rendered as an empty model turn (the model never saw what it had said).
The random-weight recordings never called a tool, so each client's last recorded request
is also extended with the tool-call and tool-result shapes of its API (Anthropic
``tool_use`` / ``tool_result`` with string and block content, Responses ``function_call``
/ ``function_call_output`` with string and part output, chat ``tool_calls`` and ``tool``
messages with string and part content); through a shipped template every message's text,
every tool call's name and arguments and every tool result must be there too.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core import chat as apis
from core.paths import resources_dir
from tests.helpers import REPO, bare_llama_server, post_chat

pytestmark = pytest.mark.integration

CLIENTS = REPO / "tests" / "fixtures" / "clients"
# client folder → the endpoint kind its recorded requests went to
RECORDED = {"claude-code": "messages", "codex": "responses", "opencode": "chat", "aider": "chat"}
COUNT_PATH = {"messages": "/v1/messages/count_tokens", "responses": "/v1/responses/input_tokens"}
SHIPPED = sorted((resources_dir() / "templates").glob("*.jinja"))


@dataclass(frozen=True)
class Conversation:
    name: str  # client/step, for the failure message
    endpoint: str
    body: dict[str, Any]


def _tool_name(body: dict[str, Any], *preferred: str) -> str:
    names = [t.get("name") or t.get("function", {}).get("name") for t in body.get("tools", [])]
    return next((n for n in preferred if n in names), "run")


def _with_tools(client: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` (a recorded request) with its API's tool-call and tool-result shapes added."""
    body = copy.deepcopy(body)
    if client == "claude-code":
        read, bash = _tool_name(body, "Read"), _tool_name(body, "Bash")
        body["messages"] += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "I will read hello.py first."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": read,
                        "input": {"file_path": "/project/hello.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "print('hello from the file')",
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": bash,
                        "input": {"command": "ls -la /project"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "hello.py README.md listed"}],
                    },
                    {"type": "text", "text": "Now say what you found."},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Two files, one script."}]},
            {"role": "user", "content": "Thank you."},
        ]
    elif client == "codex":
        shell = _tool_name(body, "exec_command", "shell")
        body["input"] += [
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "Reading the file now.", "annotations": []}
                ],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": shell,
                "arguments": json.dumps({"cmd": "cat hello.py"}),
            },
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": "print('hello from the file')",
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": shell,
                "arguments": json.dumps({"cmd": "ls -la"}),
            },
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "hello.py README.md listed"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "Two files, one script.", "annotations": []}
                ],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Thank you."}],
            },
        ]
    else:  # chat completions
        shell = _tool_name(body, "bash", "read")
        body["messages"] += [
            {
                "role": "assistant",
                "content": "Reading the file now.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": shell,
                            "arguments": json.dumps({"command": "cat hello.py"}),
                        },
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "print('hello from the file')"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Listing it too."}],
                "tool_calls": [
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": shell, "arguments": json.dumps({"command": "ls -la"})},
                    },
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "hello.py README.md listed"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Two files, one script."}]},
            {"role": "user", "content": [{"type": "text", "text": "Thank you."}]},
        ]
    return body


def _conversations() -> list[Conversation]:
    out: list[Conversation] = []
    for client, endpoint in RECORDED.items():
        recorded = json.loads((CLIENTS / client / "requests.json").read_text())
        bodies = [(r["step"], r["body"]) for r in recorded if r.get("method") == "POST"]
        out += [Conversation(f"{client}/{step}", endpoint, body) for step, body in bodies]
        # The longest recorded conversation grows its API's tool turns (aider sends no
        # tools: its edits are text).
        if client != "aider":
            step, last = [(s, b) for s, b in bodies if s.startswith("s1-turn")][-1]
            out.append(Conversation(f"{client}/{step}+tools", endpoint, _with_tools(client, last)))
    return out


def _texts(content: object) -> list[str]:
    """The texts a message's content holds: the string, or each text part's."""
    if isinstance(content, str):
        return [content] if content.strip() else []
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and p.get("text", "").strip()]
    return []


def _expected(view: apis.ChatView, *, everything: bool) -> list[str]:
    """What must be in the prompt: each assistant answer's text; with `everything`, also
    every other message's text, each tool call's name and argument values."""
    out: list[str] = []
    for msg in view.messages:
        if msg.get("role") == "assistant" or everything:
            out += _texts(msg.get("content"))
        if everything:
            for call in msg.get("tool_calls") or []:
                fn = call["function"]
                out.append(fn["name"])
                out += [v for v in json.loads(fn["arguments"]).values() if isinstance(v, str)]
    return out


@dataclass(frozen=True)
class Renderer:
    name: str
    model: str  # fixture name
    template: Path | None  # None: the model's own

    @property
    def shipped(self) -> bool:
        return self.template is not None


RENDERERS = [
    Renderer("tiny-own", "tiny_model", None),
    Renderer("gemma-own", "gemma_model", None),
    *(Renderer(f"gemma-{t.stem}", "gemma_model", t) for t in SHIPPED),
]


@pytest.fixture(scope="module", params=RENDERERS, ids=lambda r: r.name)
def renderer(
    request: pytest.FixtureRequest, server_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Renderer, str]]:
    r: Renderer = request.param
    model: Path = request.getfixturevalue(r.model)
    args = ["--jinja", "-c", "4096", "-np", "1", "--threads", "2"]
    if r.template is not None:
        args += ["--chat-template-file", str(r.template)]
    with bare_llama_server(server_binary, model, tmp_path_factory.mktemp(r.name), *args) as base:
        yield r, base


def test_shipped_templates_are_all_covered() -> None:
    assert SHIPPED, "no templates under resources/templates"


@pytest.mark.timeout(600)
def test_every_earlier_answer_reaches_the_prompt(renderer: tuple[Renderer, str]) -> None:
    r, base = renderer
    missing: list[str] = []
    for conv in _conversations():
        view = apis.chat_view(conv.endpoint, conv.body)
        assert view is not None
        prompt = post_chat(base, view.body, path="/apply-template").json()["prompt"]
        if conv.endpoint in COUNT_PATH:  # the server's own reading of the client's body
            count = post_chat(base, conv.body, path=COUNT_PATH[conv.endpoint])
            counted = count.json()["input_tokens"]
            tokenize = {"content": prompt, "add_special": True, "parse_special": True}
            tokens = post_chat(base, tokenize, path="/tokenize").json()["tokens"]
            assert counted == len(tokens), (
                f"{conv.name}: the chat view is not what the server reads"
            )
        expected = _expected(view, everything=r.shipped)
        if conv.name.endswith("+tools"):
            assert _expected(view, everything=False), conv.name  # answers to look for
        missing += [f"{conv.name}: {text[:60]!r}" for text in expected if text not in prompt]
    assert not missing, f"{r.name} leaves out of the prompt:\n" + "\n".join(missing)
