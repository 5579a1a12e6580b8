"""What the proxy accepts: strict JSON bodies of the right shape, from callers it serves.

`parse_json` and `validate` turn malformed input into `Invalid` (a 4xx in OpenAI's
error format, nothing forwarded); the "who may call" checks refuse foreign Host and
Origin headers and non-JSON content types (docs/security.md). Pure functions: the
proxy (`core.proxy.app`) calls them and answers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from yarl import URL

from core.config.checks import is_loopback
from core.server.quarantine import Quarantined


class Invalid(Exception):
    """A request the proxy refuses: its status, message and the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


# Deeper JSON than this is refused: real requests (tool schemas included) stay far
# below, and Python's own parser and encoder give up near 1,000 levels.
MAX_DEPTH = 128
# Bodies larger than this are parsed and encoded on a worker thread, not the event
# loop (a 30 MB body takes the loop ~1 s to parse).
THREAD_BYTES = 256 * 1024


def _reject_constant(name: str) -> Any:
    # json.loads accepts NaN/Infinity/-Infinity, which are not JSON: llama-server
    # answers them with a 500. Refused here instead, in the API's shape, as a 400.
    raise Invalid(400, f"malformed JSON: {name} is not a JSON value")


def parse_json(raw: bytes | bytearray) -> Any:
    """The JSON value of a request body; raises Invalid (400) for anything that is not
    strict JSON: bad syntax or encoding, NaN/Infinity, nesting deeper than MAX_DEPTH."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise Invalid(400, f"malformed JSON: nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise Invalid(400, f"malformed JSON: not UTF-8 text ({e.reason})") from None
    except ValueError as e:
        raise Invalid(400, f"malformed JSON: {e}") from None
    # Only a body with enough brackets can be that deep: skip the walk for the others.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _too_deep(body):
        raise Invalid(400, f"malformed JSON: nested deeper than {MAX_DEPTH} levels")
    # A \uD800-\uDFFF escape on its own is not a character: Python keeps it as a lone
    # surrogate that no UTF-8 encoder (hashing, logging, SQLite) accepts. Only a body
    # with such an escape is walked; escaped pairs (emoji from ASCII-only encoders)
    # decode to whole characters and pass.
    if _SURROGATE_ESCAPE.search(raw) and not _all_text(body):
        raise Invalid(400, "malformed JSON: a \\u escape that is half a surrogate pair")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _all_text(value: Any) -> bool:
    """True when every string (keys too) in `value` encodes as UTF-8 (no recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _too_deep(value: Any) -> bool:
    """True when `value` nests lists/objects more than MAX_DEPTH levels (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# Common optional fields and the check each must pass when present and not null.
_FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "cache_prompt": (lambda v: isinstance(v, bool), "a boolean"),
    # A boolean in chat; an integer (how many) in the legacy completions API.
    "logprobs": (lambda v: isinstance(v, bool) or _is_int(v), "a boolean or an integer"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "max_tokens": (_is_int, "an integer"),
    "n_predict": (_is_int, "an integer"),
    "max_completion_tokens": (_is_int, "an integer"),
    "n": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    "top_k": (_is_number, "a number"),  # llama-server takes 40.0 as 40
    "top_logprobs": (_is_int, "an integer"),
    "n_probs": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "min_p": (_is_number, "a number"),
    "typical_p": (_is_number, "a number"),
    "presence_penalty": (_is_number, "a number"),
    "frequency_penalty": (_is_number, "a number"),
    "repeat_penalty": (_is_number, "a number"),
    "stop": (
        lambda v: (
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        ),
        "a string or an array of strings",
    ),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "response_format": (lambda v: isinstance(v, dict), "an object"),
    "json_schema": (lambda v: isinstance(v, dict), "an object"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
    "grammar": (lambda v: isinstance(v, str), "a string"),
    "tool_choice": (lambda v: isinstance(v, str | dict), "a string or an object"),
    "logit_bias": (lambda v: isinstance(v, dict | list), "an object or an array"),
}
# Content parts llama-server accepts besides text: the part's type names the object
# holding the media (docs: OpenAI's chat format; llama.cpp tools/server).
_MEDIA_PARTS = ("image_url", "input_audio", "input_video", "video_url")


def _check_content(where: str, content: Any) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise Invalid(
            400, f"{where}.content must be a string, an array of content parts or null", "messages"
        )
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise Invalid(400, f"{at} must be an object with a string 'type'", "messages")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise Invalid(400, f"{at}.text must be a string", "messages")
        elif kind in _MEDIA_PARTS:
            media = part.get(kind)
            if not isinstance(media, dict) or not isinstance(
                media.get("url", media.get("data")), str
            ):
                raise Invalid(
                    400, f"{at}.{kind} must be an object with a string 'url' or 'data'", "messages"
                )
        else:
            raise Invalid(
                400,
                f"{at}: unsupported content part type {kind!r} (one of: text, "
                + ", ".join(_MEDIA_PARTS)
                + ")",
                "messages",
            )


def _check_function(where: str, fn: Any, param: str, *, call: bool) -> None:
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Invalid(400, f"{where}.function must be an object with a string 'name'", param)
    if call:
        if not isinstance(fn.get("arguments"), str | dict):
            raise Invalid(400, f"{where}.function.arguments must be a string or an object", param)
        return
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise Invalid(400, f"{where}.function.description must be a string", param)
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise Invalid(400, f"{where}.function.parameters must be an object", param)


def _check_messages(msgs: Any) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise Invalid(400, "'messages' must be a non-empty array", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Invalid(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        if "content" not in m and "tool_calls" not in m:
            raise Invalid(400, f"messages[{i}] needs 'content' or 'tool_calls'", "messages")
        _check_content(f"messages[{i}]", m.get("content"))
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise Invalid(400, f"messages[{i}].tool_calls must be an array", "messages")
        for j, call in enumerate(calls):
            at = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call, dict) or call.get("type", "function") != "function":
                raise Invalid(400, f"{at} must be an object of type 'function'", "messages")
            _check_function(at, call.get("function"), "messages", call=True)


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise Invalid(400, "'tools' must be an array", "tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise Invalid(400, f"tools[{i}] must be an object with type 'function'", "tools")
        _check_function(f"tools[{i}]", tool.get("function"), "tools", call=False)


def _check_blocks(where: str, blocks: Any, param: str) -> None:
    if not isinstance(blocks, list):
        raise Invalid(400, f"{where} must be a string or an array of content blocks", param)
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise Invalid(400, f"{where}[{j}] must be an object with a string 'type'", param)
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise Invalid(400, f"{where}[{j}].text must be a string", param)


def _check_anthropic(body: Mapping[str, object]) -> None:
    """Anthropic Messages: ``messages`` (user/assistant turns of text or content
    blocks), an optional ``system`` (text or text blocks) and ``tools`` (named)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise Invalid(400, "'messages' must be a non-empty array", "messages")
    for i, m in enumerate(msgs):
        # Claude Code 2.1 also sends "system" turns mid-conversation (its agent list,
        # reminders; anthropic-beta mid-conversation-system), which llama-server renders.
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise Invalid(
                400,
                f"messages[{i}] must be an object with role 'user', 'assistant' or 'system'",
                "messages",
            )
        if not isinstance(m.get("content"), str):
            _check_blocks(f"messages[{i}].content", m.get("content"), "messages")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks("'system'", system, "system")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Invalid(400, "'tools' must be an array", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise Invalid(400, f"tools[{i}] must be an object with a string 'name'", "tools")
            schema = tool.get("input_schema")
            if schema is not None and not isinstance(schema, dict):
                raise Invalid(400, f"tools[{i}].input_schema must be an object", "tools")
    for key in ("metadata", "thinking"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise Invalid(400, f"'{key}' must be an object", key)
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(x, str) for x in stops)
    ):
        raise Invalid(400, "'stop_sequences' must be an array of strings", "stop_sequences")


def _check_responses(body: Mapping[str, object]) -> None:
    """OpenAI Responses: ``input`` (text or an array of items), optional ``instructions``
    (text) and ``tools`` (objects with a ``type``)."""
    given = body.get("input")
    if isinstance(given, list):
        for i, item in enumerate(given):
            if not isinstance(item, dict):
                raise Invalid(400, f"input[{i}] must be an object", "input")
    elif not isinstance(given, str):
        raise Invalid(400, "'input' must be a string or an array of items", "input")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise Invalid(400, "'instructions' must be a string", "instructions")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Invalid(400, "'tools' must be an array", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise Invalid(400, f"tools[{i}] must be an object with a string 'type'", "tools")
            if tool["type"] == "function" and not isinstance(tool.get("name"), str):
                raise Invalid(400, f"tools[{i}] (a function) needs a string 'name'", "tools")
    for key in ("max_output_tokens",):
        if body.get(key) is not None and not _is_int(body[key]):
            raise Invalid(400, f"'{key}' must be an integer", key)
    if body.get("reasoning") is not None and not isinstance(body["reasoning"], dict):
        raise Invalid(400, "'reasoning' must be an object", "reasoning")


# Output limits in the client APIs' bodies. llama-server answers 0 with a token anyway
# (measured: docs/llama-server-facts.md#an-output-limit-of-0), so 0 is refused there like
# OpenAI and Anthropic refuse it; llama.cpp's own /completion keeps its n_predict 0.
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
_LIMITED_ENDPOINTS = ("chat", "messages", "responses", "completions")


def _check_limits(endpoint: str, body: Mapping[str, object]) -> None:
    if endpoint not in _LIMITED_ENDPOINTS:
        return
    for key in _LIMIT_FIELDS:
        if body.get(key) == 0 and _is_int(body.get(key)):
            raise Invalid(
                400,
                f"'{key}' must be at least 1 (or -1 for no limit): llama-server "
                "answers a limit of 0 with a token anyway",
                key,
            )


def token_ids(endpoint: str, body: Mapping[str, object]) -> list[int]:
    """The token ids a /tokenize (mixed ``content``) or /detokenize (``tokens``) body
    holds; [] for other endpoints."""
    if endpoint == "detokenize":
        tokens = body.get("tokens")
    elif endpoint == "tokenize":
        tokens = body.get("content")
    else:
        return []
    return [t for t in tokens if _is_int(t)] if isinstance(tokens, list) else []


def check_token_ids(endpoint: str, body: Mapping[str, object], n_vocab: int) -> None:
    """Raise Invalid (400) for a token id outside the model's vocabulary: llama-server
    answers one with a 500 (``vector::_M_range_check``)."""
    for t in token_ids(endpoint, body):
        if not 0 <= t < n_vocab:
            param = "tokens" if endpoint == "detokenize" else "content"
            raise Invalid(
                400, f"token id {t} is outside the model's vocabulary (0..{n_vocab - 1})", param
            )


def validate(endpoint: str, body: Any, n_slots: int) -> None:
    """Raise Invalid for malformed bodies; nothing invalid is forwarded.

    The one place that checks a body's shape: what llama-server would answer with a
    500 (or misread) is refused here with a 400 naming the field.
    """
    if not isinstance(body, dict):
        raise Invalid(400, "request body must be a JSON object")
    if endpoint in ("chat", "apply-template", "chat-count"):
        _check_messages(body.get("messages"))
        _check_tools(body.get("tools"))
    elif endpoint in ("messages", "messages-count"):
        _check_anthropic(body)
    elif endpoint in ("responses", "responses-count"):
        _check_responses(body)
    elif endpoint in ("completions", "completion"):
        if "prompt" not in body or not isinstance(body["prompt"], str | list):
            raise Invalid(400, "'prompt' must be a string or an array", "prompt")
    elif endpoint == "embeddings":
        key = "input" if "input" in body else "content"
        if not isinstance(body.get(key), str | list):
            raise Invalid(400, "'input' must be a string or an array", "input")
    elif endpoint == "tokenize":
        if not isinstance(body.get("content"), str | list):
            raise Invalid(400, "'content' must be a string or an array", "content")
    elif endpoint == "detokenize":
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
            raise Invalid(400, "'tokens' must be an array of token ids (integers ≥ 0)", "tokens")
    for key, (ok, what) in _FIELD_TYPES.items():
        value = body.get(key)
        if value is not None and not ok(value):
            raise Invalid(400, f"'{key}' must be {what}", key)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise Invalid(400, "'stream' must be a boolean", "stream")
    _check_limits(endpoint, body)
    if "id_slot" in body:
        slot = body["id_slot"]
        if not _is_int(slot):
            raise Invalid(400, "'id_slot' must be an integer", "id_slot")
        # llama-server wraps ids modulo the slot count: reject instead
        # (docs/llama-server-facts.md#slot-ids-wrap).
        if slot != -1 and not 0 <= slot < n_slots:
            raise Invalid(400, f"'id_slot' must be -1 or 0..{n_slots - 1}, got {slot}", "id_slot")


def crashed_before(hit: Quarantined, now: float) -> Invalid:
    """The 422 for a body that was in flight when llama-server crashed
    (`core.server.quarantine`): sent again, it would crash it again."""
    return Invalid(
        422,
        f"Warmslot: this exact request crashed llama-server ({hit.what}) "
        f"{max(0.0, now - hit.at):.0f} s ago and is refused for another "
        f"{max(0.0, hit.until - now) / 60:.0f} min; other requests are served "
        "(docs/security.md#requests-that-crash-the-server)",
    )


# ------------------------------------------------------------ who may call
def host_name(host_header: str) -> str:
    """The name or address of a Host header, without its port ("[::1]:80" → "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.rsplit(":", 1)[0]
    return host


def origin_allowed(origin: str, allowed: Sequence[str]) -> bool:
    """A loopback origin (http or https, any port), or one the user allowed."""
    if origin.rstrip("/").lower() in {a.rstrip("/").lower() for a in allowed}:
        return True
    try:
        url = URL(origin)
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.host) and is_loopback(url.host or "")


def is_json_type(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )
