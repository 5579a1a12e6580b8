"""Which request a crash quarantines (core.server.quarantine), on a made-up clock.

The real server's crash and the proxy's 422 are in tests/integration/test_reliability.py.
"""

from __future__ import annotations

from core.server.quarantine import GRACE_S, MAX_BODIES, CrashQuarantine, body_digest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[CrashQuarantine, Clock]:
    clock = Clock()
    return CrashQuarantine(window_s=600.0, clock=clock), clock


def test_the_body_alone_in_flight_is_refused_for_the_window() -> None:
    q, clock = make()
    bad = body_digest(b'{"grammar": "((((("}')
    q.begin(bad)
    hits = q.crashed("signal SIGSEGV")
    assert [h.digest for h in hits] == [bad] and hits[0].what == "signal SIGSEGV"
    assert q.refusal(bad) is not None and q.refused == 1
    assert q.refusal(body_digest(b'{"grammar": "(((("}')) is None  # another body passes
    clock.now += 599
    assert q.refusal(bad) is not None
    clock.now += 2
    assert q.refusal(bad) is None and q.refused == 0


def test_a_request_that_broke_just_before_the_crash_was_seen_counts() -> None:
    """The proxy often hears of the death (its connection breaks) before the supervisor."""
    q, clock = make()
    token = q.begin("bad")
    q.end(token, failed=True)
    clock.now += GRACE_S / 2
    assert [h.digest for h in q.crashed("signal SIGSEGV")] == ["bad"]


def test_finished_and_long_failed_requests_are_not_suspects() -> None:
    q, clock = make()
    q.end(q.begin("answered"), failed=False)
    q.end(q.begin("failed-long-ago"), failed=True)
    clock.now += GRACE_S + 1
    assert q.crashed("signal SIGSEGV") == []


def test_beside_others_a_body_needs_two_crashes() -> None:
    q, _ = make()
    q.begin("bad")
    q.begin("innocent")
    assert q.crashed("signal SIGSEGV") == []  # one strike each: nobody refused yet
    q.begin("bad")
    q.begin("other")
    assert [h.digest for h in q.crashed("signal SIGSEGV")] == ["bad"]
    assert q.refusal("innocent") is None and q.refusal("other") is None


def test_strikes_expire_with_the_window() -> None:
    q, clock = make()
    q.begin("a")
    q.begin("b")
    q.crashed("x")
    clock.now += 601
    q.begin("a")
    q.begin("c")
    assert q.crashed("x") == []


def test_memory_stays_bounded() -> None:
    q, _ = make()
    for i in range(MAX_BODIES + 50):
        q.begin(str(i))
        q.crashed("x")
    assert q.refused == MAX_BODIES
    assert q.refusal("0") is None and q.refusal(str(MAX_BODIES + 49)) is not None


def test_a_crash_with_an_outside_cause_blames_nothing_in_flight() -> None:
    """A lost RPC worker kills the server under whatever request needed it: that request
    is not quarantined, and a later crash does not count it either."""
    q = CrashQuarantine(clock=lambda: 100.0)
    token = q.begin("abc")
    q.end(token, failed=True)
    q.excused()
    assert q.refusal("abc") is None
    assert q.crashed("signal SIGSEGV") == []  # nothing was in flight any more
