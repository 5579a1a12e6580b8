"""A real GPU API: the patched llama-server's Vulkan backend on Mesa's lavapipe device.

Slow and opt-in: set ``WARMSLOT_SLOW_TESTS=1``. The binary is ``WARMSLOT_VULKAN_SERVER``, else
the newest Vulkan build in the test cache's ``gpu-home`` (``warmslot build --backend vulkan``
with ``WARMSLOT_HOME`` there: glslc, libvulkan-dev and mesa-vulkan-drivers from Debian, about
an hour on 2 cores; docs/gpu.md). Each test skips, saying why, when there is no such build or
the build lists no Vulkan device. It checks, on the device:

* device discovery: llama.cpp's device list is what the fit and the pressure monitor read;
* the layers are on the device: Warmslot launches with llama.cpp's placement
  (llama-fit-params' ``-ngl``, ``--fit off``);
* the restore path: save, restore, verify with the known-answer probe — the mutation suite of
  tests/integration/test_restore_mutations.py (20 mutations, none accepted) and 20 good
  restores verified, with the probe's largest log-prob deviation printed (run with ``-s``);
  lavapipe restores bit for bit, so the probe keeps the CPU's tolerance of 0;
* a tiny MoE model whose experts do not fit under a ``--fit-target``: ``warmslot fit`` shows
  llama.cpp moving expert tensors to the CPU, and the launch uses that placement.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.build import list_builds
from core.cli.main import main as cli_main
from core.engine import Core
from core.machine.devices import GpuInfo, gpus_for, read_llama_devices
from core.machine.pressure import Sampler
from core.paths import Paths
from core.server.tinymodel import make_tiny_model, make_tiny_moe_model
from tests.conftest import settings_for
from tests.conftest import test_cache as cache_dir
from tests.helpers import wait_until
from tests.integration.test_restore_mutations import (
    MUTATIONS,
    Rig,
    _build_rig,
    _good_restores,
    _mutation_round,
    _report,
)

pytestmark = [
    pytest.mark.slow("the Vulkan backend on lavapipe"),
    pytest.mark.integration,
    pytest.mark.timeout(3600),
]

GOOD = 20
GPU_HOME = "gpu-home"  # under the test cache: the Vulkan (and CUDA) builds


class NoNvml:
    """NVML on a machine without an NVIDIA driver."""

    def nvmlInit(self) -> None:
        raise RuntimeError("NVML Shared Library Not Found")


def vulkan_binary() -> Path | None:
    """``WARMSLOT_VULKAN_SERVER``, else the newest Vulkan build in the test cache."""
    if os.environ.get("WARMSLOT_VULKAN_SERVER"):
        return Path(os.environ["WARMSLOT_VULKAN_SERVER"])
    builds = list_builds(Paths.under(cache_dir() / GPU_HOME))
    return next((r.binary for r in builds if r.backend == "vulkan"), None)


@pytest.fixture(scope="module")
def vulkan() -> Iterator[tuple[Path, list[GpuInfo]]]:
    """The Vulkan llama-server and its devices, or a skip that says what is missing."""
    with pytest.MonkeyPatch.context() as mp:
        # lavapipe is a CPU-type device: llama.cpp's Vulkan backend skips those unless named.
        mp.setenv("GGML_VK_VISIBLE_DEVICES", os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"))
        yield _vulkan_or_skip()


def _vulkan_or_skip() -> tuple[Path, list[GpuInfo]]:
    binary = vulkan_binary()
    if binary is None:
        pytest.skip(
            "no Vulkan build of llama-server: WARMSLOT_HOME="
            f"{cache_dir() / GPU_HOME} warmslot build --backend vulkan (docs/gpu.md), "
            "or set WARMSLOT_VULKAN_SERVER"
        )
    devices = read_llama_devices(binary)
    if not devices:
        pytest.skip(f"{binary} lists no Vulkan device (apt-get install mesa-vulkan-drivers)")
    return binary, devices


def test_device_discovery_is_what_fit_and_pressure_read(
    vulkan: tuple[Path, list[GpuInfo]], tmp_path: Path
) -> None:
    binary, devices = vulkan
    dev = devices[0]
    print(f"\n{dev.device}: {dev.name}, {dev.free_bytes >> 20} of {dev.total_bytes >> 20} MiB free")
    assert dev.source == "llama.cpp" and dev.device.startswith("Vulkan")
    assert 0 < dev.free_bytes <= dev.total_bytes
    # The fit reads them when NVML sees no GPU ...
    seen = gpus_for(binary, nvml=NoNvml())
    assert [g.device for g in seen] == [d.device for d in devices]
    # ... and so does the pressure monitor.
    sampler = Sampler(tmp_path, lambda: None, nvml=NoNvml(), devices=lambda: devices)
    assert [g.device for g in sampler.read().gpus] == [dev.device]


@pytest.fixture(scope="module")
def vulkan_rig(
    tmp_path_factory: pytest.TempPathFactory, vulkan: tuple[Path, list[GpuInfo]]
) -> Iterator[Rig]:
    binary, _ = vulkan
    model = make_tiny_model(cache_dir() / "tiny.gguf")
    foreign = make_tiny_model(cache_dir() / "tiny-seed7.gguf", seed=7)
    yield from _build_rig(
        tmp_path_factory.mktemp("vulkan"),
        model,
        foreign,
        400,
        server__cache_ram_mib=0,  # the RAM cache would hide the restored state
        server__binary=str(binary),
        # llama.cpp logs where each buffer went (load_tensors, llama_kv_cache) at level 4.
        server__extra_args=["-lv", "4"],
    )


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_layers_run_on_the_device_with_llamas_placement(vulkan_rig: Rig) -> None:
    sup = vulkan_rig.core.supervisor
    plan = vulkan_rig.core.fit_plan
    assert sup is not None and plan is not None
    argv = list(sup.argv)
    print(f"\nargv: {' '.join(argv[1:])}")
    assert plan.placement is not None and plan.placement.known, plan.placement
    assert plan.placement.source == "llama-fit-params"
    # The tiny model fits whole: llama.cpp says -1 ("auto": every layer and the output head).
    assert _flag(argv, "-ngl") == plan.placement.ngl == "all"
    assert _flag(argv, "--fit") == "off"
    # ... and llama-server put them there: every layer, the weights and the KV cache on Vulkan0
    # (without GGML_VK_VISIBLE_DEVICES it skips lavapipe and loads all of it on the CPU).
    log = vulkan_rig.core.paths.server_log
    text = wait_until(
        lambda: (t := log.read_text("utf-8", "replace")) and "KV buffer size" in t and t,
        60,
        message=f"llama-server's buffer lines in {log}",
    )
    offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", text)
    assert offloaded and offloaded[1] == offloaded[2], offloaded
    assert re.search(r"Vulkan0 model buffer size = +[\d.]+ MiB", text)
    assert re.search(r"Vulkan0 KV buffer size = +[\d.]+ MiB", text)
    print("\n".join(ln for ln in text.splitlines() if re.search(r"offloaded|Vulkan0 .*buffer", ln)))


def test_restore_mutations_are_rejected_on_vulkan(vulkan_rig: Rig) -> None:
    assert len(MUTATIONS) >= 20
    t0 = time.monotonic()
    outcome = _mutation_round(vulkan_rig, MUTATIONS, seed=27)
    print("\n" + _report("vulkan (lavapipe)", outcome) + f"\n  {time.monotonic() - t0:.0f} s")
    accepted = {k: n for k, n in outcome.items() if k.endswith((":accepted", ":crashed"))}
    assert sum(n for k, n in outcome.items() if k.endswith(":rejected")) == len(MUTATIONS)
    assert accepted == {}


def test_good_restores_verify_on_vulkan(vulkan_rig: Rig) -> None:
    t0 = time.monotonic()
    results, worst, ms = _good_restores(vulkan_rig, GOOD)
    print(
        f"\nvulkan (lavapipe): {results.count(None)}/{len(results)} correct restores verified; "
        f"largest log-prob deviation {worst:.3g}; probe {ms:.1f} ms; "
        f"{time.monotonic() - t0:.0f} s"
    )
    assert results == [None] * GOOD, results
    assert vulkan_rig.answer(0) == vulkan_rig.cold


def _write_config(home: Path, binary: Path) -> None:
    cfg = Paths.under(home).config_file
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[server]\nbinary = "{binary}"\n', "utf-8")


def _fit_json(home: Path, model: Path, target: int | None, capsys: Any) -> dict[str, Any]:
    argv = ["fit", "--dev-dir", str(home), "--model", str(model), "--json"]
    if target is not None:
        argv += ["--fit-target", str(target)]
    capsys.readouterr()
    cli_main(argv)  # 1 when Warmslot's own estimate says it does not fit: not the point here
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_moe_experts_move_to_the_cpu_and_the_launch_uses_it(
    vulkan: tuple[Path, list[GpuInfo]], tmp_path: Path, capsys: Any
) -> None:
    binary, devices = vulkan
    model = make_tiny_moe_model(cache_dir() / "tiny-moe.gguf")
    home = tmp_path / "home"
    _write_config(home, binary)
    roomy = _fit_json(home, model, None, capsys)["plan"]["placement"]
    assert roomy["source"] == "llama-fit-params", roomy
    assert roomy["cpu_expert_layers"] == []  # 1 GiB margin: the 51 MiB model fits whole
    # What the whole model needs on the device, in llama.cpp's own words; then a target
    # that leaves it 24 MiB short (an expert layer is 12 MiB).
    need = next(
        int(m.group(1))
        for ln in roomy["log_lines"]
        if (m := re.search(r"projected to use (\d+) MiB of device memory", ln))
    )
    target = (devices[0].free_bytes >> 20) - (need - 24)
    tight = _fit_json(home, model, target, capsys)["plan"]["placement"]
    print(f"\nneeds {need} MiB; --fit-target {target}: {tight['argv']}")
    print("\n".join(tight["log_lines"]))
    assert tight["source"] == "llama-fit-params", tight
    assert tight["cpu_expert_layers"], tight  # llama.cpp kept some layers' experts in RAM
    assert tight["n_gpu_layers"] >= 1

    core = Core(
        Paths.under(tmp_path / "run"),
        settings_for(
            model,
            server__binary=str(binary),
            server__extra_args=["--fit-target", str(target)],
        ),
    )
    core.start(wait_ready=True, timeout=300)
    try:
        sup = core.supervisor
        assert sup is not None
        argv = list(sup.argv)
        assert _flag(argv, "-ot") == ",".join(tight["overrides"])  # what `warmslot fit` showed
        assert _flag(argv, "-ngl") == tight["ngl"]
        assert _flag(argv, "--fit") == "off"

        body = json.dumps({"prompt": "the report says", "n_predict": 4, "temperature": 0})
        req = urllib.request.Request(
            f"{sup.base_url}/completion",
            data=body.encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {sup.api_key}"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
        assert got["tokens_predicted"] == 4
    finally:
        core.stop()
