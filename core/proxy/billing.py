"""Claude Code's attribution line, taken out of a Messages body (`proxy.strip_billing_header`).

Claude Code opens its system text with ``x-anthropic-billing-header: cc_version=…;
cc_entrypoint=…;``: request metadata to Anthropic's API, nothing to a local model, but its
version suffix changes with every session, so every new session's prompt would leave every
slot at the system text's first token (docs/clients.md#claude-code). The proxy takes it out
before anything reads the body (`core.proxy.intake`); the edit is named in
``X-Warmslot-Edited`` and in `warmslot explain`.
"""

from __future__ import annotations

import re

from core.chat import JsonObject

__all__ = ["BILLING_HEADER_EDIT", "strip_billing_header"]

# The attribution line itself: the tag, then `key=value;` fields (cc_version, cc_entrypoint,
# cch …), up to the last `;` and an optional line end. Whatever follows on the same
# line (upstream PR 21793's example runs straight on into "You are Claude Code") is
# system text and stays.
_BILLING_LINE = re.compile(
    r"x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\n]*;)*[ \t]*\n?"
)
BILLING_HEADER_EDIT = "billing-header"  # the edit's name in X-Warmslot-Edited and explain


def strip_billing_header(body: JsonObject) -> list[str]:
    """Take Claude Code's attribution line out of a Messages body's system text, in place.

    Claude Code opens its system text with ``x-anthropic-billing-header: cc_version=…;
    cc_entrypoint=…;`` (plus ``cch=…;`` when logged in). Anthropic's API reads it as
    request metadata; to a local model it means nothing, but its version suffix changes
    with every session (and ``cch`` with every request), so a new session's prompt
    leaves every slot at the first token of the system text. Only a system text (a
    string, or each text block) that *starts* with the line is edited; a block left
    empty is dropped. Returns the lines removed ([] when the body had none).
    """
    system = body.get("system")
    removed: list[str] = []
    if isinstance(system, str):
        m = _BILLING_LINE.match(system)
        if m:
            removed.append(m.group(0))
            body["system"] = system[m.end() :]
        return removed
    if not isinstance(system, list):
        return removed
    blocks: list[object] = []
    for block in system:
        text = block.get("text") if isinstance(block, dict) else None
        m = _BILLING_LINE.match(text) if isinstance(text, str) else None
        if m is None or not isinstance(text, str) or block.get("type") != "text":
            blocks.append(block)
            continue
        removed.append(m.group(0))
        if m.end() < len(text):
            blocks.append({**block, "text": text[m.end() :]})
    if removed:
        body["system"] = blocks
    return removed
