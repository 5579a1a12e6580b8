"""Supervisor faults a real llama-server cannot show on demand, with a fake server.

The fake (tests/fakes/fake_llama_server.py) is launched exactly like llama-server
(through `settings.server.binary`, probed with ``--version``), so these tests run
the real Core, supervisor, process groups and telemetry; only the server is fake.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from core.errors import ServerStartFailed
from core.events import ServerExited, ServerLaunched, ServerStateChanged
from core.server.supervisor import ServerState
from tests.conftest import MakeCore
from tests.helpers import EventLog, make_fake_binary, pid_gone, wait_until

SIGSEGV = int(signal.SIGSEGV)


def started_with_log(core: object) -> EventLog:
    log = EventLog()
    core.subscribe(log.append)  # type: ignore[attr-defined]
    return log


def read_pid(pidfile: Path) -> int:
    text = wait_until(
        lambda: pidfile.read_text() if pidfile.exists() else "", 10, message="helper pid file"
    )
    return int(text)


def test_warmup_crash_retries_once_with_no_repack_and_remembers_it(
    make_core: MakeCore, tmp_path: Path
) -> None:
    launches = tmp_path / "launches.txt"
    fake = make_fake_binary(
        tmp_path / "bin", "--fake-mode", "crash-warmup", "--fake-launch-log", str(launches)
    )
    home = tmp_path / "home"
    core = make_core(home=home, server__binary=str(fake), binary_check=None)
    log = started_with_log(core)
    core.start(wait_ready=True, timeout=60)

    launched = log.of(ServerLaunched)
    assert [e.attempt for e in launched] == ["start", "no-repack-retry"]
    assert "--no-repack" not in launched[0].argv
    assert "--no-repack" in launched[1].argv
    (exited,) = log.of(ServerExited)
    assert exited.run_id == launched[0].run_id
    assert (exited.outcome, exited.signal, exited.requested_by) == (
        "start_failed",
        SIGSEGV,
        "startup",
    )
    assert any("repack" in line for line in exited.last_lines)
    assert log.states() == ["starting", "ready"]  # the retry happens inside one start
    assert core.supervisor is not None
    snap = core.supervisor.snapshot()
    assert snap["state"] == "ready" and snap["no_repack"] is True

    quirks = json.loads((home / "state" / "binary-quirks.json").read_text())
    entry = quirks[snap["binary"]["identity"]]
    assert entry["no_repack"] is True and "warm-up" in entry["reason"]

    runs = {r["run_id"]: r for r in core.query("server_runs").result(10)}
    assert runs[launched[0].run_id]["outcome"] == "start_failed"
    assert runs[launched[0].run_id]["signal"] == SIGSEGV
    assert runs[launched[1].run_id]["attempt"] == "no-repack-retry"
    assert runs[launched[1].run_id]["outcome"] is None  # still running

    # The proxy serves through the retried server (and forces cache_prompt on).
    assert core.proxy is not None
    r = httpx.post(
        f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["echo_cache_prompt"] is True
    core.stop()

    # The next start of this binary uses --no-repack at once: no crash, no retry.
    again = make_core(home=home, server__binary=str(fake), binary_check=None)
    log2 = started_with_log(again)
    again.start(wait_ready=True, timeout=60)
    (first,) = log2.of(ServerLaunched)
    assert first.attempt == "start" and "--no-repack" in first.argv
    assert log2.of(ServerExited) == []
    again.stop()
    assert [line.split()[1] for line in launches.read_text().splitlines()] == [
        "no_repack=0",
        "no_repack=1",
        "no_repack=1",
    ]


def test_warmup_crash_is_not_retried_when_no_repack_is_off(
    make_core: MakeCore, tmp_path: Path
) -> None:
    fake = make_fake_binary(tmp_path / "bin", "--fake-mode", "crash-warmup")
    core = make_core(server__binary=str(fake), binary_check=None, server__no_repack="off")
    log = started_with_log(core)
    with pytest.raises(ServerStartFailed, match="killed by signal SIGSEGV"):
        core.start(wait_ready=True, timeout=60)
    assert [e.attempt for e in log.of(ServerLaunched)] == ["start"]
    assert core.supervisor is not None and core.supervisor.state is ServerState.FAILED
    assert not (core.paths.state_dir / "binary-quirks.json").exists()


def test_slow_start_fails_after_the_timeout_and_kills_the_group(
    make_core: MakeCore, tmp_path: Path
) -> None:
    pidfile = tmp_path / "helper.pid"
    fake = make_fake_binary(
        tmp_path / "bin", "--fake-mode", "slow-start", "--fake-fork-child", str(pidfile)
    )
    core = make_core(server__binary=str(fake), binary_check=None)
    core.settings.server.start_timeout_s = 2.0  # below the schema's minimum, on purpose
    log = started_with_log(core)
    core.start(start_server=False)
    t0 = time.monotonic()
    with pytest.raises(ServerStartFailed, match=r"not healthy after 2 s") as e:
        core.start_server().result(timeout=60)
    elapsed = time.monotonic() - t0
    assert 2.0 <= elapsed < 8.0, elapsed
    assert "server log" in e.value.hint

    (launched,) = log.of(ServerLaunched)
    helper = read_pid(pidfile)
    assert pid_gone(launched.pid)
    wait_until(lambda: pid_gone(helper), 5, message="the helper (ignores SIGTERM) survived")
    (exited,) = log.of(ServerExited)
    assert exited.outcome == "start_failed" and exited.signal == int(signal.SIGTERM)
    assert any("loading model" in line for line in exited.last_lines)
    assert core.supervisor is not None and core.supervisor.state is ServerState.FAILED
    failed = log.of(ServerStateChanged)[-1]
    assert failed.state == "failed" and "not healthy after 2 s" in failed.reason


def test_crash_loop_backs_off_then_gives_up(make_core: MakeCore, tmp_path: Path) -> None:
    fake = make_fake_binary(tmp_path / "bin", "--fake-crash-after", "0.3")
    core = make_core(server__binary=str(fake), binary_check=None, server__max_restarts=3)
    core.settings.server.backoff_max_s = 0.75  # caps the doubling 0.5 → 1.0 → 2.0
    log = started_with_log(core)
    core.start(wait_ready=True, timeout=60)
    sup = core.supervisor
    assert sup is not None
    wait_until(lambda: sup.state is ServerState.FAILED, 60, message=lambda: str(log.states()))

    launched = log.of(ServerLaunched)
    exited = log.of(ServerExited)
    assert [e.attempt for e in launched] == ["start", "restart", "restart", "restart"]
    assert [(e.outcome, e.signal, e.requested_by) for e in exited] == [
        ("crashed", SIGSEGV, "nobody (crash)")
    ] * 4
    assert [e.run_id for e in exited] == [e.run_id for e in launched]
    # Each restart waits its backoff after the crash: 0.5 s, then capped at 0.75 s.
    for i, want in enumerate([0.5, 0.75, 0.75]):
        waited = launched[i + 1].ts - exited[i].ts
        assert waited >= want - 0.01, (i, waited)
    reasons = [e.reason for e in log.of(ServerStateChanged) if e.state == "starting"][1:]
    assert [r.split("; ")[1] for r in reasons] == [
        "restart 1 in 0.5 s",
        "restart 2 in 0.8 s",
        "restart 3 in 0.8 s",
    ]
    assert log.states()[-1] == "failed"
    assert "gave up after 3 restarts" in sup.state_reason
    assert all(pid_gone(e.pid) for e in launched)

    runs = core.query("server_runs").result(10)
    assert sorted(r["outcome"] for r in runs) == ["crashed"] * 4
    # While failed, the proxy answers 503 and says so.
    assert core.proxy is not None
    r = httpx.get(f"http://127.0.0.1:{core.proxy.port}/v1/models", timeout=10)
    assert r.status_code == 503 and "state: failed" in r.json()["error"]["message"]


def test_stop_kills_the_whole_process_group(make_core: MakeCore, tmp_path: Path) -> None:
    pidfile = tmp_path / "helper.pid"
    fake = make_fake_binary(tmp_path / "bin", "--fake-fork-child", str(pidfile))
    core = make_core(server__binary=str(fake), binary_check=None)
    log = started_with_log(core)
    core.start(wait_ready=True, timeout=60)
    assert core.supervisor is not None
    leader = core.supervisor.pid
    assert leader is not None
    helper = read_pid(pidfile)
    assert os.getpgid(helper) == leader  # the helper is in llama-server's own group
    assert os.getpgid(leader) != os.getpgid(0)  # which is not ours

    core.stop_server().result(timeout=30)
    assert pid_gone(leader)
    wait_until(lambda: pid_gone(helper), 5, message="helper survived stop")
    (exited,) = log.of(ServerExited)
    assert (exited.outcome, exited.requested_by) == ("requested", "user")
    assert core.supervisor.state is ServerState.STOPPED and core.supervisor.pid is None


def test_crash_with_a_surviving_helper_still_restarts(make_core: MakeCore, tmp_path: Path) -> None:
    """A helper that keeps llama-server's stdout open must not stall crash handling."""
    pidfile = tmp_path / "helper.pid"
    fake = make_fake_binary(
        tmp_path / "bin", "--fake-fork-child", str(pidfile), "--fake-crash-after", "0.5"
    )
    core = make_core(server__binary=str(fake), binary_check=None, server__max_restarts=1)
    log = started_with_log(core)
    core.start(wait_ready=True, timeout=60)
    helper = read_pid(pidfile)
    wait_until(lambda: len(log.of(ServerExited)) >= 1, 20, message="crash not noticed")
    wait_until(lambda: pid_gone(helper), 5, message="the crashed server's helper survived")
    wait_until(lambda: len(log.of(ServerLaunched)) >= 2, 20, message="no restart after crash")


