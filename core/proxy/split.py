"""What the client reads of a request whose prompt Warmslot read in two parts.

On a model that rewinds only to a checkpoint, the cache manager reads a first turn's
stable prefix alone just before the request (core.cache.boundary). llama-server then
reports that prefix as cached for the request itself — ``timings.cache_n``,
``usage.prompt_tokens_details.cached_tokens``, ``usage.cache_read_input_tokens`` — while
it was read for this request, seconds before. The headers and telemetry count it as
prefill (`Reuse.with_split`, `Timings.with_split`); this module makes the answer's own
numbers say the same, so a client does not show cache reads and a lower cost for a cold
turn (docs/cache.md#response-headers).

Every number is moved, never invented: ``min(split.prompt_n, cached)`` tokens go from
the cached count to the prefilled count, and the split's ``prompt_ms`` is added to the
prompt time. Totals (``prompt_tokens``, Responses' ``input_tokens``) stay as they are.
"""

from __future__ import annotations

import json
from typing import Any

from core.server.client import Timings


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _move_timings(t: dict[str, Any], split: Timings) -> bool:
    cached, prompt_n = _int(t.get("cache_n")), _int(t.get("prompt_n"))
    if cached is None or prompt_n is None:
        return False
    moved = min(split.prompt_n, cached)
    t["cache_n"] = cached - moved
    t["prompt_n"] = prompt_n = prompt_n + moved
    ms = t.get("prompt_ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool):
        t["prompt_ms"] = ms = round(ms + split.prompt_ms, 3)
        # llama-server's rates, for the whole prefill (0 for an empty one, as it writes)
        if "prompt_per_token_ms" in t:
            t["prompt_per_token_ms"] = ms / prompt_n if prompt_n else 0.0
        if "prompt_per_second" in t:
            t["prompt_per_second"] = 1e3 * prompt_n / ms if ms else 0.0
    return True


def _move_usage(u: dict[str, Any], split: Timings) -> bool:
    read = _int(u.get("cache_read_input_tokens"))
    if read is not None:  # Anthropic: input_tokens counts what was not read from the cache
        moved = min(split.prompt_n, read)
        u["cache_read_input_tokens"] = read - moved
        u["input_tokens"] = (_int(u.get("input_tokens")) or 0) + moved
        return True
    changed = False
    for key in ("prompt_tokens_details", "input_tokens_details"):  # chat, Responses
        details = u.get(key)
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        if isinstance(details, dict) and cached is not None:
            details["cached_tokens"] = cached - min(split.prompt_n, cached)
            changed = True
    return changed


def count_split(obj: object, split: Timings) -> bool:
    """Move the split's tokens from cached to prefilled in one answer or stream event of
    any API, in place (its ``timings`` and ``usage``, also inside an Anthropic
    ``message`` or a Responses ``response``); True when something was moved."""
    if not isinstance(obj, dict):
        return False
    changed = False
    if isinstance(obj.get("timings"), dict):
        changed |= _move_timings(obj["timings"], split)
    if isinstance(obj.get("usage"), dict):
        changed |= _move_usage(obj["usage"], split)
    for inner in ("message", "response"):
        changed |= count_split(obj.get(inner), split)
    return changed


def _dump(obj: object) -> bytes:
    # As llama-server writes JSON: compact, UTF-8.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def split_body(data: bytes, split: Timings) -> bytes:
    """A whole (non-streamed) answer with the split counted as prefill; `data` as it
    came when it holds no numbers or is not JSON."""
    if b'"timings"' not in data and b'"usage"' not in data:
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    return _dump(obj) if count_split(obj, split) else data


def split_line(line: bytes, split: Timings) -> bytes:
    """One SSE ``data: {…}`` line with the split counted as prefill (other lines, and
    lines without numbers, as they came)."""
    if not line.startswith(b"data: {") or (b'"timings"' not in line and b'"usage"' not in line):
        return line
    try:
        obj = json.loads(line[6:])
    except ValueError:
        return line
    return b"data: " + _dump(obj) if count_split(obj, split) else line
