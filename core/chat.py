"""The wire APIs the proxy speaks: OpenAI chat completions, Anthropic Messages, OpenAI
Responses (and the raw completion, embedding and tokenizer routes).

For each route: its endpoint kind and whether it generates (`ROUTES`). For a
generation request of the three chat-shaped APIs: its *chat view* (`chat_view`),
the request as chat-completions ``messages`` + ``tools``, converted the way
llama-server converts it before rendering (``server_chat_convert_anthropic_to_oai``
and ``server_chat_convert_responses_to_chatcmpl`` in tools/server/server-chat.cpp of
the pinned llama.cpp). Everything that reads a request's messages or tools (the
router, the prefix learner, conversations, the template check) reads the chat view;
the body forwarded upstream stays the client's own. From a response: its reuse
numbers from ``usage`` when the server sent no ``timings`` (`usage_timings`). The proxy's
edits of a client's body are its own (core.proxy.billing, core.proxy.tool_arguments).

Pure functions of JSON values: no I/O, nothing from the rest of Warmslot.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "API_PARITY_PATCH",
    "CHAT_ENDPOINTS",
    "PREFIX_SAVE_PATCH",
    "ROUTES",
    "ChatView",
    "ConversionError",
    "JsonObject",
    "chat_view",
    "content_text",
    "messages_of",
    "objects",
    "system_text",
    "unmanaged_reason",
    "usage_timings",
]

# path → (endpoint kind, generation?)
ROUTES: dict[str, tuple[str, bool]] = {
    "/v1/chat/completions": ("chat", True),
    "/chat/completions": ("chat", True),
    "/v1/messages": ("messages", True),
    "/v1/responses": ("responses", True),
    "/responses": ("responses", True),
    "/v1/completions": ("completions", True),
    "/completions": ("completions", True),
    "/completion": ("completion", True),
    "/v1/embeddings": ("embeddings", False),
    "/embeddings": ("embeddings", False),
    "/tokenize": ("tokenize", False),
    "/detokenize": ("detokenize", False),
    "/apply-template": ("apply-template", False),
    # Token counting of each chat API: forwarded, unmanaged.
    "/v1/messages/count_tokens": ("messages-count", False),
    "/v1/responses/input_tokens": ("responses-count", False),
    "/responses/input_tokens": ("responses-count", False),
    "/v1/chat/completions/input_tokens": ("chat-count", False),
    "/chat/completions/input_tokens": ("chat-count", False),
}
# The endpoints whose requests have a chat view (and that the prefix cache manages).
CHAT_ENDPOINTS = ("chat", "messages", "responses")

# Patch levels (GET /props → warmslot_patches, docs/patches.md). api-parity-v1:
# /v1/messages keeps `id_slot` and `cache_prompt` (stock llama-server drops them there,
# so a slot cannot be pinned) and every chat API's answer carries `timings`.
API_PARITY_PATCH = "api-parity-v1"
PREFIX_SAVE_PATCH = "prefix-save-v1"

# The fields of a chat-completions body that change how the server renders it.
RENDER_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")


# A JSON object as a client (or the server) sent it: any keys, values unchecked. Readers
# look a value up and check its type before they use it; the chat view is built of these.
JsonObject = dict[str, object]


class ConversionError(ValueError):
    """A body that cannot be read as a chat request (llama-server refuses it too)."""


def objects(value: object) -> list[Mapping[str, object]]:
    """The objects of a JSON array ([] when `value` is none). A chat view's messages and
    tools are objects all: the proxy refuses a body with anything else (core.proxy.checks)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def messages_of(body: Mapping[str, object]) -> list[Mapping[str, object]]:
    """A chat body's messages ([] when it has none). Raises TypeError when they are not a
    list of objects: a body the proxy refuses (core.proxy.checks), and the readers that
    take unchecked bodies (core.routing.choice.affinity_key) catch it."""
    msgs = body.get("messages", [])
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise TypeError("the messages are not a list of objects")
    return msgs


