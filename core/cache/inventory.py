"""The cache inventory as text (`warmslot status`) and the doctor's template line."""

from __future__ import annotations

import time
from typing import Any

from core.cache import background as bg


def format_inventory(st: dict[str, Any]) -> str:
    lines = [f"WARNING: {st['template_warning']}"] if st.get("template_warning") else []
    lines += [
        f"cache: identity {st['identity']}; disk tier "
        f"{'on' if st['disk_tier']['usable'] else 'off'} — {st['disk_tier']['reason']}"
    ]
    for route, why in (st.get("unmanaged_apis") or {}).items():
        lines.append(f"  {route}: forwarded unmanaged (accounting only) — {why}")
    boot = boot_rewarm_text(st.get("boot_rewarm"))
    if boot:
        lines.append(f"  {boot}")
    for s in st["slots"]:
        role = " (side calls)" if s["id"] == st["aux_slot"] else ""
        lines.append(
            f"  slot {s['id']}{role}: {s['tokens']} tokens, prefix "
            f"{s['prefix'] or '—'}, session {s['session'] or '—'}{bg.expiry_text(s)}"
        )
    for p in st["prefixes"]:
        lines.append(
            f"  prefix {p['fingerprint']} {p['client']}: {p['tokens']} tokens "
            f"({_share(p['share'])} of the prompt, {p['source']})"
        )
    for r in st["saved"][:10]:
        what = "saved"
        if r.get("kind") == "conversation":  # core.cache.conversations
            what = f"conversation of {r.get('client') or '—'} session {r.get('session') or '—'}"
        lines.append(
            f"  {what} {r['file']}: {r['tokens']} tokens, {r['bytes'] / 1e6:.1f} MB, "
            f"{r['ttl_class']}{', pinned' if r['pinned'] else ''}, {r['verified']}"
            f"{bg.expiry_text(r)}"
        )
    if st["divergences"]:
        d = st["divergences"][0]
        lines.append(f"  last divergence ({d['client']}): {d['reason']}")
        if d.get("where"):
            w = d["where"]
            lines.append(
                f"    at token {w.get('token_index')}: …{w['before'][-40:]!r} "
                f"then {w['old'][:40]!r} → {w['new'][:40]!r}"
            )
    if st.get("restore_shortfalls"):
        lines.append(f"  last restore that did not pay: {st['restore_shortfalls'][0]['text']}")
    limits = st.get("context_limits") or {}
    if limits.get("recent"):
        lines.append(
            f"  requests that hit the slot's context: {limits['total']}; last: "
            f"{limits['recent'][0]['text']}"
        )
    return "\n".join(lines)


def boot_rewarm_text(boot: dict[str, Any] | None) -> str:
    """The boot re-warm's progress in words ("" before a server has started)."""
    if not boot or boot.get("state") == "idle":
        return ""
    total = boot["total"]
    if boot["state"] == "running":
        now = f" (slot {boot['current_slot']} now)" if boot.get("current_slot") is not None else ""
        return (
            f"re-warming recently used prefixes after the server start: "
            f"{boot['done']} of {total} done{now}"
        )
    if total == 0:
        return "boot re-warm: no known prefixes to re-warm after the server start"
    when = boot.get("finished_at")
    at = time.strftime(" at %H:%M:%S", time.localtime(when)) if when else ""
    took = ""
    if when and boot.get("started_at"):
        took = f" in {when - boot['started_at']:.1f} s"
    extra = [
        f"{boot[k]} {word}"
        for k, word in (("skipped", "skipped"), ("failed", "failed"))
        if boot.get(k)
    ]
    return f"boot re-warm finished{at}{took}: {boot['warmed']} of {total} prefixes warm" + (
        f", {', '.join(extra)}" if extra else ""
    )


def doctor_lines(paths: Any, settings: Any, status: dict[str, Any] | None) -> list[str]:
    """Lines for `warmslot doctor`: the chat template check of the running server."""
    cache = (status or {}).get("cache") or {}
    warning = cache.get("template_warning")
    apis = [f"apis:        ✘ {r}: {why}" for r, why in (cache.get("unmanaged_apis") or {}).items()]
    if warning:
        return [
            *apis,
            f"template:    ✘ {warning}",
            "             → set server.chat_template_file (for Gemma 3: "
            "resources/templates/gemma3-tools.jinja)",
        ]
    if status is None:
        return ["template:    (checked once a request with tools runs through a running server)"]
    return [*apis, "template:    ✔ no dropped tools seen"]


def _share(share: float | None) -> str:
    return "—" if share is None else f"{share * 100:.0f} %"
