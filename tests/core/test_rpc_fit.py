"""The fit plan over RPC workers: who gets which layers, and when a lost worker is waited for."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import WorkerSettings
from core.machine.devices import GpuInfo, HostInfo
from core.server.fit import FitRequest, plan_argv
from core.server.fit_report import format_plan
from core.server.rpc import (
    RemoteDevice,
    WorkerCheck,
    WorkerSet,
    parse_devices,
    rpc_failure,
    worker_lines,
)
from core.server.rpc_fit import format_workers, plan_with_workers
from tests.core.test_fit import DENSE_70B

GIB = 1 << 30
MIB = 1 << 20
REQ = FitRequest(slots=2, ctx_per_slot=8192, cache_ram_mib=0)


def host(ram_gib: float) -> HostInfo:
    return HostInfo(int(ram_gib * GIB) + 4 * GIB, int(ram_gib * GIB), 0, 0, 500 * GIB)


def worker(port: int, *, layers: int = 0, name: str = "") -> WorkerSettings:
    return WorkerSettings(address="10.0.0.2", port=port, name=name, layers=layers)


def up(w: WorkerSettings, *free_gib: float) -> WorkerCheck:
    devices = tuple(
        RemoteDevice(f"RPC{i}", w.endpoint, w.label, int(g * GIB) + GIB, int(g * GIB))
        for i, g in enumerate(free_gib)
    )
    return WorkerCheck(w, True, devices=devices, elapsed_ms=3.0)


def down(w: WorkerSettings) -> WorkerCheck:
    return WorkerCheck(w, False, problem="connection refused")


def test_a_model_that_fits_on_the_main_host_stays_there() -> None:
    w = worker(50052)
    wp = plan_with_workers(DENSE_70B, [], host(200), REQ, [up(w, 100)])
    assert wp.endpoints == () and wp.argv == []
    assert wp.fits_locally and wp.plan.fits
    assert [d.kind for d in wp.plan.devices] == ["host"]
    assert "fits on the main host" in wp.left_out[w.endpoint]
    ws = WorkerSet(lambda: [w], check=lambda binary, workers, env=None: [up(w, 100)])
    ws.check(Path("llama-server"))
    ws.mark(in_use=wp.endpoints, lost=wp.left_out, waiting=())
    (row,) = ws.snapshot()["workers"]
    assert (row["state"], row["note"]) == (
        "not needed",
        "not needed: the model fits on the main host",
    )


def test_a_model_too_big_for_the_main_host_spreads_over_the_workers_in_order() -> None:
    # ~41 GB of weights; the main host has 20 GB to give, each worker 30 GB.
    a, b = worker(50052, name="a"), worker(50053, name="b")
    wp = plan_with_workers(DENSE_70B, [], host(20), REQ, [up(a, 30), up(b, 30)])
    assert not wp.fits_locally
    assert wp.plan.fits, wp.plan.gave_up
    assert wp.endpoints == ("10.0.0.2:50052", "10.0.0.2:50053")
    assert wp.argv == ["--rpc", "10.0.0.2:50052,10.0.0.2:50053"]
    rpc = [d for d in wp.plan.devices if d.kind == "rpc"]
    assert [d.name for d in rpc] == ["RPC0 a (10.0.0.2:50052)", "RPC1 b (10.0.0.2:50053)"]
    # llama.cpp fills the devices in order: the first worker as far as it fits, the
    # second the rest of the offloaded layers; the first layers stay on the main host.
    assert all(d.fits for d in wp.plan.devices)
    assert rpc[0].layers > 0 and rpc[1].layers > 0
    assert sum(d.layers for d in rpc) == wp.plan.n_gpu_layers
    argv = plan_argv(wp.plan)
    assert argv[argv.index("-ngl") + 1] == str(wp.plan.n_gpu_layers)
    assert argv[argv.index("-ts") + 1] == f"{rpc[0].layers},{rpc[1].layers}"
    text = format_plan(wp.plan)
    assert "RPC0 a (10.0.0.2:50052)" in text and "(--rpc 2 workers: a (10.0.0.2:50052)" in text
    assert "rpc" in wp.plan.reasons and "2 workers" in wp.plan.reasons["rpc"]
    shown = format_workers(wp, [up(a, 30), up(b, 30)])
    assert "--rpc 10.0.0.2:50052,10.0.0.2:50053" in shown and "-ts" in shown


def test_a_worker_with_no_layer_left_is_no_dependency() -> None:
    a, b = worker(50052), worker(50053)
    wp = plan_with_workers(DENSE_70B, [], host(20), REQ, [up(a, 200), up(b, 200)])
    assert wp.endpoints == ("10.0.0.2:50052",)
    assert wp.left_out["10.0.0.2:50053"] == "no layer left for it"
    assert [d.name.split()[0] for d in wp.plan.devices] == ["RPC0", "host"]


def test_pinned_layers_force_the_split_even_when_the_model_fits_locally() -> None:
    a, b, c = worker(50052, layers=30), worker(50053, layers=20), worker(50054)
    wp = plan_with_workers(DENSE_70B, [], host(200), REQ, [up(a, 100), up(b, 100), up(c, 100)])
    assert wp.endpoints == ("10.0.0.2:50052", "10.0.0.2:50053")
    layers = [d.layers for d in wp.plan.devices]
    assert layers == [30, 20, 81 - 50]  # RPC0, RPC1, then the main host keeps the first 31
    assert wp.plan.n_gpu_layers == 50
    assert plan_argv(wp.plan)[-2:] == ["-ts", "30,20"]
    assert "pinned" in wp.left_out["10.0.0.2:50054"]


def test_pinned_layers_of_a_two_device_worker_are_shared_and_local_gpus_get_the_rest() -> None:
    a = worker(50052, layers=11)
    gpus = [GpuInfo(0, "Local 80 GB", 80 * GIB, 79 * GIB)]
    wp = plan_with_workers(DENSE_70B, gpus, host(200), REQ, [up(a, 50, 50)])
    layers = [(d.name.split()[0], d.layers) for d in wp.plan.devices]
    assert layers == [("RPC0", 6), ("RPC1", 5), ("GPU0", 81 - 11), ("host", 0)]
    assert wp.plan.n_gpu_layers == 81


def test_workers_that_do_not_answer_are_left_out_and_named() -> None:
    a, b = worker(50052, name="a"), worker(50053, name="b")
    wp = plan_with_workers(DENSE_70B, [], host(20), REQ, [down(a), up(b, 60)])
    assert wp.endpoints == ("10.0.0.2:50053",)
    assert wp.left_out["10.0.0.2:50052"] == "not answering: connection refused"
    assert wp.plan.fits


def test_worker_set_names_a_lost_worker_and_waits_when_the_rest_is_too_small(
    tmp_path: Path,
) -> None:
    from core.server import rpc_fit
    from core.server.rpc import WorkerUnavailable

    a, b = worker(50052, name="a"), worker(50053, name="b")
    answers = {a.endpoint: up(a, 30), b.endpoint: up(b, 30)}
    notes: list[str] = []
    ws = WorkerSet(
        lambda: [a, b],
        check=lambda binary, workers, env=None: [answers[w.endpoint] for w in workers],
        notify=notes.append,
    )

    def launch(ram_gib: float) -> rpc_fit.WorkerPlan:
        checks = ws.check(Path("llama-server"))
        wp = plan_with_workers(DENSE_70B, [], host(ram_gib), REQ, checks)
        missing = [c.worker.label for c in checks if not c.ok]
        if missing and not wp.plan.fits:
            ws.mark(in_use=(), lost=wp.left_out, waiting=missing)
            raise WorkerUnavailable("waiting", workers=missing)
        ws.mark(in_use=wp.endpoints, lost=wp.left_out, waiting=())
        return wp

    assert launch(20).endpoints == (a.endpoint, b.endpoint)
    assert [r["state"] for r in ws.snapshot()["workers"]] == ["in use", "in use"]
    # b goes away; a alone is enough with more host RAM: run without b, and say so.
    answers[b.endpoint] = down(b)
    assert launch(35).endpoints == (a.endpoint,)
    assert notes == [
        "worker b (10.0.0.2:50053) left out of the launch (not answering: connection "
        "refused): running without it"
    ]
    rows = {r["label"]: r for r in ws.snapshot()["workers"]}
    assert rows["b (10.0.0.2:50053)"]["state"] == "left out"
    assert rows["b (10.0.0.2:50053)"]["note"] == "not answering: connection refused"
    # a goes away too and the host alone is too small: wait, naming both.
    answers[a.endpoint] = down(a)
    with pytest.raises(WorkerUnavailable) as err:
        launch(20)
    assert err.value.workers == ("a (10.0.0.2:50052)", "b (10.0.0.2:50053)")
    snap = ws.snapshot()
    assert snap["waiting_for"] == ["a (10.0.0.2:50052)", "b (10.0.0.2:50053)"]
    assert [r["state"] for r in snap["workers"]] == ["waiting", "waiting"]
    assert notes[-1] == "worker a (10.0.0.2:50052) stopped answering: waiting for it"
    text = "\n".join(worker_lines(snap))
    assert "waiting for: a (10.0.0.2:50052), b (10.0.0.2:50053)" in text
    # `warmslot status` prints the same lines.
    from core.cli.main import format_status
    from tests.fixtures.status_shapes import complete

    shown = format_status(
        complete({"server": {"state": "starting", "reason": "waiting"}, "workers": snap})
    )
    assert "workers (llama.cpp RPC):" in shown and text.splitlines()[-1] in shown


def test_device_lines_and_rpc_failures_are_read_from_llama_server_output() -> None:
    out = (
        "Available devices:\n"
        "  RPC0: 127.0.0.1:50052 (15934 MiB, 12044 MiB free)\n"
        "  RPC1: 127.0.0.1:50052 (100 MiB, 50 MiB free)\n"
        "  CUDA0: NVIDIA H200 (143000 MiB, 140000 MiB free)\n"
    )
    assert parse_devices(out, "127.0.0.1:50052") == [
        ("RPC0", 15934 * MIB, 12044 * MIB),
        ("RPC1", 100 * MIB, 50 * MIB),
    ]
    assert parse_devices(out, "127.0.0.1:50053") == []
    lines = [
        "srv  update_slots: all slots are idle",
        "/src/ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response",
        "Aborted",
    ]
    assert "Remote RPC server crashed" in rpc_failure(lines)
    assert rpc_failure(["main: server is listening"]) == ""


def test_the_split_joins_the_slot_file_identity_only_with_rpc() -> None:
    from core.server.argv import kv_relevant

    base = ["llama-server", "-m", "m.gguf", "-np", "2", "-c", "8192", "-ngl", "99"]
    # Without --rpc nothing changes: existing slot folders keep their names.
    assert kv_relevant(base) == ("-np", "2", "-c", "8192")
    split = [*base[:-2], "--rpc", "10.0.0.2:50052", "-ngl", "4", "-ts", "2,2"]
    kv = kv_relevant(split)
    assert kv == ("-np", "2", "-c", "8192", "--rpc", "10.0.0.2:50052", "-ngl", "4", "-ts", "2,2")
    assert kv_relevant([*split[:-1], "3,1"]) != kv
    assert kv_relevant([*split[:-6], "--rpc", "10.0.0.3:50052", *split[-4:]]) != kv


def test_the_rpc_server_is_found_beside_llama_server_else_on_path(tmp_path: Path) -> None:
    from core.server.rpc import RPC_SERVER_NAME, find_rpc_server

    build, elsewhere = tmp_path / "build" / "bin", tmp_path / "path"
    for d in (build, elsewhere):
        d.mkdir(parents=True)
        (d / RPC_SERVER_NAME).write_text("#!/bin/sh\n")
        (d / RPC_SERVER_NAME).chmod(0o755)
    server = build / "llama-server"
    assert find_rpc_server(server, path_env=str(elsewhere)) == build / RPC_SERVER_NAME
    (build / RPC_SERVER_NAME).unlink()
    assert find_rpc_server(server, path_env=str(elsewhere)) == elsewhere / RPC_SERVER_NAME
    assert find_rpc_server(None, path_env=str(tmp_path / "none")) is None
