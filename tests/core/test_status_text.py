"""`warmslot status` in words: sessions apart, and the warning when agents crowd a slot."""

from __future__ import annotations

import time

from core.cli.main import format_status
from tests.fixtures.status_shapes import complete


def test_sessions_and_the_crowding_warning() -> None:
    now = time.time()
    sessions = [
        {"client": "opencode", "session": "ses_a", "requests": 4, "hit_ratio": 0.9, "slot": 0,
         "kinds": "aux,agent", "last_seen": now - 20},
        {"client": "opencode", "session": "ses_b", "requests": 3, "hit_ratio": 0.3, "slot": 0,
         "kinds": "agent", "last_seen": now - 40},
    ]  # fmt: skip
    base = {"server": {"state": "ready", "reason": ""}, "sessions": sessions}
    one_agent_slot = {"slots": [{"id": 0}, {"id": 1}], "aux_slot": 1}
    text = format_status(complete({**base, "cache": one_agent_slot}))
    assert "sessions (last hour):" in text and "ses_a" in text and "ses_b" in text
    assert "warning: 2 agent sessions were active" in text and "1 agent slot:" in text
    roomy = {"slots": [{"id": 0}, {"id": 1}, {"id": 2}], "aux_slot": 2}
    assert "warning:" not in format_status(complete({**base, "cache": roomy}))


def test_the_cache_verdict_is_one_rule_in_words() -> None:
    """`warmth` is what the tray's Warm / Cold and `warmslot status` say: a saved state
    that is a conversation is not a prefix to wait for, a prefix that failed to come back
    makes the cache cold and says why, and one a client later brought back does not."""
    from core.cache.inventory import warmth
    from tests.fixtures.status_shapes import blank_cache

    st = blank_cache()
    st["identity"] = "abc"
    st["slots"] = [
        {"id": 0, "session": "s", "prefix": "", "tokens": 0, "inflight": 0, "kind": "agent"}
    ]
    assert warmth(st) == {"warm": True, "why": "ready; prefixes warm as clients send them"}
    st["saved"] = [
        {
            "file": "ws-conv.bin",
            "fingerprint": "c0ffee0000000000",
            "tokens": 16036,
            "bytes": 1,
            "ttl_class": "long",
            "pinned": False,
            "last_used": 1.0,
            "verified": "reference",
            "current": True,
            "kind": "conversation",
            "session": "s",
            "client": "opencode",
            "created": 1.0,
        }
    ]
    st["boot_rewarm"].update(state="done", total=1, warmed=1)
    st["slots"][0]["prefix"] = "aaaa000000000000"
    assert warmth(st) == {"warm": True, "why": "1 recently used prefix warm"}
    st["boot_rewarm"].update(state="running", done=0, total=2)
    assert warmth(st)["warm"] is False and "0 of 2 done" in warmth(st)["why"]
    st["boot_rewarm"].update(state="done", done=2, warmed=1, failed=1)
    st["boot_rewarm"]["failures"] = [
        {
            "fingerprint": "bbbb000000000000",
            "slot": 1,
            "reason": "400: Prompt contains invalid tokens",
        }
    ]
    assert warmth(st) == {
        "warm": False,
        "why": "could not bring prefix bbbb000000000000 back into slot 1: "
        "400: Prompt contains invalid tokens",
    }
    st["slots"][0]["prefix"] = "bbbb000000000000"  # a client's request warmed it since
    assert warmth(st)["warm"] is True
    st["identity"] = None
    assert warmth(st) == {"warm": False, "why": "learning the server's identity"}
    st["enabled"] = False
    assert warmth(st)["why"] == "cache management is off (cache.enabled)"


def test_a_saved_states_check_is_said_in_words() -> None:
    """`warmslot status` once listed saved states ending in a bare "reference" or "ok"."""
    from core.cache.inventory import format_inventory
    from tests.fixtures.status_shapes import blank_cache

    st = blank_cache()
    row = {
        "file": "ws-a.bin", "fingerprint": "c0ffee0000000000", "tokens": 100, "bytes": 1,
        "ttl_class": "long", "pinned": False, "last_used": 1.0, "current": True,
        "kind": "prefix", "session": "", "client": "opencode", "created": 1.0,
    }  # fmt: skip
    st["saved"] = [{**row, "verified": "reference"}, {**row, "file": "ws-b.bin", "verified": "ok"}]
    text = format_inventory(st)
    assert "ws-a.bin: 100 tokens, 1 B, long, probe answer recorded at save, not restored" in text
    assert "ws-b.bin: 100 tokens, 1 B, long, verified: its last restore gave the recorded" in text
    assert not text.rstrip().endswith((", reference", ", ok"))


def test_with_a_model_pool_each_model_has_its_line() -> None:
    """The models' rows (`ServerRow`, as the backends') in words, only with a pool."""
    single = format_status(complete({}))
    assert "models:" not in single
    (row,) = complete({})["models"]
    loaded = {**row, "name": "coder", "model": "coder", "loads": 1, "unloads": 0}
    gone = {**loaded, "name": "helper", "model": "helper", "ready": False, "port": None}
    gone |= {"state": "failed", "reason": "exit 1", "loads": 2, "unloads": 2}
    calls = {"routed_to_side": 0, "by_model": {"coder": row["calls"], "helper": row["calls"]}}
    text = format_status(complete({"models": [loaded, gone], "model_calls": calls}))
    lines = text.split("\n")
    at = lines.index("models:")
    assert lines[at + 1].split()[:2] == ["coder", "ready"] and "1 loads" in lines[at + 1]
    assert lines[at + 2].split()[:4] == ["helper", "failed", "—", "exit"]
