"""`warmslot status` in words: sessions apart, and the warning when agents crowd a slot."""

from __future__ import annotations

import time

from core.cli import format_status
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
