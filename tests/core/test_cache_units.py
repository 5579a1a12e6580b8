"""Pure parts of the prefix cache: boundaries, fingerprints, slot choice, file names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core import chat as apis
from core.bench.trace import make_system, make_tools, make_trace
from core.cache import prefix as pfx
from core.cache.fingerprint import ServerIdentity, fingerprint, state_filename
from core.cache.slots import SlotMap
from core.cache.store import StateStore, safe_name
from core.routing import profiles
from core.server.client import valid_slot_filename
from core.telemetry import Telemetry


def test_profile_cut_finds_first_volatile_marker_inside_system_text() -> None:
    system = make_system(0.2, cwd="/a/b")
    rendered = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<env> hi<|im_end|>"
    cut = profiles.profile_cut("opencode", rendered, system)
    assert cut is not None
    index, source = cut
    assert source == "profile:opencode"
    assert rendered[index:].startswith("<env>")
    assert "<env>" not in rendered[:index]
    # The user's own "<env>" (later in the prompt) is not taken as the boundary.
    assert index < rendered.index("<|im_start|>user")


def test_profile_cut_is_none_without_markers() -> None:
    assert profiles.profile_cut("somebot", "<s>system: plain prompt", "plain prompt") is None


def test_common_prefix_len_across_block_boundaries() -> None:
    a = list(range(1000))
    b = [*list(range(700)), -1, *list(range(701, 1000))]
    assert pfx.common_prefix_len(a, b) == 700
    assert pfx.common_prefix_len(a, a[:300]) == 300
    assert pfx.common_prefix_len("abcdef", "abcxef") == 3


def test_side_calls_are_classified() -> None:
    title = make_trace(sessions=1, turns=1, scale=0.1)[0].body
    assert profiles.classify_aux(title, has_tools=False, client_uses_tools=False) is not None
    agent = make_trace(sessions=1, turns=1, scale=0.1)[1].body
    assert profiles.classify_aux(agent, has_tools=True, client_uses_tools=True) is None
    plain = {"messages": [{"role": "user", "content": "what is 2+2"}]}
    assert profiles.classify_aux(plain, has_tools=False, client_uses_tools=False) is None
    assert profiles.classify_aux(plain, has_tools=False, client_uses_tools=True) is not None


def test_divergence_reports_position_and_context() -> None:
    old = "system prompt. Today is Monday. tools..."
    new = "system prompt. Today is Tuesday. tools..."
    where = pfx.divergence(old, new)
    assert where is not None
    assert where["char_index"] == old.index("Monday")
    assert where["old"].startswith("Monday") and where["new"].startswith("Tuesday")
    assert pfx.divergence("abc", "abcdef") is None  # an extension is not a divergence


def test_shape_key_depends_on_tools_and_system_text() -> None:
    def shape_key(client: str, body: dict[str, object]) -> str:
        view = apis.chat_view("chat", body)
        assert view is not None
        return view.shape_key(client)

    body = {"messages": [{"role": "system", "content": "S"}], "tools": make_tools(0.05)}
    k = shape_key("opencode", body)
    assert k == shape_key("opencode", dict(body))
    assert k != shape_key("other", body)
    assert k != shape_key("opencode", {**body, "tools": make_tools(0.05, seed=1)})
    assert k != shape_key("opencode", {**body, "messages": [{"role": "system", "content": "T"}]})


IDENT = ServerIdentity(model="m", binary="b", kv_flags=("-np", "2"), chat_template="t")


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "m2"),
        ("binary", "b2"),
        ("kv_flags", ("-np", "3")),
        ("chat_template", "t2"),
        ("patches", ("slot-checkpoints-v1",)),
    ],
)
def test_fingerprint_changes_with_every_input(field: str, value: object) -> None:
    tokens = [1, 2, 3]
    other = ServerIdentity(**{**IDENT.__dict__, field: value})
    assert fingerprint(IDENT, tokens) != fingerprint(other, tokens)


def test_fingerprint_changes_with_tokens_and_names_are_valid() -> None:
    a, b = fingerprint(IDENT, [1, 2, 3]), fingerprint(IDENT, [1, 2, 4])
    assert a != b and a == fingerprint(IDENT, [1, 2, 3])
    name = state_filename(a)
    assert safe_name(name) and valid_slot_filename(name)
    with pytest.raises(ValueError):
        state_filename("../../etc/passwd")


@pytest.mark.parametrize(
    "name", ["../evil.bin", "a/b.bin", "", "ok.", " lead", "x..y", "C:bad", "ws-../x.bin"]
)
def test_unsafe_names_are_refused(name: str) -> None:
    assert not safe_name(name)
    assert not valid_slot_filename(name) or not safe_name(name)


def test_slot_map_pins_sessions_and_reserves_aux() -> None:
    m = SlotMap(3, reserve_aux=lambda: True)
    assert m.aux_slot == 2
    a, _ = m.pick("A", "agent")
    assert m.pick("A", "agent")[0] == a  # pinned
    m.begin(a)
    b, _ = m.pick("B", "agent")
    assert b != a and b != 2  # never the slot an in-flight session holds, never aux
    assert m.pick("t", "aux")[0] == 2
    single = SlotMap(1, reserve_aux=lambda: True)
    assert single.aux_slot is None and single.pick("t", "aux")[0] == 0


def test_store_refuses_foreign_names_and_detects_changed_files(tmp_path: Path) -> None:
    tel = Telemetry(tmp_path / "t.sqlite3")
    store = StateStore(tel.db, tmp_path / "slots")
    from core.cache.store import StateRecord, file_sha256

    d = store.dir_for("0123456789abcdef")
    d.mkdir(parents=True)
    name = state_filename(fingerprint(IDENT, [1]))
    (d / name).write_bytes(b"x" * 100)
    rec = StateRecord(
        filename=name,
        identity="0123456789abcdef",
        fingerprint="f",
        client="c",
        source="s",
        prefix_n=1,
        n_tokens=1,
        bytes=100,
        sha256=file_sha256(d / name),
        ttl_class="extended",
        pinned=False,
        created=0,
        last_used=0,
        verified_at=None,
        verify_result="",
        probe={},
    )
    store.add(rec)
    assert store.check_file(rec) is None
    (d / name).write_bytes(b"y" * 100)
    assert "sha256" in (store.check_file(rec) or "")
    (d / name).write_bytes(b"y" * 50)
    assert "size" in (store.check_file(rec) or "")
    with pytest.raises(ValueError):
        store.dir_for("../x")
    bad = StateRecord(**{**rec.__dict__, "filename": "../../evil"})
    with pytest.raises(ValueError):
        store.path(bad)
    assert store.delete(rec) == 50 and not (d / name).exists() and store.get(name) is None
    tel.close()


def test_dropped_tools_detected_but_json_escaping_is_not_a_drop() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "edit",
            "description": "Performs exact string replacements in files.\n\nUsage",
        },
    }
    body = {
        "messages": [{"role": "system", "content": "You are a helpful agent."}],
        "tools": [tool],
    }
    escaped = (
        'You are a helpful agent. {"name": "edit", "description": '
        '"Performs exact string replacements in files.\\n\\nUsage"}'
    )
    assert pfx.dropped_parts(body, escaped) == []
    # The generic fallback keeps the system text but not the tools: words like
    # "edit" may still occur by chance, the description does not.
    assert pfx.dropped_parts(body, "You are a helpful agent. please edit it") == ["tool edit"]
    assert pfx.dropped_parts(body, "<tools>Performs exact string replacements") == [
        "tool edit",
        "system message",
    ]


@pytest.mark.parametrize(
    "swa,recurrent,swa_full,patches,usable",
    [
        (False, False, False, (), True),  # dense: any build
        (True, False, False, (), False),  # Gemma 3 on a stock server
        (True, False, False, ("slot-checkpoints-v1",), True),
        (True, False, True, ("slot-checkpoints-v1",), False),  # --swa-full needs full SWA state
        (True, False, True, ("slot-checkpoints-v1", "swa-full-state-v1"), True),
        (False, True, False, (), False),  # hybrid / recurrent
        (False, True, False, ("slot-checkpoints-v2",), False),  # exact strings only
    ],
)
def test_disk_tier_needs_the_patch_for_sliding_window_and_hybrid_models(
    swa: bool, recurrent: bool, swa_full: bool, patches: tuple[str, ...], usable: bool
) -> None:
    from core.cache.warmup import disk_tier_for

    tier = disk_tier_for(swa=swa, recurrent=recurrent, swa_full=swa_full, patches=patches)
    assert tier.usable is usable and tier.reason


Step = tuple[int, float, float]


def _resp(steps: list[Step], rest: list[list[tuple[int, float]]] | None = None) -> dict[str, Any]:
    """A probe response: (token, logprob, runner-up logprob) per step, plus `rest`, more
    (token, logprob) entries of each step's top-k list."""
    return {
        "completion_probabilities": [
            {
                "id": t,
                "logprob": lp,
                "top_logprobs": [{"id": t, "logprob": lp}, {"id": t + 1, "logprob": lp2}]
                + [{"id": i, "logprob": v} for i, v in (rest[n] if rest else [])],
            }
            for n, (t, lp, lp2) in enumerate(steps)
        ]
    }