def content_text(content: object) -> str:
    """A message content's text: the string, or its parts' texts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def system_text(body: Mapping[str, object]) -> str:
    """The concatenated text of the system (and developer) messages."""
    parts: list[str] = []
    for msg in messages_of(body):
        if msg.get("role") in ("system", "developer"):
            parts.append(content_text(msg.get("content")))
    return "\n".join(parts)


@dataclass(frozen=True)
class ChatView:
    """A generation request as chat completions: what llama-server renders for it.

    `body` holds ``messages`` and, when present, ``tools`` (OpenAI function form),
    ``tool_choice``, ``chat_template_kwargs`` and ``reasoning_effort`` — exactly what
    ``/apply-template`` needs to render the request as the server will.

    What the router and the cache read of a request — its system text, first user
    text, tools key and shape key — is read here, once per request (cached properties),
    never again from the body.
    """

    api: str  # the endpoint kind it came from: "chat" | "messages" | "responses"
    body: JsonObject
    user_id: str = ""  # Anthropic's metadata.user_id (Claude Code puts its session there)

    @property
    def messages(self) -> list[JsonObject]:
        """The chat messages (system first when the API had one)."""
        msgs = self.body.get("messages")
        return msgs if isinstance(msgs, list) else []

    @property
    def tools(self) -> list[JsonObject]:
        """The tools in OpenAI function form ([] when none)."""
        tools = self.body.get("tools")
        return tools if isinstance(tools, list) else []

    @functools.cached_property
    def system_text(self) -> str:
        """The system (and developer) messages' text (`system_text`)."""
        return system_text(self.body)

    @functools.cached_property
    def first_user_text(self) -> str:
        """The first user message's text ("" without one)."""
        return next(
            (
                content_text(m.get("content"))
                for m in objects(self.body.get("messages"))
                if m.get("role") == "user"
            ),
            "",
        )

    @functools.cached_property
    def _tools_json(self) -> bytes:
        return json.dumps(self.body.get("tools"), sort_keys=True).encode()

    @functools.cached_property
    def head_key(self) -> str:
        """Hash of the tools verbatim and the system text: two requests with the same
        one start with the same stable prefix, whoever sent them."""
        h = hashlib.sha256(self._tools_json + b"\0")
        h.update(self.system_text.encode())
        return h.hexdigest()

    def tools_key(self, client: str) -> str:
        """Hash of the client and its tools verbatim (the learner's session groups)."""
        h = hashlib.sha256(client.encode() + b"\0")
        h.update(self._tools_json)
        return h.hexdigest()

    def shape_key(self, client: str) -> str:
        """Hash of what a stable prefix depends on: client, tools verbatim, system text
        (the learner's known prefixes; the same value as before it was cached here)."""
        h = hashlib.sha256(client.encode() + b"\0")
        h.update(self._tools_json + b"\0")
        h.update(self.system_text.encode())
        return h.hexdigest()

    def derived_session(self, client: str) -> str:
        """A session key for clients that send none: the conversation's opening."""
        h = hashlib.sha256(
            client.encode()
            + b"\0"
            + self.system_text.encode()
            + b"\0"
            + self.first_user_text.encode()
        )
        return "derived-" + h.hexdigest()[:16]


def chat_view(endpoint: str, body: Mapping[str, object]) -> ChatView | None:
    """The chat view of a request to `endpoint`; None for endpoints without one.

    Raises ConversionError for a body llama-server could not convert either.
    """
    if endpoint == "chat":
        return ChatView("chat", {k: body[k] for k in RENDER_FIELDS if k in body})
    if endpoint == "messages":
        return _from_messages(body)
    if endpoint == "responses":
        return _from_responses(body)
    return None


def unmanaged_reason(endpoint: str, patches: tuple[str, ...]) -> str:
    """Why the cache cannot manage `endpoint` on a server with `patches` ("" when it can)."""
    if endpoint == "messages" and API_PARITY_PATCH not in patches:
        return (
            "this llama-server drops id_slot on /v1/messages: build with `warmslot build` "
            "to get patch 0004"
        )
    return ""


# ------------------------------------------------------------ Anthropic Messages
_BILLING = "x-anthropic-billing-header:"


def _billing_normalized(text: str) -> str:
    # Claude Code opens its system prompt with a billing line whose `cch=xxxxx` stamp
    # changes on every request; llama-server overwrites it with "fffff" so the prefix
    # cache gets past it (upstream llama.cpp PR 21793,
    # docs/llama-server-facts.md#anthropic-billing-header). The view must render the same.
    if not text.startswith(_BILLING):
        return text
    at = text.find("cch=", len(_BILLING))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5 :]
    return text


def _str(obj: object, key: str, default: str = "") -> str:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else default


def _image_url(source: object) -> str | None:
    kind = _str(source, "type")
    if kind == "base64":
        return f"data:{_str(source, 'media_type', 'image/jpeg')};base64,{_str(source, 'data')}"
    if kind == "url":
        return _str(source, "url")
    return None


