"""Conversation states: which saved conversation a request gets back.

The selection rules of `core.cache.conversation_pick.choose` (longest match, session vs
token-prefix match, the gain over the stable prefix, the time budget from measured
numbers), the index query for candidates, the newest-supersedes-older retention, what
counts as unsaved in a slot, and reading a slot file's token list — with the fakes of
`tests/core/bg_support.py` and real SQLite.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from core.cache.conversation_pick import MIN_GAIN_TOKENS, SEQ_MAGIC, Price, choose, read_tokens
from core.cache.conversations import KIND
from core.cache.costs import PRIOR_BYTES_PER_MS, Costs
from core.cache.store import StateRecord
from tests.core.bg_support import IDENT, OTHER, FakeManager, make_manager, prefix

SYSTEM = list(range(1000, 1300))  # a 300-token stable prefix


def _rec(
    name: str,
    tokens: list[int],
    *,
    session: str = "s1",
    base: str = "b",
    created: float = 0.0,
    restore_ms: float = 5.0,
    verify_ms: float = 20.0,
    prefill: float | None = 1.0,
    identity: str = IDENT,
    kind: str = KIND,
) -> StateRecord:
    return StateRecord(
        filename=f"ws-{name:0>32}.bin",
        identity=identity,
        fingerprint=name * 4,
        client="opencode",
        source=KIND,
        prefix_n=len(tokens),
        n_tokens=len(tokens),
        bytes=100 * len(tokens),
        sha256="0" * 64,
        ttl_class="long",
        pinned=False,
        created=created,
        last_used=created,
        verified_at=created,
        verify_result="reference",
        probe={
            "prefix": tokens,
            "suffix": [1, 2],
            "hash_ms": 1.0,
            "restore_ms": restore_ms,
            "verify_ms": verify_ms,
            "prefill_ms_per_token": prefill,
        },
        kind=kind,
        session=session,
        base=base,
    )


def _price(rate: float | None, verify_ms: float | None = None) -> Price:
    """Restores priced as on a server that measured no restore yet (each state's own
    numbers count), at the cold prefill `rate`, with `verify_ms` its quickest probe."""
    costs = Costs()
    if verify_ms is not None:
        costs.note_probe(verify_ms)
    return lambda rec, gain: costs.estimate(rec, gain, rate=rate)


def _hash_ms(rec: StateRecord) -> float:
    """What hashing `rec` before its restore is priced at (its stat is not recorded)."""
    return rec.bytes / PRIOR_BYTES_PER_MS


def _conv(n: int, tail: int = 0) -> list[int]:
    """The system prefix, then `n` conversation tokens (a different tail per `tail`)."""
    return SYSTEM + [5000 + tail * 100_000 + i for i in range(n)]


def test_the_longest_match_wins() -> None:
    prompt = [*_conv(2000), 7, 7, 7]
    short = _rec("1", _conv(800), created=3)
    longest = _rec("2", _conv(1900), created=1)
    other = _rec("3", _conv(2500, tail=1), created=2)  # another conversation: prefix only
    choice, why = choose([short, other, longest], prompt, "s1", len(SYSTEM), _price(1.0))
    assert choice is not None and why is None
    assert choice.rec is longest and choice.match == len(SYSTEM) + 1900
    assert choice.by == "session"


def test_a_state_of_another_session_is_found_by_its_tokens() -> None:
    prompt = [*_conv(1500), 9]
    theirs = _rec("1", _conv(1200), session="old-session")
    choice, _ = choose([theirs], prompt, "new-session", len(SYSTEM), _price(1.0))
    assert choice is not None and choice.by == "tokens" and choice.match == len(SYSTEM) + 1200
    # On equal matches the same session's state wins over another's, even an older one.
    mine = _rec("2", _conv(1200), session="new-session", created=-5)
    choice, _ = choose([theirs, mine], prompt, "new-session", len(SYSTEM), _price(1.0))
    assert choice is not None and choice.rec is mine
    # A session match counts only for the tokens it shares: a longer other-session state wins.
    longer = _rec("3", _conv(1400), session="old-session")
    choice, _ = choose([mine, longer], prompt, "new-session", len(SYSTEM), _price(1.0))
    assert choice is not None and choice.rec is longer and choice.by == "tokens"


def test_a_state_that_gives_little_beyond_the_prefix_is_not_restored() -> None:
    prompt = _conv(1000)
    barely = _rec("1", _conv(MIN_GAIN_TOKENS - 1))
    enough = _rec("2", _conv(MIN_GAIN_TOKENS))
    assert choose([barely], prompt, "s1", len(SYSTEM), _price(1.0)) == (None, None)
    choice, _ = choose([barely, enough], prompt, "s1", len(SYSTEM), _price(1.0))
    assert choice is not None and choice.rec is enough
    # What the slot or the stable prefix gives anyway is the base: measured from there.
    assert choose([enough], prompt, "s1", len(SYSTEM) + 10, _price(1.0)) == (None, None)


def test_a_state_slower_to_restore_than_to_prefill_is_skipped() -> None:
    prompt = [*_conv(1000), 3]
    # 1,000 tokens at 0.1 ms each: 100 ms of prefill saved.
    slow = _rec("1", _conv(1000), restore_ms=150.0)
    choice, skip = choose([slow], prompt, "s1", len(SYSTEM), _price(0.1))
    assert choice is None and skip is not None
    assert "not restored" in skip.reason and "against a prefill of 1000 tokens" in skip.reason
    # The response header says it in words (it once said "skipped: too large to pay").
    assert skip.header == (
        f"not restored: restoring the saved {slow.n_tokens}-token conversation (~171 ms) "
        "would take longer than prefilling the 1000 tokens it covers (~100 ms)"
    )
    # The same state pays where prefill is slower (measured 1 ms per token).
    choice, _ = choose([slow], prompt, "s1", len(SYSTEM), _price(1.0))
    assert choice is not None
    assert choice.estimate.cost_ms == pytest.approx(_hash_ms(slow) + 150 + 20)
    # A smaller state that pays is taken over the longer one that does not.
    fast = _rec("2", _conv(900), restore_ms=5.0)
    choice, _ = choose([slow, fast], prompt, "s1", len(SYSTEM), _price(0.1))
    assert choice is not None and choice.rec is fast


def test_without_a_live_measurement_the_saved_one_decides() -> None:
    prompt = [*_conv(1000), 3]
    slow_server = _rec("1", _conv(1000), restore_ms=150.0, prefill=1.0)
    assert choose([slow_server], prompt, "s1", len(SYSTEM), _price(None))[0] is not None
    fast_server = _rec("2", _conv(1000), restore_ms=150.0, prefill=0.1)
    assert choose([fast_server], prompt, "s1", len(SYSTEM), _price(None))[0] is None
    # Nothing measured at all: the prior is a fast GPU's prefill, erring against restoring.
    unknown = _rec("3", _conv(1000), restore_ms=150.0, prefill=None)
    assert choose([unknown], prompt, "s1", len(SYSTEM), _price(None))[0] is None


def test_a_probe_timed_under_load_does_not_veto_a_restore() -> None:
    prompt = [*_conv(1000), 3]
    # The save's probe took 1 s while other work shared the CPU; probes take 20 ms here.
    rec = _rec("1", _conv(1000), verify_ms=1000.0)
    assert choose([rec], prompt, "s1", len(SYSTEM), _price(0.5))[0] is None
    choice, _ = choose([rec], prompt, "s1", len(SYSTEM), _price(0.5, verify_ms=20.0))
    assert choice is not None and choice.estimate.cost_ms == pytest.approx(_hash_ms(rec) + 5 + 20)


def test_candidates_are_this_servers_conversations_of_the_session_or_prefix(
    tmp_path: Path,
) -> None:
    _, mgr = make_manager(tmp_path)
    conv = mgr.conversations
    recs = [
        _rec("1", _conv(10), session="s1", base="other", created=1),
        _rec("2", _conv(10), session="s2", base="b", created=2),
        _rec("3", _conv(10), session="s3", base="other", created=3),  # neither
        _rec("4", _conv(10), session="s1", base="b", identity=OTHER, created=4),  # old server
        _rec("5", _conv(10), session="s1", base="b", kind="prefix", created=5),  # a prefix
    ]
    for r in recs:
        mgr.state.store.add(r)
    got = [r.filename for r in conv.candidates("s1", "b")]
    assert got == [recs[1].filename, recs[0].filename]  # newest first


def test_a_newer_state_supersedes_the_older_one_of_the_same_conversation(
    tmp_path: Path,
) -> None:
    core, mgr = make_manager(tmp_path)
    mgr.state.settings.cache.conversations_per_session = 2
    for i, (base, created) in enumerate([("b", 1), ("c", 2), ("d", 3)]):
        rec = _rec(str(i + 1), _conv(10), base=base, created=created)
        path = mgr.state.store.path(rec)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * rec.bytes)
        mgr.state.store.add(rec)
    newer = _rec("9", _conv(20), base="b", created=10)
    mgr.state.store.add(newer)
    gone = mgr.conversations.supersede(newer)
    # The same conversation's older state goes; of the others the newest one stays
    # (2 per session, the new one included), the oldest goes.
    assert sorted(gone) == sorted([_rec("1", []).filename, _rec("2", []).filename])
    assert {r.filename for r in mgr.state.store.all()} == {newer.filename, _rec("3", []).filename}
    rules = sorted(e.details["rule"] for e in core.cache_events("evicted"))
    assert rules == ["per_session", "superseded"]
    assert all(e.bytes == 100 * (len(SYSTEM) + 10) for e in core.cache_events("evicted"))


def test_only_what_a_slot_holds_beyond_its_prefix_and_last_save_is_unsaved(
    tmp_path: Path,
) -> None:
    _, mgr = make_manager(tmp_path)
    info = prefix(SYSTEM)
    mgr.state.by_fp[info.fingerprint] = info
    st = mgr.state.slots.slots[0]
    st.prefix_fp, st.session_of_last, st.last_kind = info.fingerprint, "s1", "agent"
    st.tokens_hint = len(SYSTEM) + MIN_GAIN_TOKENS - 1
    assert mgr.conversations.unsaved(0) == 0  # just the prefix: the prefix machinery's
    st.tokens_hint = len(SYSTEM) + 500
    assert mgr.conversations.unsaved(0) == 500
    st.last_kind = "aux"
    assert mgr.conversations.unsaved(0) == 0  # side calls are not conversations


def _state_file(path: Path, words: list[int]) -> Path:
    path.write_bytes(struct.pack(f"<III{len(words)}i", SEQ_MAGIC, 4, len(words), *words) + b"kv")
    return path


def test_the_token_list_is_read_from_the_slot_file(tmp_path: Path) -> None:
    tokens = [1, 2, 3, 70000]
    # As the server packs it (server_tokens::serialize): marker, version, count, tokens,
    # no media keys.
    packed = _state_file(tmp_path / "a.bin", [-1, 1, len(tokens), *tokens, 0])
    assert read_tokens(packed) == tokens
    assert read_tokens(_state_file(tmp_path / "b.bin", tokens)) == tokens  # older servers
    with pytest.raises(ValueError, match="media"):
        read_tokens(_state_file(tmp_path / "c.bin", [-1, 1, 2, 5, 6, 1, 0]))
    bad = tmp_path / "d.bin"
    bad.write_bytes(struct.pack("<III", 0x12345678, 4, 0))
    with pytest.raises(ValueError, match="magic"):
        read_tokens(bad)
    short = tmp_path / "e.bin"
    short.write_bytes(struct.pack("<III", SEQ_MAGIC, 4, 10) + b"\0" * 8)
    with pytest.raises(ValueError, match="shorter"):
        read_tokens(short)


async def test_a_failed_save_backs_off_and_leaves_no_indexed_file(tmp_path: Path) -> None:
    core, mgr = make_manager(tmp_path)
    assert mgr.fake is not None
    info = prefix(SYSTEM)
    mgr.state.by_fp[info.fingerprint] = info
    st = mgr.state.slots.slots[0]
    st.prefix_fp, st.session_of_last, st.last_kind = info.fingerprint, "s1", "agent"
    st.tokens_hint = len(SYSTEM) + 500
    mgr.fake.contents[0] = list(range(st.tokens_hint))
    mgr.fake.fail_save = True  # the server dies half-way through writing
    said = await mgr.conversations.save(0, "test")
    assert said.startswith("conversation not saved"), said
    (failed,) = core.cache_events("save_failed")
    assert failed.details["failures"] == 1 and failed.fingerprint == info.fingerprint[:16]
    assert mgr.state.store.all() == []  # journaled, never indexed: the retention sweep's to delete
    # The next response's save waits out the backoff: no second try, no second event.
    said = await mgr.conversations.save(0, "test")
    assert "next try waits" in said
    assert len(core.cache_events("save_failed")) == 1
    assert mgr.fake.calls.count(("save", 0)) == 1


def _live(mgr: FakeManager, slot: int, session: str, extra: int, last_used: float) -> None:
    """Slot `slot` holds session's conversation: the prefix and `extra` tokens."""
    assert mgr.fake is not None
    info = prefix(SYSTEM)
    mgr.state.by_fp[info.fingerprint] = info
    st = mgr.state.slots.slots[slot]
    st.prefix_fp, st.session_of_last, st.last_kind = info.fingerprint, session, "agent"
    st.tokens_hint, st.last_used = len(SYSTEM) + extra, last_used
    mgr.fake.contents[slot] = SYSTEM + [slot * 10_000 + i for i in range(extra)]