def _flat(shift: float = 0.0, at: int = 7) -> dict[str, Any]:
    """A flat model's answer (every margin under TIE_MARGIN, like the tiny random model):
    16 log-probs near -7.16 per step; `shift` moves the `at`-th entry of step 0 only."""
    steps = [(100 + s, -7.1600 - s * 1e-4, -7.1620 - s * 1e-4) for s in range(4)]
    rest = [
        [
            (200 + j, -7.1630 - j * 1e-4 - s * 1e-4 + (shift if s == 0 and j == at else 0.0))
            for j in range(14)
        ]
        for s in range(4)
    ]
    return _resp(steps, rest)


def _ref(resp: dict[str, Any]) -> dict[str, Any]:
    """A reference as the manager stores it: through JSON, like the index row."""
    from core.cache.probe import probe_reference

    return json.loads(json.dumps({"prefix": [1], "suffix": [2], **probe_reference(resp)}))


def test_probe_check_exact_ties_and_changes() -> None:
    from core.cache.probe import check_answer

    ref_resp = _resp([(5, -0.1, -3.0), (7, -0.2, -0.2005), (9, -0.3, -2.0)])
    ref = _ref(ref_resp)
    assert check_answer(ref_resp, 100, 100, ref) is None
    # Reuse too low: the restored state did not hold the prefix.
    assert "reuse probe" in (check_answer(ref_resp, 10, 100, ref) or "")
    # A clear first token changed: rejected.
    changed = _resp([(6, -0.1, -3.0), (7, -0.2, -0.3), (9, -0.3, -2.0)])
    assert "token 0" in (check_answer(changed, 100, 100, ref) or "")
    # Same tokens, log-prob moved: rejected (a restore that silently computes differently).
    moved = _resp([(5, -0.15, -3.0), (7, -0.2, -0.2005), (9, -0.3, -2.0)])
    assert "log-probs moved" in (check_answer(moved, 100, 100, ref) or "")
    # Step 1 was a near-tie in the reference: with its vector within the tolerance either
    # token is fine, and the rest may differ.
    flipped = _resp([(5, -0.1, -3.0), (8, -0.2003, -0.2004), (2, -1.0, -1.5)])
    assert check_answer(flipped, 100, 100, ref, tolerance=1e-3) is None
    # ... but not when the tied position's log-probs themselves moved.
    far = _resp([(5, -0.1, -3.0), (8, -0.1, -0.4), (2, -1.0, -1.5)])
    assert "at token 1" in (check_answer(far, 100, 100, ref, tolerance=1e-3) or "")