def _dump(value: object) -> str:
    # llama-server serialises tool_use input compactly, keys in their order, UTF-8 as is.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tool_result(block: Mapping[str, object]) -> JsonObject:
    content = block.get("content")
    out: str | list[JsonObject] = ""
    if isinstance(content, str):
        out = content
    elif isinstance(content, list):
        parts: list[JsonObject] = []
        images = False
        for c in content:
            kind = _str(c, "type")
            if kind == "text":
                parts.append({"type": "text", "text": _str(c, "text")})
            elif kind == "image":
                images = True
                url = _image_url(c.get("source"))
                if url is not None:
                    parts.append({"type": "image_url", "image_url": {"url": url}})
        out = parts if images else "".join(str(p["text"]) for p in parts if p["type"] == "text")
    return {"role": "tool", "tool_call_id": _str(block, "tool_use_id"), "content": out}


def _anthropic_message(msg: object, out: list[JsonObject]) -> None:
    if not isinstance(msg, dict):
        raise ConversionError("each message must be an object")
    role = _str(msg, "role")
    content = msg.get("content")
    if "content" not in msg:
        if role != "assistant":
            out.append(msg)
        return
    if not isinstance(content, list):
        out.append(msg)
        return
    parts: list[object] = []
    calls: list[JsonObject] = []
    results: list[JsonObject] = []
    reasoning = ""
    for block in content:
        kind = _str(block, "type")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += _str(block, "thinking")
        elif kind == "image":
            url = _image_url(block.get("source"))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            args = block.get("input")
            calls.append(
                {
                    "id": _str(block, "id"),
                    "type": "function",
                    "function": {
                        "name": _str(block, "name"),
                        "arguments": _dump({} if args is None else args),
                    },
                }
            )
        elif kind == "tool_result":
            results.append(_tool_result(block))
    if parts or calls or reasoning:
        new: JsonObject = {"role": role, "content": parts or ""}
        if calls:
            new["tool_calls"] = calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    out.extend(results)


