"""A model split over llama.cpp RPC workers (docs/scale.md): real processes on loopback.

Two `warmslot worker` processes (each supervising a real ``ggml-rpc-server`` on CPU)
hold layers of a real tiny model; the main host's llama-server reaches them with
``--rpc``. The split is forced through the workers' ``layers`` setting (a tiny model
fits anywhere, so the planner alone would keep it on the main host).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from core.config import WorkerSettings
from core.engine import Core
from core.events import Notice, ServerExited, ServerStateChanged
from core.server.rpc import find_rpc_server, tcp_problem
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.helpers import REPO, EventLog, free_port, pid_gone, post_chat, wait_until

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def rpc_server(server_binary: Path) -> Path:
    found = find_rpc_server(server_binary)
    if found is None:
        pytest.skip(
            f"no ggml-rpc-server beside {server_binary}: that llama-server was built without "
            "-DGGML_RPC=ON (Warmslot's own build has it)"
        )
    return found


@pytest.fixture(scope="module")
def tiny4(server_binary: Path) -> Path:
    """The tiny random-weight model with 4 layers, so two workers each get some."""
    return make_tiny_model(cache_dir() / "tiny-4layers.gguf", n_layer=4)


class Worker:
    """One `warmslot worker` process (and its ggml-rpc-server child) on loopback."""

    def __init__(self, rpc_server: Path, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        with log.open("w") as out:  # the child keeps its own copy of the descriptor
            self.proc = self._spawn(rpc_server, port, out)
        wait_until(
            lambda: not tcp_problem("127.0.0.1", port, 1.0) or self.proc.poll() is not None,
            60,
            message=f"worker on port {port} never listened",
        )
        assert self.proc.poll() is None, log.read_text()

    @staticmethod
    def _spawn(rpc_server: Path, port: int, out: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "core.cli.main", "worker", "--port", str(port)),
                *("--threads", "1", "--binary", str(rpc_server)),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=out,
            start_new_session=True,
        )

    def children(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def kill(self) -> None:
        """SIGKILL the worker and its ggml-rpc-server: a machine that went away."""
        kids = self.children()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.kill()
        self.proc.wait(10)
        wait_until(lambda: all(pid_gone(k.pid) for k in kids), 10)


@pytest.fixture
def workers(rpc_server: Path, tmp_path: Path) -> Iterator[list[Worker]]:
    made = [Worker(rpc_server, free_port(), tmp_path / f"worker{i}.log") for i in range(2)]
    yield made
    for w in made:
        if w.proc.poll() is None:
            w.kill()


def complete(core: Core, *, max_tokens: int = 12, expect: int | None = 200) -> dict[str, Any]:
    """A greedy completion through the proxy, with the top log-probs of each token."""
    body = {
        "model": "warmslot-test",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 3,
    }
    data: dict[str, Any] = post_chat(core, body, path="/v1/completions", expect=expect).json()
    return data


def answer(data: dict[str, Any]) -> tuple[str, list[float]]:
    choice = data["choices"][0]
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if not logprobs and isinstance((choice.get("logprobs") or {}).get("content"), list):
        logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
    return choice["text"], [float(x) for x in logprobs]


def split_core(make_core: MakeCore, tiny4: Path, workers: list[Worker]) -> Core:
    core = make_core(
        server__model=str(tiny4),
        server__slots=1,
        cache__enabled=False,
        server__extra_args=["-lv", "4"],  # the load log names each device's buffers
    )
    core.settings.workers = [
        WorkerSettings(address="127.0.0.1", port=w.port, name=f"w{i}", layers=2)
        for i, w in enumerate(workers)
    ]
    return core


def test_split_over_two_workers_answers_as_one_host_and_shows_the_split(
    make_core: MakeCore, tiny4: Path, workers: list[Worker]
) -> None:
    alone = make_core(server__model=str(tiny4), server__slots=1, cache__enabled=False)
    alone.start(wait_ready=True, timeout=180)
    text1, lp1 = answer(complete(alone))
    assert alone.supervisor is not None and alone.supervisor.resolved is not None
    alone_slots = alone.supervisor.resolved.slot_dir
    alone.stop()

    core = split_core(make_core, tiny4, workers)
    core.start(wait_ready=True, timeout=180)
    assert core.supervisor is not None
    argv = core.supervisor.argv
    endpoints = ",".join(f"127.0.0.1:{w.port}" for w in workers)
    assert argv[argv.index("--rpc") + 1] == endpoints, argv
    assert argv[argv.index("-ngl") + 1] == "4" and argv[argv.index("-ts") + 1] == "2,2", argv
    # The fit plan shows the split per device, named as llama-server names them.
    plan = core.fit_plan
    assert plan is not None
    rows = [(d.name, d.kind, d.layers) for d in plan.devices]
    assert rows == [
        (f"RPC0 w0 (127.0.0.1:{workers[0].port})", "rpc", 2),
        (f"RPC1 w1 (127.0.0.1:{workers[1].port})", "rpc", 2),
        ("host RAM", "host", 1),
    ]
    # llama-server itself put the layers there (its load log names the RPC buffers).
    log = "\n".join(core.supervisor.output.tail)
    assert "RPC0" in log and "RPC1" in log, log[-3000:]
    text2, lp2 = answer(complete(core))
    assert text2 == text1
    assert len(lp2) == len(lp1) > 0
    assert max(abs(a - b) for a, b in zip(lp1, lp2, strict=True)) < 1e-3, (lp1, lp2)
    # Slot files of another layout are another state (docs/scale.md#slot-files): the
    # split launch keeps its own folder.
    assert core.supervisor.resolved is not None
    assert core.supervisor.resolved.slot_dir.name != alone_slots.name
    status = core.status().result(30)
    rows_st = {r["label"]: r["state"] for r in status["workers"]["workers"]}
    assert set(rows_st.values()) == {"in use"}, rows_st


def test_a_killed_worker_is_named_and_the_server_restarts_without_it(
    make_core: MakeCore, tiny4: Path, workers: list[Worker]
) -> None:
    core = split_core(make_core, tiny4, workers)
    events = EventLog()
    core.subscribe(events.append, (Notice, ServerExited, ServerStateChanged))
    core.start(wait_ready=True, timeout=180)
    before, _ = answer(complete(core))
    assert core.supervisor is not None
    first_pid = core.supervisor.pid

    workers[1].kill()
    # The next request is what finds out: llama-server aborts on the broken connection.
    # It had gone out, so the proxy does not send it again (it may have run): the client
    # gets a 502 that says so, or a 503 once the crash is known (docs/llama-server-facts.md).
    lost = complete(core, expect=None)
    assert lost["error"]["code"] in (502, 503), lost
    wait_until(
        lambda: any(e.outcome == "crashed" for e in events.of(ServerExited)),
        120,
        message=lambda: "\n".join(list(core.supervisor.output.tail)[-20:]),  # type: ignore[union-attr]
    )
    crash = next(e for e in events.of(ServerExited) if e.outcome == "crashed")
    assert crash.pid == first_pid
    reasons = [e.reason for e in events.of(ServerStateChanged)]
    assert any(
        "SIGABRT, an RPC worker stopped answering" in r and "Remote RPC server" in r
        for r in reasons
    ), reasons
    wait_until(
        lambda: (
            core.supervisor is not None
            and core.supervisor.state.value == "ready"
            and core.supervisor.pid != first_pid
        ),
        180,
        message=lambda: f"{core.supervisor.state} {core.supervisor.state_reason}",  # type: ignore[union-attr]
    )
    # Named: the notice says which worker, and status shows it left out.
    label = f"w1 (127.0.0.1:{workers[1].port})"
    notes = [n.text for n in events.of(Notice)]
    assert any(label in t and "running without it" in t for t in notes), notes
    rows = {r["label"]: r for r in core.status().result(30)["workers"]["workers"]}
    assert rows[label]["state"] == "left out"
    assert "not answering" in rows[label]["note"]
    assert rows[f"w0 (127.0.0.1:{workers[0].port})"]["state"] == "in use"
    argv = core.supervisor.argv
    assert argv[argv.index("--rpc") + 1] == f"127.0.0.1:{workers[0].port}"
    after, _ = answer(complete(core))
    assert after == before


def test_a_worker_lost_while_idle_is_found_before_a_request(
    make_core: MakeCore, tiny4: Path, workers: list[Worker]
) -> None:
    core = split_core(make_core, tiny4, workers)
    events = EventLog()
    core.subscribe(events.append, (Notice, ServerExited))
    core.start(wait_ready=True, timeout=180)
    before, _ = answer(complete(core))
    assert core.supervisor is not None
    first_pid = core.supervisor.pid

    workers[0].kill()
    # No request: an idle llama-server would not notice (its /health stays 200); the
    # worker watch does, and restarts it without the worker.
    wait_until(
        lambda: (
            core.supervisor is not None
            and core.supervisor.state.value == "ready"
            and core.supervisor.pid != first_pid
        ),
        120,
        message=lambda: f"{core.supervisor.state} {core.supervisor.state_reason}",  # type: ignore[union-attr]
    )
    exits = events.of(ServerExited)
    assert [e.outcome for e in exits] == ["requested"], exits  # stopped, never crashed
    assert f"w0 (127.0.0.1:{workers[0].port})" in exits[0].requested_by
    argv = core.supervisor.argv
    assert argv[argv.index("--rpc") + 1] == f"127.0.0.1:{workers[1].port}"
    after, _ = answer(complete(core))
    assert after == before


def test_warmslot_worker_restarts_its_rpc_server_and_stops_cleanly(
    workers: list[Worker],
) -> None:
    w = workers[0]
    (child,) = [p for p in w.children() if "ggml-rpc-server" in p.name()]
    child.kill()  # a crash of the RPC server, not of the machine
    wait_until(
        lambda: (
            [p for p in w.children() if "ggml-rpc-server" in p.name() and p.pid != child.pid]
            and not tcp_problem("127.0.0.1", w.port, 1.0)
        ),
        30,
        message=lambda: w.log.read_text(),
    )
    assert "restart 1 in 0.5 s" in w.log.read_text()
    (new_child,) = [p for p in w.children() if "ggml-rpc-server" in p.name()]
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0
    wait_until(lambda: pid_gone(new_child.pid), 10)
    assert tcp_problem("127.0.0.1", w.port, 1.0)  # nothing listens there any more
    assert "warmslot worker: stopped" in w.log.read_text()


def test_warmslot_worker_warns_when_bound_beyond_loopback(rpc_server: Path, tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the bind fails harmlessly,
    # after the warning.
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "core.cli.main", "worker", "--host", "192.0.2.1"),
                *("--port", str(free_port()), "--binary", str(rpc_server)),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=out,
            start_new_session=True,
        )
    try:
        wait_until(lambda: "NO authentication" in log.read_text(), 30, message=log.read_text)
        text = log.read_text()
        assert "reachable from the network on 192.0.2.1" in text
        assert "trust" in text and "docs/scale.md#security" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_launch_that_needs_a_missing_worker_waits_for_it_without_giving_up(
    server_binary: Path, tiny4: Path, tmp_path: Path
) -> None:
    """The supervisor's side of "else wait for it": a resolver that reports a missing
    worker (as `launch_plan` does when the model does not fit without it) keeps the
    server starting, checking again with backoff, beyond `max_restarts`."""
    import asyncio
    import itertools
    import time

    from core.paths import Paths
    from core.server import discover, model
    from core.server.rpc import WorkerUnavailable
    from core.server.supervisor import Resolved, ServerState, Supervisor
    from tests.conftest import settings_for

    paths = Paths.under(tmp_path)
    found = discover.discover(paths, str(server_binary), check=None).found
    assert found is not None
    resolved = Resolved(binary=found, model=model.resolve(paths, str(tiny4)))
    server = settings_for(tiny4).server
    server.max_restarts = 0  # a wait is no restart: it must not use these up
    attempts: list[float] = []
    events: list[Any] = []

    async def resolve() -> Resolved:
        attempts.append(time.monotonic())
        if len(attempts) <= 3:
            raise WorkerUnavailable(
                "waiting for worker w9 (127.0.0.1:9) (connection refused): the model does "
                "not fit without it",
                workers=["w9 (127.0.0.1:9)"],
            )
        return resolved

    async def main() -> None:
        sup = Supervisor(paths=paths, settings=lambda: server, resolve=resolve, emit=events.append)
        try:
            await sup.start()  # returns: waiting is not a failure
            assert sup.state is ServerState.STARTING
            assert sup.state_reason.startswith("waiting for worker w9 (127.0.0.1:9)")
            assert "checking again in" in sup.state_reason
            assert await sup.wait_ready(120), sup.state_reason
        finally:
            await sup.close()

    asyncio.run(main())
    assert len(attempts) == 4
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0 and gaps[2] >= 2.0, gaps  # backing off
    states = [e.state for e in events if isinstance(e, ServerStateChanged)]
    assert states == ["starting", "ready", "stopping", "stopped"], states  # never "failed"


def test_an_rpc_abort_at_startup_is_not_taken_for_the_amx_crash(
    make_core: MakeCore, tiny4: Path, tmp_path: Path
) -> None:
    """llama-server aborts (SIGABRT) while parsing ``--rpc`` when a worker is unreachable;
    that must not be retried with --no-repack nor remembered as the binary's quirk."""
    from core.errors import ServerStartFailed
    from core.events import ServerLaunched

    home = tmp_path / "home"
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    core = make_core(home=home, server__model=str(tiny4), server__extra_args=["--rpc", dead])
    events = EventLog()
    core.subscribe(events.append, (ServerLaunched, ServerExited))
    with pytest.raises(ServerStartFailed) as err:
        core.start(wait_ready=True, timeout=120)
    assert "SIGABRT" in str(err.value)
    assert [e.attempt for e in events.of(ServerLaunched)] == ["start"]  # no --no-repack retry
    assert [e.outcome for e in events.of(ServerExited)] == ["start_failed"]
    assert core.supervisor is not None
    assert any(f"Failed to connect to {dead}" in line for line in core.supervisor.output.tail)
    assert not (home / "state" / "binary-quirks.json").exists()


