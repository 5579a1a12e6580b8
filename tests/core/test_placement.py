"""llama.cpp places layers and tensors: llama-fit-params' answer read, passed to the
launch as explicit flags, and Warmslot's own -ngl/-ts kept out of the argv.

The tool itself needs a GPU device to say anything but "no changes"; these tests run a
stand-in that prints the pinned tool's exact output format (tools/fit-params in the
pinned llama.cpp). The real tool on a real (lavapipe Vulkan) device is
tests/integration/test_vulkan.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from core.config import ServerSettings
from core.machine.devices import GpuInfo, HostInfo, gpus_for, parse_device_list
from core.server import discover, placement
from core.server.fit import plan, plan_argv
from core.server.gguf_facts import read_facts
from core.server.launch import place, request_from_settings
from core.server.tinymodel import make_tiny_moe_model

MIB = 1 << 20
GIB = 1 << 30
# llama-fit-params' stdout for a MoE model (format of tools/fit-params/fit-params.cpp).
ANSWER = (
    '-c 4096 -ngl 5 -ot "blk\\.0\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU,'
    "blk\\.1\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU,"
    'blk\\.2\\.ffn_(gate|up|gate_up|down).*=Vulkan0"\n'
)
FIT_LOG = (
    "0.00.001 I common_params_fit_impl: projected to use 60 MiB of device memory vs. "
    "20000 MiB of free device memory\n"
    "0.00.002 I common_fit_params: successfully fit params to free device memory\n"
)


def fake_tool(bin_dir: Path, stdout: str, stderr: str = FIT_LOG, rc: int = 0) -> Path:
    """A llama-fit-params stand-in next to a llama-server path; records its argv."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / placement.FIT_PARAMS_EXE
    (bin_dir / "answer.txt").write_text(stdout)
    (bin_dir / "log.txt").write_text(stderr)
    tool.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{bin_dir}/argv.txt"\n'
        f'cat "{bin_dir}/answer.txt"; cat "{bin_dir}/log.txt" >&2; exit {rc}\n'
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return bin_dir / "llama-server"


def binary_at(path: Path) -> discover.ServerBinary:
    return discover.ServerBinary(path=path, source="path", version="test", commit="", identity="x")


def host() -> HostInfo:
    return HostInfo(16 * GIB, 12 * GIB, 0, 0, 100 * GIB)


def gpu() -> GpuInfo:
    return GpuInfo(0, "llvmpipe", 20 * GIB, 20 * GIB, source="llama.cpp", device="Vulkan0")


def test_parse_answer_and_expert_layers() -> None:
    ctx, ngl, split, overrides = placement.parse_answer("loading...\n" + ANSWER)
    assert (ctx, ngl, split) == (4096, 5, ())
    assert len(overrides) == 3 and overrides[0].endswith("exps=CPU")
    p = placement.Placement("llama-fit-params", n_gpu_layers=ngl, overrides=overrides)
    assert p.cpu_expert_layers == (0, 1)  # layer 2's partial override is on the device
    assert p.argv() == ["-ngl", "5", "-ot", ",".join(overrides), "--fit", "off"]
    assert "MoE experts of 2 layer(s) in host RAM (0-1)" in p.describe()
    with pytest.raises(ValueError):
        placement.parse_answer("llama_params_fit: failed\n")
    assert placement.parse_answer("-c 8192 -ngl 40 -ts 30,10\n")[2] == (30, 10)
    # Everything fits: the tool prints -1 ("auto" = every layer and the output head).
    _, ngl, _, _ = placement.parse_answer("-c 8192 -ngl -1\n")
    whole = placement.Placement("llama-fit-params", n_gpu_layers=ngl)
    assert whole.argv() == ["-ngl", "all", "--fit", "off"] and "-ngl all" in whole.describe()


def test_model_flags_keep_what_changes_memory_and_drop_server_flags() -> None:
    args = ["-np", "4", "-c", "32768", "-ctk", "q8_0", "-ctv", "q8_0", "--cache-ram", "0",
            "--ctx-checkpoints", "4", "--swa-full", "-fa", "off"]  # fmt: skip
    assert placement.model_flags(args) == [
        "-np", "4", "-c", "32768", "-ctk", "q8_0", "-ctv", "q8_0", "--swa-full", "-fa", "off",
    ]  # fmt: skip


def test_device_list_parse() -> None:
    text = (
        "ggml_vulkan: Found 1 Vulkan devices:\n"
        "Available devices:\n"
        "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (23105 MiB, 20000 MiB free)\n"
    )
    (d,) = parse_device_list(text)
    assert (d.device, d.name, d.total_bytes, d.free_bytes) == (
        "Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 23105 * MIB, 20000 * MIB,
    )  # fmt: skip
    assert parse_device_list("Available devices:\n  (none)\n") == []


