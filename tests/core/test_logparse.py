"""llama-server output parsing, on output recorded from real runs (tests/fixtures/logs/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.server import logparse

LOGS = Path(__file__).resolve().parent.parent / "fixtures" / "logs"


def lines(name: str) -> list[str]:
    return (LOGS / name).read_text(encoding="utf-8").splitlines()


def test_parse_line_splits_level_area_and_text() -> None:
    log = lines("server-start-and-request.log")
    first = logparse.parse_line(log[0])
    assert (first.level, first.area) == ("info", "cmn")
    assert first.text.startswith("common_param: common_params_print_info: verbosity = 3")
    assert first.raw == log[0]

    warn = logparse.parse_line(log[1] + "\r\n")
    assert (warn.level, warn.area, warn.text) == (
        "warning",
        "srv",
        "llama_server: -----------------",
    )
    assert warn.raw == log[1]

    # A line whose area is a bare word followed by a colon ("load:").
    control = next(line for line in log if "control-looking token" in line)
    parsed = logparse.parse_line(control)
    assert parsed.level == "warning" and parsed.area == "load:"


def test_every_recorded_line_parses_with_a_known_level() -> None:
    for path in sorted(LOGS.glob("*.log")):
        for raw in path.read_text(encoding="utf-8").splitlines():
            if not raw.strip():
                continue
            parsed = logparse.parse_line(raw)
            assert parsed.level in {"info", "warning", "error", "debug", "trace"}, (path, raw)
            assert parsed.text, (path, raw)


def test_bare_lines_from_older_builds() -> None:
    assert logparse.parse_line("error: invalid argument: --foo").level == "error"
    assert logparse.parse_line("main: fatal error while loading").level == "error"
    plain = logparse.parse_line("build: 4000 (abc) with gcc")
    assert (plain.level, plain.area, plain.text) == ("info", "", "build: 4000 (abc) with gcc")


def test_listening_and_slots_info() -> None:
    found = [logparse.listening(line) for line in lines("server-start-and-request.log")]
    hits = [f for f in found if f is not None]
    assert hits == [logparse.Listening("127.0.0.1", 18080)]

    infos = [logparse.slots_info(line) for line in lines("tiny-start-two-requests.log")]
    assert [i for i in infos if i] == [logparse.SlotsInfo(2, 4096, False)]
    assert logparse.slots_info(
        "I srv load_model: initializing, n_slots = 4, n_ctx_slot = 4096, kv_unified = 'true'"
    ) == logparse.SlotsInfo(4, 4096, True)


def test_prompt_timing_only_from_prompt_eval_lines() -> None:
    timings = [logparse.prompt_timing(line) for line in lines("tiny-start-two-requests.log")]
    assert [t for t in timings if t] == [
        logparse.PromptTiming(slot=1, task=0, prompt_ms=5.69, prompt_tokens=16),
        logparse.PromptTiming(slot=1, task=5, prompt_ms=3.04, prompt_tokens=1),
    ]
    gemma = [logparse.prompt_timing(line) for line in lines("server-start-and-request.log")]
    assert [t for t in gemma if t] == [logparse.PromptTiming(1, 0, 135.99, 25)]


@pytest.mark.parametrize(
    ("log", "reason", "detail"),
    [
        (
            "failed-start-missing-model.log",
            "the model file could not be loaded",
            "does-not-exist.gguf",
        ),
        ("failed-start-corrupt-model.log", "the model file could not be loaded", "corrupt.gguf"),
        ("failed-start-port-in-use.log", "the port is taken", "port: 18182"),
        ("failed-start-bad-flag.log", "an unknown command-line flag", "--definitely-not-a-flag"),
    ],
)
def test_failure_reason_of_recorded_failed_starts(log: str, reason: str, detail: str) -> None:
    text = logparse.failure_reason(lines(log)[-40:])
    assert text.startswith(reason + ": "), text
    assert detail in text


def test_failure_reason_fallbacks() -> None:
    assert logparse.failure_reason([]) == "it exited without any output"
    # No known hint: the last error line wins over later info lines.
    got = logparse.failure_reason(
        [
            "0.00.001.000 I srv  main: starting",
            "0.00.002.000 E srv  main: something odd happened",
            "0.00.003.000 I srv  operator(): cleaning up before exit...",
        ]
    )
    assert got == "main: something odd happened"
    # No error at all (llama-server can exit before its log thread writes the error).
    assert logparse.failure_reason(["0.00.001.000 W srv  llama_server: -----"]) == (
        "it exited without an error message (last line: llama_server: -----)"
    )


# ------------------------------------------------------------ LineSplitter
def test_splitter_joins_lines_across_chunks_and_keeps_the_last_one() -> None:
    s = logparse.LineSplitter()
    assert s.feed(b"first li") == []
    assert s.feed(b"ne\r\nsecond\nthi") == ["first line", "second"]
    assert s.feed(b"rd") == []
    assert s.close() == ["third"]
    assert s.close() == []


def test_splitter_cuts_a_long_line_and_says_how_much() -> None:
    s = logparse.LineSplitter(max_bytes=10)
    # 100 KB in pieces, as a pipe delivers a grammar llama-server echoes in its error.
    out = [line for _ in range(100) for line in s.feed(b"x" * 1000)]
    out += s.feed(b"\nnext\n")
    assert out == ["x" * 10 + logparse.cut_marker(100_000 - 10), "next"]


def test_splitter_survives_any_bytes() -> None:
    s = logparse.LineSplitter(max_bytes=4)
    lines = s.feed(bytes(range(256)) + b"\n\xe2\x80")  # control bytes, a cut UTF-8 sequence
    assert len(lines) == 2 and lines[0].startswith("\x00\x01\x02\x03")
    assert s.close() == ["\ufffd"]