def test_a_failed_server_is_tried_again_after_a_longer_wait(
    make_core: MakeCore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Giving up after the restarts is not for good: the supervisor starts it again after
    `FAILED_RETRY_S` (doubling), so a crash loop never ends in a permanent 503."""
    from core.server import supervisor as supervisor_mod

    monkeypatch.setattr(supervisor_mod, "FAILED_RETRY_S", 1.0)
    fake = make_fake_binary(tmp_path / "bin", "--fake-crash-after", "0.3")
    core = make_core(server__binary=str(fake), binary_check=None, server__max_restarts=1)
    core.settings.server.backoff_max_s = 0.5
    log = started_with_log(core)
    core.start(wait_ready=True, timeout=60)
    sup = core.supervisor
    assert sup is not None

    def failed(wait: str) -> list[ServerStateChanged]:
        return [
            e
            for e in log.of(ServerStateChanged)
            if e.state == "failed" and f"trying again in {wait}" in e.reason
        ]

    # Read from the events, not the live state: on a loaded machine the retry may have
    # begun by the time a test thread looks.
    first = wait_until(lambda: failed("1 s"), 60, message=lambda: str(log.states()))[0]
    assert "gave up after 1 restarts" in first.reason
    # start, restart, then the retry after failing, which crashes and gives up again with
    # a wait twice as long.
    wait_until(lambda: len(log.of(ServerLaunched)) >= 3, 60, message=lambda: str(log.states()))
    assert log.of(ServerLaunched)[2].ts - first.ts >= 0.9
    wait_until(lambda: failed("2 s"), 60, message=lambda: sup.state_reason)
    core.stop()  # a pending retry does not outlive the stop
    assert sup.state is ServerState.STOPPED