async def test_shutdown_saves_longest_unsaved_then_most_recent_within_its_time(
    tmp_path: Path,
) -> None:
    core, mgr = make_manager(tmp_path, slots=4)  # three primary slots and the side slot
    assert mgr.fake is not None
    mgr.fake.llama_format = True
    _live(mgr, 0, "short-recent", 200, last_used=9)
    _live(mgr, 1, "long-old", 2000, last_used=1)
    _live(mgr, 2, "short-old", 200, last_used=2)
    assert (await mgr.conversations.save_all(timeout=0))["saved"] == []  # no time: nothing
    out = await mgr.conversations.save_all()
    assert len(out["saved"]) == 3 and out["not_saved_slots"] == []
    saves = core.cache_events("save")
    assert [e.details["session"] for e in saves] == ["long-old", "short-recent", "short-old"]
    assert all(e.details["why"] == "shutdown" and e.details["state"] == KIND for e in saves)
    recs = {r.session: r for r in mgr.state.store.all()}
    assert recs["long-old"].n_tokens == len(SYSTEM) + 2000
    assert recs["long-old"].probe["prefix"] == mgr.fake.contents[1][: len(SYSTEM) + 2000]
    assert all(r.kind == KIND and r.ttl_class == "long" for r in recs.values())
    assert mgr.retention.journal.pending() == []  # every save finished and was indexed
    assert out["saved"][0].startswith("slot 1: saved its 2")  # each save names its slot
    # Saved: nothing is left to save, so a second stop saves nothing again — and says that
    # the three are on disk (the log once read "{'saved': []}" after a shutdown in which
    # the save that followed the last response had saved the conversation).
    again = await mgr.conversations.save_all()
    assert again["saved"] == [] and len(again["already_saved"]) == 3
    words = mgr.conversations.describe(again)
    assert words.startswith("already on disk: slot 0: its 500-token conversation;"), words
    assert "saved now" not in words
    # A saved state restores and verifies against its own reference.
    await mgr.ops.restore(recs["long-old"], 0)
    assert [e.details.get("state") for e in core.cache_events("restore_ok")] == [None]
