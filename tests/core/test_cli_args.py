"""`warmslot`'s global options work before and after every subcommand."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from core.cli import main as cli

# Every command path with what it needs besides the global options. A new subcommand
# must be added here: the first test fails until it is.
COMMANDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("serve",): ("--port", "9000"),
    ("status",): ("--json",),
    ("doctor",): (),
    ("config",): ("set", "server.threads", "4"),
    ("fit",): ("--json",),
    ("build",): ("--jobs", "2"),
    ("build", "list"): ("--json",),
    ("models",): ("--json", "--no-fit"),
    ("models", "use"): ("3",),
    ("clients",): ("--json",),
    ("explain",): ("--json",),
    ("keys",): (),
    ("keys", "add"): ("alice",),
    ("keys", "remove"): ("alice",),
    ("keys", "list"): ("--json",),
    ("worker",): ("--port", "50100"),
    ("bench",): (),  # only through its subcommands below
    ("bench", "overhead"): ("--json",),
    ("bench", "trace"): (),
    ("bench", "swap"): ("--model-a", "a.gguf", "--model-b", "b.gguf"),
    ("bench", "restore"): ("--tiny", "--sizes", "1024", "--json"),
}


def command_paths(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """Every subcommand path the parser knows (``build``, ``build list`` …)."""
    out: set[tuple[str, ...]] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.add((name,))
                out |= {(name, *rest) for rest in command_paths(sub)}
    return out


def runnable() -> list[tuple[str, ...]]:
    """Command paths that parse on their own (`bench` needs one of its subcommands)."""
    return [path for path in COMMANDS if path != ("bench",)]


def test_the_table_names_every_subcommand() -> None:
    assert command_paths(cli.build_parser()) == set(COMMANDS)


@pytest.mark.parametrize("path", runnable(), ids=" ".join)
def test_dev_dir_before_after_or_not_at_all(path: tuple[str, ...]) -> None:
    parser = cli.build_parser()
    args = [*path, *COMMANDS[path]]
    after = parser.parse_args([*args, "--dev-dir", "/after"])
    before = parser.parse_args(["--dev-dir", "/before", *args])
    neither = parser.parse_args(args)
    both = parser.parse_args(["--dev-dir", "/before", *args, "--dev-dir", "/after"])
    assert (after.dev_dir, before.dev_dir, neither.dev_dir) == ("/after", "/before", None)
    assert both.dev_dir == "/after"  # the later one wins, as with any repeated option
    # The subcommand's own options are read either way.
    assert vars(after) == {**vars(before), "dev_dir": "/after"}


def test_dev_dir_between_a_command_and_its_subcommand() -> None:
    args = cli.build_parser().parse_args(["bench", "--dev-dir", "/mid", "trace"])
    assert (args.dev_dir, args.bench_command) == ("/mid", "trace")


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_command_runs_in_the_dev_dir_either_way(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opt = ["--dev-dir", str(tmp_path / "dev")]
    argv = [*opt, "config", "path"] if where == "before" else ["config", "path", *opt]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "dev" / "config" / "warmslot.toml")
