"""Where a new agent session goes (core.cache.slots): a slot of its own
where there is one."""

from __future__ import annotations

from core.cache.slots import SlotMap


def _held(m: SlotMap, slot: int, session: str, fp: str, tokens: int) -> None:
    """`session` ran in `slot` and left a conversation starting with prefix `fp`."""
    sid, _ = m.pick(session, "agent")
    assert sid == slot
    st = m.slots[slot]
    st.prefix_fp, st.tokens_hint, st.session_of_last = fp, tokens, session


def test_new_session_goes_where_its_prefix_is_when_it_cannot_be_restored() -> None:
    m = SlotMap(3, reserve_aux=lambda: True)  # slots 0 and 1 for agents, 2 for side calls
    _held(m, 0, "A", "fp-shared", 15_000)
    # The prefix is not saved: B takes A's idle slot, which holds it, not the empty one.
    slot, why = m.pick("B", "agent", {0}, displace=True)
    assert slot == 0 and "where its prefix is" in why
    assert m.sessions == {"B": 0}  # A's pin moves with its conversation
    # A comes back: a slot of its own (its saved conversation is restored there).
    assert m.pick("A", "agent", {1}, displace=True) == (1, "least recently used free slot")
    assert m.pick("B", "agent", {0}, displace=True) == (0, "session pinned")


def test_new_session_prefers_a_free_slot_and_never_displaces_unless_asked() -> None:
    m = SlotMap(3, reserve_aux=lambda: True)
    _held(m, 0, "A", "fp-shared", 15_000)
    # Saved on disk (or short): the empty slot, where the prefix is restored.
    assert m.pick("B", "agent", {0}, displace=False)[0] == 1
    # A free slot that holds the prefix beats the LRU rule.
    m2 = SlotMap(3, reserve_aux=lambda: True)
    _held(m2, 0, "A", "fp-other", 900)
    _held(m2, 1, "C", "fp-shared", 15_000)
    m2.release("C")
    assert m2.pick("B", "agent", {1})[0] == 1
    # A session seen before never takes another's slot for its prefix.
    assert m2.pick("A", "agent", {1}, displace=True)[0] == 0


def test_busy_slot_is_never_taken() -> None:
    m = SlotMap(3, reserve_aux=lambda: True)
    _held(m, 0, "A", "fp-shared", 15_000)
    m.begin(0)  # A's request is running
    assert m.pick("B", "agent", {0}, displace=True)[0] == 1