def test_gpus_for_asks_the_binary_only_when_nvml_sees_none(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(
        "#!/bin/sh\necho 'Available devices:'\n"
        "echo '  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (1000 MiB, 900 MiB free)'\n"
    )
    binary.chmod(0o755)

    class NoNvml:
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    (found,) = gpus_for(binary, dict(os.environ), nvml=NoNvml())
    assert found.source == "llama.cpp" and found.free_bytes == 900 * MIB
    assert gpus_for(None, nvml=NoNvml()) == []


def test_launch_flags_come_from_llama_not_from_the_estimate(tmp_path: Path) -> None:
    model = make_tiny_moe_model(tmp_path / "moe.gguf")
    facts = read_facts(model)
    request = request_from_settings(ServerSettings(), extra_args=["--fit-target", "300"])
    estimate = plan(facts, [gpu()], host(), request)
    assert "-ngl" in plan_argv(estimate)  # Warmslot's estimate alone: explicit -ngl
    binary = fake_tool(tmp_path / "bin", ANSWER)

    placed = place(estimate, binary_at(binary), model, request)

    argv = plan_argv(placed)
    assert placed.placement is not None and placed.placement.known
    assert argv[argv.index("-ngl") + 1] == "5" and argv.count("-ngl") == 1
    assert "exps=CPU" in argv[argv.index("-ot") + 1]
    assert argv[-2:] == ["--fit", "off"]
    asked = (tmp_path / "bin" / "argv.txt").read_text().split("\n")
    # The tool was asked about Warmslot's own context, slots and KV type and target.
    for flag, value in (("-c", str(estimate.ctx_per_slot * estimate.slots)),
                        ("-np", str(estimate.slots)), ("-ctk", estimate.cache_type_k),
                        ("--fit-target", "300")):  # fmt: skip
        assert asked[asked.index(flag) + 1] == value
    assert "--cache-ram" not in asked  # a server-only flag the tool would reject
    doc = placed.to_dict()["placement"]
    assert isinstance(doc, dict) and doc["cpu_expert_layers"] == [0, 1]


def test_without_the_tool_the_server_fits_at_launch(tmp_path: Path) -> None:
    model = make_tiny_moe_model(tmp_path / "moe.gguf")
    request = request_from_settings(ServerSettings())
    estimate = plan(read_facts(model), [gpu()], host(), request)
    placed = place(estimate, binary_at(tmp_path / "llama-server"), model, request)
    argv = plan_argv(placed)
    assert "-ngl" not in argv and "-ts" not in argv
    assert argv[-4:] == ["--fit", "on", "--fit-target", "1024"]


def test_a_failed_fit_falls_back_to_the_server_and_says_why(tmp_path: Path) -> None:
    model = make_tiny_moe_model(tmp_path / "moe.gguf")
    request = request_from_settings(ServerSettings())
    estimate = plan(read_facts(model), [gpu()], host(), request)
    log = "0.1 W common_fit_params: failed to fit params to free device memory: no room\n"
    binary = fake_tool(tmp_path / "bin", "", stderr=log, rc=1)
    placed = place(estimate, binary_at(binary), model, request)
    assert placed.placement is not None and not placed.placement.known
    assert "failed to fit" in placed.placement.error
    assert "--fit" in plan_argv(placed) and "-ngl" not in plan_argv(placed)


def test_a_pinned_layer_count_is_kept(tmp_path: Path) -> None:
    model = make_tiny_moe_model(tmp_path / "moe.gguf")
    request = request_from_settings(ServerSettings(), extra_args=["-ngl", "2"])
    estimate = plan(read_facts(model), [gpu()], host(), request)
    binary = fake_tool(tmp_path / "bin", ANSWER)
    placed = place(estimate, binary_at(binary), model, request)
    assert placed.placement is None and not (tmp_path / "bin" / "argv.txt").exists()
    argv = plan_argv(placed)
    assert argv[argv.index("-ngl") + 1] == "2"


def test_a_binary_without_devices_is_asked_once(tmp_path: Path) -> None:
    """The pressure monitor asks every minute; a CPU build is not started each time."""
    from core.machine.devices import read_llama_devices

    calls = tmp_path / "calls"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'Available devices:'\necho '  (none)'\n")
    binary.chmod(0o755)
    assert read_llama_devices(binary) == [] and read_llama_devices(binary) == []
    assert calls.read_text().count("x") == 1