def test_probe_on_a_flat_model_compares_whole_top_k_vectors() -> None:
    """Every margin under TIE_MARGIN; the old check compared token 0's
    log-prob within 1e-3 only and accepted 64 flipped bytes and another model's file."""
    from core.cache.probe import LOGPROB_TOLERANCE, PROBE_TOP_K, TIE_MARGIN, check_answer

    ref = _ref(_flat())
    assert len(ref["top"][0]) == PROBE_TOP_K and max(ref["margins"]) < TIE_MARGIN
    assert check_answer(_flat(), 600, 600, ref) is None
    # Token 0 and its log-prob unchanged; the 8th entry moved by 2e-4 (as 2 flipped bytes
    # did on the tiny model): rejected at the dense tolerance.
    assert "moved by 0.0002" in (check_answer(_flat(shift=2e-4), 600, 600, ref) or "")
    # One ulp at -7.16 is a different state too: a correct dense restore is bit-exact.
    assert LOGPROB_TOLERANCE == 0.0
    assert check_answer(_flat(shift=4.77e-7), 600, 600, ref) is not None
    # An entry jumping into the top of the list (another model's state).
    assert "token" in (check_answer(_flat(shift=0.5, at=13), 600, 600, ref) or "")


def test_probe_top_k_cut_off_may_move_within_the_tolerance_only() -> None:
    from core.cache.probe import check_answer

    ref = _ref(_resp([(5, -0.1, -3.0)], [[(30, -5.0), (31, -5.001)]]))
    # The last two swap places across the cut-off: one leaves, another enters, both at
    # the boundary within the tolerance.
    edge = _resp([(5, -0.1, -3.0)], [[(30, -5.0), (32, -5.0009)]])
    assert check_answer(edge, 10, 10, ref, tolerance=0.01) is None
    assert "entered the top" in (check_answer(edge, 10, 10, ref, tolerance=0.0) or "")
    # A token well inside the list vanishes: rejected whatever the tolerance allows.
    gone = _resp([(5, -0.1, -3.0)], [[(30, -5.0), (31, -5.001)]])
    gone["completion_probabilities"][0]["top_logprobs"][1]["id"] = 7  # was 6, at -3.0
    assert "left the top" in (check_answer(gone, 10, 10, ref, tolerance=0.25) or "")