def _from_messages(body: Mapping[str, object]) -> ChatView:
    messages: list[JsonObject] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            text = _billing_normalized(system)
        elif isinstance(system, list):
            text = "".join(
                _billing_normalized(_str(b, "text")) for b in system if _str(b, "type") == "text"
            )
        else:
            text = ""
        messages.append({"role": "system", "content": text})
    if "messages" not in body:
        raise ConversionError("'messages' is required")
    raw = body["messages"]
    if isinstance(raw, list):
        for msg in raw:
            _anthropic_message(msg, messages)
    view: JsonObject = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        view["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _str(t, "name"),
                    "description": _str(t, "description"),
                    "parameters": t.get("input_schema", {}) if isinstance(t, dict) else {},
                },
            }
            for t in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _str(choice, "type")
        if kind == "auto":
            view["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            view["tool_choice"] = "required"
    if "chat_template_kwargs" in body:
        view["chat_template_kwargs"] = body["chat_template_kwargs"]
    return ChatView("messages", view, _str(body.get("metadata"), "user_id"))


# ------------------------------------------------------------ OpenAI Responses
def _input_parts(content: list[Any]) -> list[JsonObject]:
    parts: list[JsonObject] = []
    for part in content:
        kind = _str(part, "type")
        if kind == "input_text":
            if not isinstance(part, dict) or "text" not in part:
                raise ConversionError("'Input text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:
                raise ConversionError("'image_url' is required")
            parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        else:
            raise ConversionError(f"unsupported input content type {kind!r}")
    return parts


def _output_parts(item: Mapping[str, object]) -> list[JsonObject]:
    content = item.get("content")
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    parts: list[JsonObject] = []
    for part in content if isinstance(content, list) else []:
        kind = _str(part, "type")
        if kind in ("output_text", "input_text") and isinstance(part.get("text"), str):
            parts.append({"text": part["text"], "type": "text"})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise ConversionError(f"unsupported output content type {kind!r}")
    return parts


def _tool_output(item: Mapping[str, object]) -> JsonObject:
    output = item["output"]
    if isinstance(output, list):
        converted: list[JsonObject] = []
        for part in output:
            kind = _str(part, "type")
            if kind == "input_text":
                converted.append({**part, "type": "text"})
            elif kind == "input_image" and "image_url" in part:
                url = {"url": part["image_url"]}
                converted.append({**part, "type": "image_url", "image_url": url})
            else:
                raise ConversionError("a tool output part must be input_text or input_image")
        output = converted
    return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}


def _responses_item(given: object, msgs: list[JsonObject]) -> None:
    if not isinstance(given, dict):
        raise ConversionError("each input item must be an object")
    merge = bool(msgs) and msgs[-1].get("role") == "assistant"
    item: JsonObject = dict(given)
    kind, role = _str(item, "type"), _str(item, "role")
    if isinstance(item.get("content"), str):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    content = item.get("content")
    if isinstance(content, list) and role in ("user", "system", "developer"):
        item["content"] = _input_parts(content)
        item.pop("type", None)
        item.pop("status", None)
        msgs.append(item)
    elif role == "assistant" and kind == "message":
        parts = _output_parts(item)
        if merge:
            prev = msgs[-1]
            before = prev.get("content")
            prev["content"] = [*(before if isinstance(before, list) else []), *parts]
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            msgs.append(item)
    elif kind == "function_call" and all(
        isinstance(item.get(k), str) for k in ("arguments", "call_id", "name")
    ):
        call = {
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        }
        if merge:
            prev = msgs[-1]
            # Spread as it comes: an assistant item's own tool_calls value is the client's.
            earlier: Any = prev.get("tool_calls") or []
            prev["tool_calls"] = [*earlier, call]
        else:
            msgs.append({"role": "assistant", "tool_calls": [call]})
    elif (
        kind == "function_call_output"
        and isinstance(item.get("call_id"), str)
        and isinstance(item.get("output"), str | list)
    ):
        msgs.append(_tool_output(item))
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        content = item.get("content")
        if (
            not isinstance(content, list)
            or not content
            or not isinstance(_first_text(content), str)
        ):
            raise ConversionError("a reasoning item needs content[0].text")
        if merge:
            msgs[-1]["reasoning_content"] = _first_text(content)
        else:
            msgs.append(
                {"role": "assistant", "content": [], "reasoning_content": _first_text(content)}
            )
    else:
        raise ConversionError("cannot determine the type of an input item")


def _first_text(content: list[object]) -> object:
    first = content[0]
    return first.get("text") if isinstance(first, dict) else None


def _from_responses(body: Mapping[str, object]) -> ChatView:
    if "input" not in body:
        raise ConversionError("'input' is required")
    if _str(body, "previous_response_id"):
        raise ConversionError("llama.cpp does not support 'previous_response_id'")
    msgs: list[JsonObject] = []
    if "instructions" in body:
        msgs.append({"role": "system", "content": _str(body, "instructions")})
    given = body["input"]
    if isinstance(given, str):
        msgs.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _responses_item(item, msgs)
    else:
        raise ConversionError("'input' must be a string or an array of objects")
    view: JsonObject = {"messages": msgs}
    if "tools" in body:
        tools = body["tools"]
        if not isinstance(tools, list):
            raise ConversionError("'tools' must be an array of objects")
        converted: list[JsonObject] = []
        for tool in tools:
            if _str(tool, "type") != "function":
                continue  # llama-server skips non-function tools too
            fn = {k: v for k, v in tool.items() if k != "type"}
            fn.setdefault("strict", True)
            converted.append({"type": "function", "function": fn})
        if converted:
            view["tools"] = converted
    for key in ("tool_choice", "chat_template_kwargs"):
        if key in body:
            view[key] = body[key]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and "effort" in reasoning:
        view["reasoning_effort"] = reasoning["effort"]
    elif "reasoning_effort" in body and "reasoning" not in body:
        view["reasoning_effort"] = body["reasoning_effort"]
    return ChatView("responses", view)


# ------------------------------------------------------------ reuse numbers from `usage`
def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_timings(obj: Any) -> dict[str, Any] | None:
    """Reuse numbers in `timings` form (``prompt_n``, ``cache_n``, ``predicted_n``) from
    the ``usage`` of an Anthropic or Responses answer or stream event, for a server that
    sends no ``timings`` there (stock llama-server on /v1/messages). None when `obj`
    carries no input-token usage.

    Anthropic counts ``input_tokens`` without the reused ``cache_read_input_tokens``;
    Responses counts all in ``input_tokens``, the reused in
    ``input_tokens_details.cached_tokens``.
    """
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "message_start" and isinstance(obj.get("message"), dict):
        obj = obj["message"]
    elif obj.get("type") == "response.completed" and isinstance(obj.get("response"), dict):
        obj = obj["response"]
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    inp = _int(usage.get("input_tokens"))
    if inp is None:
        return None
    out = _int(usage.get("output_tokens")) or 0
    cached = _int(usage.get("cache_read_input_tokens"))
    if cached is not None:  # Anthropic
        return {"prompt_n": inp, "cache_n": cached, "predicted_n": out, "source": "usage"}
    details = usage.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    cached = min(cached or 0, inp)
    return {"prompt_n": inp - cached, "cache_n": cached, "predicted_n": out, "source": "usage"}
