"""llama-server's log file: every line it prints, one run after another, rotated by size."""

from __future__ import annotations

from pathlib import Path

from core.events import ServerLaunched
from core.server.logfile import KEEP, ServerLogFile
from tests.conftest import MakeCore
from tests.helpers import EventLog, make_fake_binary


def test_rotation_keeps_the_newest_lines_in_order_within_the_limits(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "llama-server.log"  # the folder is made on open
    log = ServerLogFile(path, max_bytes=300)
    try:
        written = [f"line {i:03d} 100% of é \udcff?"[:20] for i in range(200)]
        written[-1] = "last: %s %d 100%"  # printed as it is, never interpolated
        for i in range(0, len(written), 7):  # as the pump writes them: a chunk at a time
            log.write(written[i : i + 7])
    finally:
        log.close()

    files = [path, *(path.with_name(f"{path.name}.{i}") for i in range(1, KEEP + 1))]
    assert all(f.is_file() for f in files)
    assert not path.with_name(f"{path.name}.{KEEP + 1}").exists()  # KEEP backups kept
    assert all(f.stat().st_size <= 300 for f in files)
    # Oldest backup first: the newest lines, contiguous and in order, end with the last.
    kept = [ln for f in reversed(files) for ln in f.read_text("utf-8").splitlines()]
    expected = [ln.encode("utf-8", "replace").decode("utf-8") for ln in written]
    assert 30 < len(kept) < len(written)
    assert kept == expected[-len(kept) :]
    assert kept[-1] == "last: %s %d 100%"


def test_a_bad_line_does_not_stop_the_log(tmp_path: Path) -> None:
    log = ServerLogFile(tmp_path / "llama-server.log")
    try:
        log.write(["before \udcff after"])  # a lone surrogate: replaced
        log.write(["next"])
    finally:
        log.close()
    assert (tmp_path / "llama-server.log").read_text("utf-8").splitlines() == [
        "before ? after",
        "next",
    ]


def test_each_run_is_appended_under_its_launch_line(make_core: MakeCore, tmp_path: Path) -> None:
    fake = make_fake_binary(tmp_path / "bin")
    core = make_core(server__binary=str(fake), binary_check=None)
    log = EventLog()
    core.subscribe(log.append)
    core.start(wait_ready=True, timeout=60)
    core.restart_server().result(timeout=60)
    core.stop_server().result(timeout=30)

    first, second = log.of(ServerLaunched)
    lines = core.paths.server_log.read_text("utf-8").splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("==== warmslot: launching run ")]
    assert [lines[i].split()[4].rstrip(":") for i in starts] == [first.run_id, second.run_id]
    assert lines[starts[0]].endswith(" ".join(first.argv))
    # What the server printed follows its own launch line, as printed.
    for begin, end in ((starts[0], starts[1]), (starts[1], len(lines))):
        run = lines[begin + 1 : end]
        assert any("load_model: loading model" in ln for ln in run), run