def test_probe_non_finite_answers_are_rejected_not_crashed_on() -> None:
    """A state with NaN/inf cells gives null log-probs; the old check raised TypeError,
    and the caller left the state in the slot."""
    from core.cache.probe import check_answer, non_finite

    ref = _ref(_resp([(5, -0.1, -3.0), (9, -0.3, -2.0)]))
    for bad in (None, float("nan"), float("-inf"), "x"):
        resp = _resp([(5, -0.1, -3.0), (9, -0.3, -2.0)])
        resp["completion_probabilities"][1]["top_logprobs"][1]["logprob"] = bad
        problem = check_answer(resp, 10, 10, ref)
        assert non_finite(problem), (bad, problem)
        # Even when the reuse check would fail too: the slot must be scrubbed either way.
        assert non_finite(check_answer(resp, 0, 10, ref))
    assert not non_finite(check_answer(_resp([(6, -0.1, -3.0), (9, -0.3, -2.0)]), 10, 10, ref))


def test_probe_reference_of_the_old_format_is_never_accepted() -> None:
    """References saved before version 2 (tokens, log-probs, margins only) cannot be held
    to the vector check: the state is treated as unverifiable and rebuilt."""
    from core.cache.probe import PROBE_VERSION, check_answer, probe_answer

    resp = _resp([(5, -0.1, -3.0), (9, -0.3, -2.0)])
    tokens, lps, margins = probe_answer(resp)
    old = {"prefix": [1], "suffix": [2], "tokens": tokens, "logprobs": lps, "margins": margins}
    problem = check_answer(resp, 10, 10, old)  # the very same answer
    assert problem is not None and "older format" in problem
    assert check_answer(resp, 10, 10, {**old, "version": PROBE_VERSION}) is not None  # no top
    assert check_answer(resp, 10, 10, _ref(resp)) is None


def test_probe_request_asks_for_the_top_k_vectors() -> None:
    from core.cache.probe import PROBE_TOP_K, probe_request, scrub_request

    body = probe_request([1, 2], [3], 0)
    assert body["n_probs"] == PROBE_TOP_K >= 10 and body["prompt"] == [1, 2, 3]
    scrub = scrub_request([1, 2], [3], 1)
    # Covers every cell the probe wrote: prompt + the generated tokens.
    assert len(scrub["prompt"]) > len(body["prompt"]) + body["n_predict"]
    assert scrub["cache_prompt"] is False and scrub["id_slot"] == 1


def test_sliding_window_ring_is_held_exact_too() -> None:
    """The reference is taken from a restored state, so a ring restored again matches it
    bit for bit (Gemma 3 270M, docs/cache.md#verification); 0.25 let 8 flipped bytes
    through that changed the answer."""
    from core.cache.probe import LOGPROB_TOLERANCE, check_answer
    from core.cache.warmup import disk_tier_for

    ring = disk_tier_for(
        swa=True, recurrent=False, swa_full=False, patches=("slot-checkpoints-v1",)
    )
    exact = disk_tier_for(
        swa=True,
        recurrent=False,
        swa_full=True,
        patches=("slot-checkpoints-v1", "swa-full-state-v1"),
    )
    assert ring.usable and exact.usable
    assert exact.logprob_tolerance == ring.logprob_tolerance == LOGPROB_TOLERANCE == 0.0
    ref = _ref(_resp([(5, -0.5, -3.0), (9, -0.3, -2.0)]))
    assert check_answer(_resp([(5, -0.5, -3.0), (9, -0.3, -2.0)]), 50, 50, ref) is None
    accepted_before = _resp([(5, -0.695, -3.0), (9, -0.3, -2.0)])  # measured: 0.195, 8 bytes
    assert check_answer(accepted_before, 50, 50, ref, tolerance=ring.logprob_tolerance)


def test_probe_second_look_only_for_differences_noise_could_cause() -> None:
    """A batch shared with another slot's request moves log-probs in the last bits (a
    false 'moved by 0.0005' in the soak test): such a verdict gets one more probe, alone.
    Missing reuse, NaN and an old reference cannot be noise."""
    from core.cache.probe import check_answer, second_look

    ref = _ref(_flat())
    assert second_look(check_answer(_flat(shift=5e-4), 600, 600, ref))
    assert second_look(check_answer(_flat(shift=0.5, at=13), 600, 600, ref))
    assert not second_look(check_answer(_flat(), 600, 600, ref))  # passed: nothing to do
    assert not second_look(check_answer(_flat(), 10, 600, ref))
    old = {k: v for k, v in ref.items() if k not in ("version", "top")}
    assert not second_look(check_answer(_flat(), 600, 600, old))
    nan = _flat()
    nan["completion_probabilities"][0]["logprob"] = None
    assert not second_look(check_answer(nan, 600, 600, ref))
