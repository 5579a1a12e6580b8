"""Where the weights go: llama.cpp's own placement (``--fit``), asked before the launch.

Warmslot chooses what llama.cpp does not (slots, context per slot, KV cache type, the
RAM prompt cache, the side slot — `core.server.fit`). Which layers and which tensors sit
on which device is llama.cpp's: its ``--fit`` measures every buffer with the allocator
the engine uses and moves MoE expert tensors to the CPU (``-ot …exps=CPU``) before it
gives up whole layers, which Warmslot's estimate does not do (docs/gpu.md#placement).

`ask` runs ``llama-fit-params`` (built next to llama-server by ``warmslot build``) with
the model flags Warmslot chose and reads its answer — ``-c N -ngl N [-ts …] [-ot "…"]``
on stdout — into a `Placement`. The launch passes that answer as explicit flags with
``--fit off``, so what `warmslot fit` and the Server tab show is what runs, and the
argv stored with the run says it. A binary without the tool (an older build, the
prebuilt package) gets ``--fit on --fit-target M`` instead: the same algorithm at load
time, not shown beforehand (`at_launch`).

Explicit ``-ngl`` turns ``--fit``'s layer step off ("n_gpu_layers already set by user
… abort", measured on the pinned server), and explicit ``-c`` keeps the context as
given ("context size set by user … no change"); Warmslot passes ``-c`` (its slot files
and prefix fingerprints depend on it) and no ``-ngl``/``-ts`` unless the user pinned
them or RPC workers are placed (`core.server.rpc_fit`, where llama.cpp has no answer).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "FIT_PARAMS_EXE",
    "Placement",
    "ask",
    "at_launch",
    "fit_params_tool",
    "model_flags",
    "parse_answer",
]

log = logging.getLogger("warmslot.fit")

FIT_PARAMS_EXE = "llama-fit-params.exe" if os.name == "nt" else "llama-fit-params"
FIT_TIMEOUT_S = 120.0
DEFAULT_TARGET_MIB = 1024  # llama.cpp's own --fit-target default
# Flags of Warmslot's plan that change what the model needs in memory; the rest
# (--cache-ram, --ctx-checkpoints …) are server-only and llama-fit-params rejects them.
_MODEL_FLAGS_WITH_VALUE = {"-c", "-np", "-ctk", "-ctv", "-ub", "-fa", "-b"}
_MODEL_SWITCHES = {"--swa-full", "-kvu"}
_EXPERT_LAYER = re.compile(r"blk\\\.(\d+)\\\.ffn_\(.*exps")
_FIT_LOG = re.compile(r"(common_params_fit_impl|common_fit_params|llama_params_fit\w*): (.*)")


@dataclass(frozen=True)
class Placement:
    """llama.cpp's answer for one model and context: layers, split and tensor overrides.

    ``source`` says where it came from: ``llama-fit-params`` (asked before the launch,
    the values are known), ``--fit at launch`` (the server decides as it loads; values
    unknown here) or ``failed`` (llama.cpp could not fit; ``error`` says why).
    """

    source: str
    n_gpu_layers: int | None = None
    ctx: int | None = None
    tensor_split: tuple[int, ...] = ()
    overrides: tuple[str, ...] = ()  # "pattern=BUFFER_TYPE", as llama-server's -ot takes them
    target_mib: int = DEFAULT_TARGET_MIB
    log_lines: tuple[str, ...] = ()  # llama.cpp's own words on the fit
    error: str = ""

    @property
    def known(self) -> bool:
        """The values were asked for before the launch (llama-fit-params answered)."""
        return self.source == "llama-fit-params"

    @property
    def ngl(self) -> str:
        """``-ngl`` as llama-server takes it: llama-fit-params prints -1 ("auto", which
        loads every layer and the output head) when everything fits; that is ``all``."""
        n = self.n_gpu_layers
        return "all" if n is not None and n < 0 else str(n)

    @property
    def cpu_expert_layers(self) -> tuple[int, ...]:
        """Layers whose MoE expert tensors llama.cpp keeps in host memory."""
        found: set[int] = set()
        for o in self.overrides:
            pattern, _, buft = o.rpartition("=")
            m = _EXPERT_LAYER.search(pattern)
            if m and buft.upper().startswith("CPU"):
                found.add(int(m.group(1)))
        return tuple(sorted(found))

    def argv(self) -> list[str]:
        """The llama-server flags that launch with this placement."""
        if not self.known:
            return ["--fit", "on", "--fit-target", str(self.target_mib)]
        argv = ["-ngl", self.ngl]
        if self.tensor_split:
            argv += ["-ts", ",".join(map(str, self.tensor_split))]
        if self.overrides:
            argv += ["-ot", ",".join(self.overrides)]
        return [*argv, "--fit", "off"]

    def describe(self) -> str:
        """One line for people: what llama.cpp chose, or why nothing is known yet."""
        if self.source == "failed":
            return f"llama.cpp could not fit the model ({self.error}); the launch lets --fit try"
        if not self.known:
            return (
                f"llama-server's --fit places layers at load (target {self.target_mib} MiB "
                "free per device); this build has no llama-fit-params to ask beforehand"
            )
        text = f"-ngl {self.ngl}"
        if self.tensor_split:
            text += f", -ts {','.join(map(str, self.tensor_split))}"
        experts = self.cpu_expert_layers
        if experts:
            text += f", MoE experts of {len(experts)} layer(s) in host RAM ({_ranges(experts)})"
        elif self.overrides:
            text += f", {len(self.overrides)} tensor override(s)"
        return text + f" (llama-fit-params, {self.target_mib} MiB left free per device)"

    def to_dict(self) -> dict[str, object]:
        """JSON-able form, with the derived expert layers and the flags."""
        out = asdict(self)
        out["cpu_expert_layers"] = list(self.cpu_expert_layers)
        out["ngl"] = self.ngl
        out["argv"] = self.argv()
        return out


def _ranges(layers: Sequence[int]) -> str:
    parts: list[str] = []
    start = prev = layers[0]
    for n in [*layers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(parts)


def fit_params_tool(binary: Path) -> Path | None:
    """The ``llama-fit-params`` built next to `binary`, if there is one."""
    tool = binary.parent / FIT_PARAMS_EXE
    return tool if tool.is_file() and os.access(tool, os.X_OK) else None


def model_flags(plan_args: Sequence[str]) -> list[str]:
    """The flags of a launch that change the model's memory (for llama-fit-params)."""
    out: list[str] = []
    i = 0
    while i < len(plan_args):
        tok = plan_args[i]
        if tok in _MODEL_FLAGS_WITH_VALUE and i + 1 < len(plan_args):
            out += [tok, plan_args[i + 1]]
            i += 2
            continue
        if tok in _MODEL_SWITCHES:
            out.append(tok)
        i += 1
    return out


