"""The cache inventory as text (`warmslot status`) and the doctor's template line."""

from __future__ import annotations

import time

from core import fmt
from core.cache import background as bg
from core.status import BootRewarmStatus, CacheStatus, CacheWarmth, Status, cache_of


def warmth(st: CacheStatus) -> CacheWarmth:
    """Whether the cache is warm, and why: the one verdict the CLI and the tray show.

    Cold while the cache is off, the server's identity is not known yet, or the boot
    re-warm (or a restore) still runs; cold, naming the cause, when a prefix the boot
    re-warm should have brought back failed and no slot holds it now. Warm otherwise:
    what was brought back, or prefixes warm as clients send them. A prefix that client
    requests later displaced is not "cold": that is the slots doing their work."""
    if not st["enabled"]:
        return {"warm": False, "why": "cache management is off (cache.enabled)"}
    if st["identity"] is None:
        return {"warm": False, "why": "learning the server's identity"}
    boot = st["boot_rewarm"]
    if boot["state"] == "running":
        return {
            "warm": False,
            "why": f"re-warming recently used prefixes: {boot['done']} of {boot['total']} done",
        }
    if st["warming"]:
        return {"warm": False, "why": "restoring or prewarming prefixes"}
    held = {s["prefix"] for s in st["slots"] if s["prefix"]}
    lost = [f for f in boot.get("failures", []) if f["fingerprint"] not in held]
    if lost:
        first = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        return {
            "warm": False,
            "why": f"could not bring prefix {first['fingerprint']} back into slot "
            f"{first['slot']}: {first['reason']}{more}",
        }
    if boot["state"] == "done" and boot["warmed"]:
        n = boot["warmed"]
        return {"warm": True, "why": f"{n} recently used prefix{'es' if n > 1 else ''} warm"}
    return {"warm": True, "why": "ready; prefixes warm as clients send them"}


def format_inventory(st: CacheStatus) -> str:
    """The inventory in words: slots, prefixes, saved states, the last divergence."""
    lines = [f"WARNING: {st['template_warning']}"] if st["template_warning"] else []
    lines += [
        f"cache: identity {st['identity']}; disk tier "
        f"{'on' if st['disk_tier']['usable'] else 'off'} — {st['disk_tier']['reason']}"
    ]
    for route, why in st["unmanaged_apis"].items():
        lines.append(f"  {route}: forwarded unmanaged (accounting only) — {why}")
    if (verdict := st.get("warmth")) is not None:
        lines.append(f"  {'warm' if verdict['warm'] else 'cold'}: {verdict['why']}")
    boot = boot_rewarm_text(st["boot_rewarm"])
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
        if r["kind"] == "conversation":  # core.cache.conversations
            what = f"conversation of {r['client'] or '—'} session {r['session'] or '—'}"
        lines.append(
            f"  {what} {r['file']}: {r['tokens']} tokens, {fmt.size(r['bytes'])}, "
            f"{r['ttl_class']}{', pinned' if r['pinned'] else ''}, {verified_words(r['verified'])}"
            f"{bg.expiry_text(r)}"
        )
    if st["divergences"]:
        d = st["divergences"][0]
        lines.append(f"  last divergence ({d['client']}): {d['reason']}")
        if (w := d["where"]) is not None:
            lines.append(
                f"    at token {w.get('token_index')}: …{w['before'][-40:]!r} "
                f"then {w['old'][:40]!r} → {w['new'][:40]!r}"
            )
    if st["restore_shortfalls"]:
        lines.append(f"  last restore that did not pay: {st['restore_shortfalls'][0]['text']}")
    limits = st["context_limits"]
    if limits["recent"]:
        lines.append(
            f"  requests that hit the slot's context: {limits['total']}; last: "
            f"{limits['recent'][0]['text']}"
        )
    return "\n".join(lines)


def verified_words(result: str) -> str:
    """A saved state's check in words (its ``verified`` in the status JSON): "reference"
    is the known-answer probe recorded when it was saved, "ok" a restore that gave that
    answer back since; anything else is why the last check failed."""
    if result == "reference":
        return "probe answer recorded at save, not restored since"
    if result == "pending":
        return "written; its probe answer is recorded at the next quiet moment or restore"
    if result == "ok":
        return "verified: its last restore gave the recorded answer"
    return f"last check: {result}" if result else "not checked"


def boot_rewarm_text(boot: BootRewarmStatus | None) -> str:
    """The boot re-warm's progress in words ("" before a server has started)."""
    if not boot or boot["state"] == "idle":
        return ""
    total = boot["total"]
    if boot["state"] == "running":
        now = f" (slot {boot['current_slot']} now)" if boot["current_slot"] is not None else ""
        return (
            f"re-warming recently used prefixes after the server start: "
            f"{boot['done']} of {total} done{now}"
        )
    if total == 0:
        return "boot re-warm: no known prefixes to re-warm after the server start"
    when, began = boot["finished_at"], boot["started_at"]
    at = time.strftime(" at %H:%M:%S", time.localtime(when)) if when else ""
    took = f" in {when - began:.1f} s" if when and began else ""
    extra = [
        f"{n} {word}" for n, word in ((boot["skipped"], "skipped"), (boot["failed"], "failed")) if n
    ]
    how = "".join(f"\n  slot {s['slot']}: {s['text']}" for s in boot.get("sources", []))
    return (
        f"boot re-warm finished{at}{took}: {boot['warmed']} of {total} prefixes warm"
        + (f", {', '.join(extra)}" if extra else "")
        + how
    )


def doctor_lines(status: Status | None) -> list[str]:
    """Lines for `warmslot doctor`: the chat template check of the running server."""
    cache = cache_of(status)
    warning = cache["template_warning"] if cache is not None else None
    unmanaged = cache["unmanaged_apis"] if cache is not None else {}
    apis = [f"apis:        ✘ {r}: {why}" for r, why in unmanaged.items()]
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
