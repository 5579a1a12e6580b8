"""Reading llama-server's answers as they pass through the proxy, without buffering or
parsing them whole: the `timings` and slot of a stream (`SSEScanner`) or of a complete
body, the reuse numbers of an Anthropic or Responses `usage`, an upstream error's text."""

from __future__ import annotations

import json
import re
from typing import Any

from core import apis


class SSEScanner:
    """Finds `timings` (and `id_slot`) in an SSE stream without buffering it.

    With ``timings_per_token`` every event carries `timings`: only the last such line is
    kept, and parsed when asked for (`timings`, `id_slot`)."""

    def __init__(self) -> None:
        self._tail = b""
        self._last = b""  # the last event line with `timings`, unparsed
        self._parsed: tuple[bytes, dict[str, Any]] | None = None
        self.upstream_error: str | None = None
        # For a stream without `timings` (stock llama-server's Anthropic stream): the last
        # event lines with input and with output token `usage`, unparsed.
        self._usage_in = b""
        self._usage_out = b""

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            if b'"error"' in line:
                try:
                    obj = json.loads(line[6:])
                except ValueError:
                    continue
                if isinstance(obj.get("error"), dict):
                    self.upstream_error = str(obj["error"].get("message", ""))
            if b'"timings"' in line:
                self._last = line
            if b'"usage"' in line:
                if b'"input_tokens"' in line:
                    self._usage_in = line
                if b'"output_tokens"' in line:
                    self._usage_out = line

    def _last_event(self) -> dict[str, Any]:
        if self._parsed is None or self._parsed[0] is not self._last:
            try:
                obj = json.loads(self._last[6:]) if self._last else {}
            except ValueError:
                obj = {}
            self._parsed = (self._last, obj if isinstance(obj, dict) else {})
        return self._parsed[1]

    @property
    def timings(self) -> dict[str, Any] | None:
        """The `timings` of the last event that had them; without any, the reuse numbers
        of the stream's `usage` (`core.apis.usage_timings`)."""
        t = self._last_event().get("timings")
        if isinstance(t, dict):
            return t
        return stream_usage(self._usage_in, self._usage_out) if self._usage_in else None

    @property
    def id_slot(self) -> int | None:
        """The slot llama-server named in that event (raw completions name it)."""
        slot = self._last_event().get("id_slot")
        return slot if isinstance(slot, int) and slot >= 0 else None


_ID_SLOT_RE = re.compile(rb'"id_slot":\s*(\d+)')


def timings_from_json(data: bytes) -> tuple[dict[str, Any] | None, int | None]:
    """`timings` and `id_slot` of a completed response, without parsing all of it.

    Responses can be large (``/completion`` echoes the prompt); ``timings`` is a flat
    object of numbers, so it is cut out and parsed alone.
    """
    timings: dict[str, Any] | None = None
    start = data.rfind(b'"timings":')
    if start >= 0:
        begin = data.find(b"{", start)
        end = data.find(b"}", begin)
        if begin >= 0 and end > begin:
            try:
                parsed = json.loads(data[begin : end + 1])
            except ValueError:
                parsed = None
            timings = parsed if isinstance(parsed, dict) else None
    m = _ID_SLOT_RE.search(data)
    return timings, int(m.group(1)) if m else None


def usage_in_body(data: bytes) -> dict[str, Any] | None:
    """Reuse numbers from the `usage` of a whole Anthropic or Responses answer."""
    try:
        return apis.usage_timings(json.loads(data))
    except ValueError:
        return None


def stream_usage(input_line: bytes, output_line: bytes) -> dict[str, Any] | None:
    """Reuse numbers from a stream's `usage` event lines (``data: {…}``): Anthropic sends
    the input counts in ``message_start`` and the output count in ``message_delta``."""
    try:
        usage = apis.usage_timings(json.loads(input_line[6:]))
        out = json.loads(output_line[6:]) if output_line else {}
    except ValueError:
        return None
    if usage is None:
        return None
    inner = out.get("usage") if isinstance(out, dict) else None
    n = inner.get("output_tokens") if isinstance(inner, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and n > usage["predicted_n"]:
        usage["predicted_n"] = n
    return usage


def error_text(data: bytes) -> str:
    """The message of an upstream error body (its first 500 characters otherwise)."""
    try:
        obj = json.loads(data)
        return str(obj["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return data[:500].decode("utf-8", errors="replace")