def parse_answer(stdout: str) -> tuple[int | None, int | None, tuple[int, ...], tuple[str, ...]]:
    """(ctx, n_gpu_layers, tensor split, overrides) from llama-fit-params' stdout line."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("-c ")), "")
    if not line:
        raise ValueError("llama-fit-params printed no flags")
    toks = shlex.split(line)
    ctx = ngl = None
    split: tuple[int, ...] = ()
    overrides: tuple[str, ...] = ()
    for flag, value in zip(toks[::2], toks[1::2], strict=False):
        if flag == "-c":
            ctx = int(value)
        elif flag == "-ngl":
            ngl = int(value)
        elif flag == "-ts":
            split = tuple(int(float(v)) for v in value.split(","))
        elif flag == "-ot":
            overrides = tuple(v for v in value.split(",") if v)
    return ctx, ngl, split, overrides


def at_launch(target_mib: int) -> Placement:
    """No answer beforehand: llama-server's ``--fit`` places the layers as it loads."""
    return Placement(source="--fit at launch", target_mib=target_mib)


def ask(
    binary: Path,
    model: Path,
    plan_args: Sequence[str],
    *,
    target_mib: int = DEFAULT_TARGET_MIB,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = FIT_TIMEOUT_S,
) -> Placement:
    """Ask llama.cpp where the weights of `model` go with the launch's `plan_args`
    (blocking; loads no weights). Without the tool next to `binary`: `at_launch`.
    `extra` are placement flags the user gave (``--device``, ``-cmoe`` …)."""
    tool = fit_params_tool(binary)
    if tool is None:
        return at_launch(target_mib)
    cmd = [str(tool), "-m", str(model), *model_flags(plan_args), *extra]
    # -lv 4: llama.cpp's fit reasoning is logged at trace level.
    cmd += ["--fit-target", str(target_mib), "-lv", "4"]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("llama-fit-params failed (%s): --fit places the layers at launch", e)
        return Placement(source="failed", target_mib=target_mib, error=str(e))
    lines = tuple(m.group(0) for m in map(_FIT_LOG.search, proc.stderr.splitlines()) if m)
    if proc.returncode != 0:
        why = next((ln for ln in reversed(lines) if "fail" in ln), "")
        why = why or (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return Placement(source="failed", target_mib=target_mib, log_lines=lines, error=why)
    try:
        ctx, ngl, split, overrides = parse_answer(proc.stdout)
    except ValueError as e:
        return Placement(source="failed", target_mib=target_mib, log_lines=lines, error=str(e))
    return Placement(
        source="llama-fit-params",
        n_gpu_layers=ngl,
        ctx=ctx,
        tensor_split=split,
        overrides=overrides,
        target_mib=target_mib,
        log_lines=lines,
    )
