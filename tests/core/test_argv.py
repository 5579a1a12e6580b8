"""The llama-server argv is a pure function of settings and launch inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core.config import ServerSettings
from core.server.argv import LaunchInputs, build_argv, kv_relevant

BIN = Path("/opt/llama/llama-server")
MODEL = Path("/models/m.gguf")
SLOTS = Path("/state/slots")


def inputs(**kw: object) -> LaunchInputs:
    base = LaunchInputs(binary=BIN, model=MODEL, port=40001, slot_dir=SLOTS)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def value_of(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_defaults() -> None:
    argv = build_argv(ServerSettings(), inputs())
    assert argv[0] == str(BIN)
    assert value_of(argv, "-m") == str(MODEL)
    assert value_of(argv, "--host") == "127.0.0.1"
    assert value_of(argv, "--port") == "40001"
    assert value_of(argv, "-np") == "2"
    assert value_of(argv, "-c") == str(2 * 8192)
    assert value_of(argv, "--cache-ram") == "2048"
    assert value_of(argv, "--slot-save-path") == str(SLOTS)
    assert "--metrics" in argv
    assert "--no-webui" in argv
    assert "-t" not in argv  # threads 0: llama-server decides
    assert "--no-repack" not in argv
    assert "--jinja" not in argv and "--chat-template-file" not in argv


@pytest.mark.parametrize(("slots", "ctx"), [(1, 4096), (3, 1000), (8, 32768)])
def test_slots_always_explicit_and_context_is_per_slot_times_slots(slots: int, ctx: int) -> None:
    argv = build_argv(ServerSettings(slots=slots, ctx_per_slot=ctx), inputs())
    assert value_of(argv, "-np") == str(slots)
    assert value_of(argv, "-c") == str(slots * ctx)


def test_threads_no_repack_and_chat_template() -> None:
    s = ServerSettings(threads=2, chat_template_file="/t/chat.jinja")
    argv = build_argv(s, inputs(no_repack=True))
    assert value_of(argv, "-t") == "2"
    assert argv.count("--no-repack") == 1
    assert "--jinja" in argv
    assert value_of(argv, "--chat-template-file") == "/t/chat.jinja"


def test_plan_args_override_instead_of_repeating() -> None:
    plan = ("-c", "2048", "-ngl", "99", "-fa", "on")
    argv = build_argv(ServerSettings(slots=2, ctx_per_slot=8192), inputs(plan_args=plan))
    assert value_of(argv, "-c") == "2048"  # replaced in place
    assert value_of(argv, "-ngl") == "99"  # new flags appended
    assert value_of(argv, "-fa") == "on"
    assert argv.index("-ngl") > argv.index("--no-webui")


def test_plan_args_override_with_negative_values() -> None:
    """A value may start with '-' when it is a number (``--cache-ram -1`` = no limit)."""
    argv = build_argv(ServerSettings(), inputs(plan_args=("--cache-ram", "-1", "-ngl", "-1")))
    assert value_of(argv, "--cache-ram") == "-1"
    assert value_of(argv, "-ngl") == "-1"


def test_extra_args_come_last_verbatim() -> None:
    s = ServerSettings(extra_args=["--swa-full", "-c", "999"])
    argv = build_argv(s, inputs(plan_args=("-ngl", "10")))
    assert argv[-3:] == ["--swa-full", "-c", "999"]
    assert argv.index("-ngl") < len(argv) - 3


def test_pure_same_inputs_same_argv_and_inputs_untouched() -> None:
    plan = ("-c", "1024")
    s = ServerSettings(extra_args=["-v"])
    first = build_argv(s, inputs(plan_args=plan))
    second = build_argv(s, inputs(plan_args=plan))
    assert first == second
    assert plan == ("-c", "1024")
    assert s.extra_args == ["-v"]


def test_kv_relevant_keeps_only_flags_that_change_kv_state() -> None:
    argv = build_argv(
        ServerSettings(threads=4, extra_args=["--swa-full", "-ctk", "q8_0", "--jinja"]),
        inputs(no_repack=True, plan_args=("-ub", "256", "-ngl", "99")),
    )
    kv = kv_relevant(argv)
    assert kv == (
        "-np",
        "2",
        "-c",
        "16384",
        "-ub",
        "256",
        "--swa-full",
        "-ctk",
        "q8_0",
        "--jinja",
    )


def test_kv_relevant_ignores_port_threads_and_paths() -> None:
    a = build_argv(ServerSettings(threads=2), inputs(port=1111))
    b = build_argv(ServerSettings(threads=8), inputs(port=2222, slot_dir=Path("/elsewhere")))
    assert kv_relevant(a) == kv_relevant(b)
    c = build_argv(ServerSettings(ctx_per_slot=4096), inputs())
    assert kv_relevant(a) != kv_relevant(c)


def test_the_model_is_named_by_its_short_name_unless_the_user_names_it() -> None:
    """llama-server answers with `--alias` in every response's `model` and in
    /v1/models, where agents show it: a short stable name, not the file's path."""
    from core.server.model import short_name

    argv = build_argv(ServerSettings(), inputs(model=Path("/m/gemma-3-270m-q4_k_m.gguf")))
    assert value_of(argv, "--alias") == "gemma-3-270m:q4_k_m"
    own = build_argv(ServerSettings(extra_args=["--alias", "mine"]), inputs())
    assert own.count("--alias") == 1 and value_of(own, "--alias") == "mine"
    assert "--alias" not in kv_relevant(argv)  # naming it invalidates no saved state
    names = {
        "Qwen3-Coder-30B-A3B-Instruct-Q4_K_M.gguf": "qwen3-coder-30b-a3b-instruct:q4_k_m",
        "llama-3.1-8b-instruct.IQ4_XS.gguf": "llama-3.1-8b-instruct:iq4_xs",
        "gpt-oss-120b-mxfp4-00001-of-00003.gguf": "gpt-oss-120b:mxfp4",
        "phi-4-BF16.gguf": "phi-4:bf16",
        "tiny.gguf": "tiny",
    }
    assert {n: short_name(Path(n)) for n in names} == names
