"""Tool-call arguments in a request's history that are not JSON: found, and closed.

An answer cut at its output limit (``max_tokens``, ``max_output_tokens``) in the middle
of a tool call leaves a call whose ``arguments`` string stops mid-JSON; the client
puts it back into the history of every later request. llama-server parses each
history call's arguments when the chat template reads them as an object (most tool
templates, Warmslot's own among them) and answers a 500 ``Failed to parse tool call
arguments as JSON`` for every later request of that conversation (a Codex conversation
failed 52 times in 41 s that way, each shown to its user as "high demand").

- `find` names each such call (for the proxy's 400, core.proxy.errors.history_error).
- `repair` closes each one in place when ``proxy.repair_tool_arguments`` is on: an
  open string is closed, then the open arrays and objects, after dropping a dangling
  key, colon, comma or partial word; what cannot be closed becomes ``{}``.

Only the chat-completions (``messages[i].tool_calls[j].function.arguments``) and
Responses (``input[i].arguments`` of a ``function_call`` item) bodies carry arguments
as strings; an Anthropic ``tool_use`` block's ``input`` is an object already.

Pure functions of JSON values, like core.chat.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

__all__ = ["REPAIR_EDIT", "BadArguments", "close_json", "find", "repair"]

REPAIR_EDIT = "tool-arguments"  # the edit's name in X-Warmslot-Edited and explain

# How many cut points back from the end `close_json` tries (each try parses the text).
_MAX_TRIES = 64
_PARTIAL_UNICODE = re.compile(r"\\u[0-9a-fA-F]{0,3}")


@dataclass(frozen=True)
class BadArguments:
    """One history tool call whose arguments are not JSON."""

    where: str  # the field in the client's body: "messages[3].tool_calls[0].function.arguments"
    index: int  # the message (chat) or input item (Responses) index in the client's body
    name: str  # the tool's name
    error: str  # what the JSON parser said

    @property
    def text(self) -> str:
        """One line naming the call."""
        return f"{self.where} (a call of tool {self.name!r}) is not JSON: {self.error}"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # Python reads NaN/Infinity; llama-server does not


def _error(text: str) -> str:
    """Why `text` is not JSON ("" when it is)."""
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        return str(e)
    return ""


def _calls(
    endpoint: str, body: MutableMapping[str, object]
) -> Iterator[tuple[str, int, str, MutableMapping[str, object]]]:
    """(field path, index, tool name, the object holding ``arguments``) of every history
    tool call whose arguments are a string."""
    if endpoint == "chat":
        messages = body.get("messages")
        for i, msg in enumerate(messages if isinstance(messages, list) else []):
            calls = msg.get("tool_calls") if isinstance(msg, dict) else None
            for j, call in enumerate(calls if isinstance(calls, list) else []):
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    name = fn.get("name")
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    yield where, i, name if isinstance(name, str) else "", fn
    elif endpoint == "responses":
        items = body.get("input")
        for i, item in enumerate(items if isinstance(items, list) else []):
            if not isinstance(item, dict) or item.get("type") != "function_call":
                continue
            if isinstance(item.get("arguments"), str):
                name = item.get("name")
                yield f"input[{i}].arguments", i, name if isinstance(name, str) else "", item


def find(endpoint: str, body: MutableMapping[str, object]) -> list[BadArguments]:
    """The history tool calls of a chat or Responses body whose arguments are not JSON."""
    out: list[BadArguments] = []
    for where, index, name, holder in _calls(endpoint, body):
        error = _error(str(holder["arguments"]))
        if error:
            out.append(BadArguments(where, index, name, error))
    return out


def repair(endpoint: str, body: MutableMapping[str, object]) -> list[BadArguments]:
    """Close, in place, every history tool call's arguments that are not JSON
    (`close_json`); returns the calls repaired ([] for a body that needed nothing)."""
    repaired: list[BadArguments] = []
    for where, index, name, holder in _calls(endpoint, body):
        text = str(holder["arguments"])
        error = _error(text)
        if error:
            holder["arguments"] = close_json(text)
            repaired.append(BadArguments(where, index, name, error))
    return repaired


def _closers(stack: list[str]) -> str:
    return "".join(reversed(stack))


def close_json(text: str) -> str:
    """`text`, a JSON value cut short, made whole: ``{"cmd": ["ls", "-l`` becomes
    ``{"cmd": ["ls", "-l"]}``. Tries the whole text (an open string closed) and then
    shorter prefixes ending at a value's end, each with the arrays and objects open
    there closed; ``{}`` when none parses (text that was never JSON)."""
    stack: list[str] = []
    cuts: list[tuple[int, str]] = []  # (prefix end, closers there), in text order
    in_string = escaped = False
    escape_at = -1  # where the string's last escape sequence starts
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped, escape_at = True, i
            elif ch == '"':
                in_string = False
                cuts.append((i + 1, _closers(stack)))
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            cuts.append((i + 1, _closers(stack)))
        elif ch in "}]":
            if stack:
                stack.pop()
            cuts.append((i + 1, _closers(stack)))
        elif ch == ",":
            cuts.append((i, _closers(stack)))  # the value before the comma is whole
    whole = text.rstrip()
    if in_string:  # cut inside a string: drop an escape cut short (\ or \u12), close it
        open_escape = escape_at >= 0 and (
            escaped or _PARTIAL_UNICODE.fullmatch(text, escape_at) is not None
        )
        whole = (text[:escape_at] if open_escape else text) + '"'
    candidates = [whole + _closers(stack)]
    candidates += [text[:end].rstrip() + closers for end, closers in reversed(cuts[-_MAX_TRIES:])]
    for candidate in candidates:
        if candidate.strip() and not _error(candidate):
            return candidate
    return "{}"