def test_warmslot_fit_shows_each_worker_and_the_split(
    server_binary: Path, tiny4: Path, workers: list[Worker], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    config = home / "config" / "warmslot.toml"
    config.parent.mkdir(parents=True)
    tables = "".join(
        f'[[workers]]\naddress = "127.0.0.1"\nport = {w.port}\nname = "w{i}"\nlayers = 2\n\n'
        for i, w in enumerate(workers)
    )
    config.write_text(
        f'[server]\nbinary = "{server_binary}"\nmodel = "{tiny4}"\n\n' + tables, encoding="utf-8"
    )
    env = {**os.environ, "WARMSLOT_HOME": str(home)}
    run = subprocess.run(
        [sys.executable, "-m", "core.cli.main", "fit", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    endpoints = [f"127.0.0.1:{w.port}" for w in workers]
    assert doc["workers"]["rpc"] == endpoints
    assert [c["ok"] for c in doc["workers"]["checks"]] == [True, True]
    devices = [(d["name"].split()[0], d["kind"], d["layers"]) for d in doc["plan"]["devices"]]
    assert devices == [("RPC0", "rpc", 2), ("RPC1", "rpc", 2), ("host", "host", 1)]
    text = subprocess.run(
        [sys.executable, "-m", "core.cli.main", "fit"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert f"w0 ({endpoints[0]}): ✔ RPC0" in text and f"w1 ({endpoints[1]}): ✔ RPC1" in text
    assert f"llama-server --rpc {','.join(endpoints)} -ngl 4" in text and "-ts 2,2" in text
