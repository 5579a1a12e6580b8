"""The llama-server command line: a pure function of its inputs.

The result is logged exactly and stored with each server run, so what ran can
always be reproduced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.config import ServerSettings
from core.server.model import short_name


@dataclass(frozen=True)
class LaunchInputs:
    """Everything the argv depends on besides the settings."""

    binary: Path
    model: Path
    port: int
    slot_dir: Path
    no_repack: bool = False
    plan_args: Sequence[str] = ()  # flags chosen by the fit planner (override defaults)
    api_key_file: Path | None = None  # this launch's key (core.server.supervisor)


def build_argv(server: ServerSettings, inputs: LaunchInputs) -> list[str]:
    """The argv to launch llama-server with.

    Slots are always explicit (``-np``): the server's auto mode unifies the KV
    cache and clears idle slots whenever a task starts
    (docs/llama-server-facts.md#slot-auto-mode), which
    would defeat slot pinning. ``-c`` is the total context, so it is the
    per-slot context times the slots.
    """
    argv = [
        str(inputs.binary),
        "-m",
        str(inputs.model),
        "--host",
        server.host,
        "--port",
        str(inputs.port),
        "-np",
        str(server.launch_slots),
        "-c",
        str(server.launch_ctx_per_slot * server.launch_slots),
        "--cache-ram",
        str(server.launch_cache_ram_mib),
        "--slot-save-path",
        str(inputs.slot_dir),
        "--metrics",
        "--no-webui",
    ]
    if server.threads > 0:
        argv += ["-t", str(server.threads)]
    if inputs.api_key_file is not None:
        argv += ["--api-key-file", str(inputs.api_key_file)]
    if inputs.no_repack:
        argv.append("--no-repack")
    if server.chat_template_file:
        argv += ["--jinja", "--chat-template-file", server.chat_template_file]
    if not {"-a", "--alias"} & set(server.extra_args):
        # What agents show as the model, instead of the file's whole path.
        argv += ["--alias", short_name(inputs.model)]
    argv += _without_overridden(list(inputs.plan_args), argv)
    argv += list(server.extra_args)
    return argv


def _is_flag(token: str) -> bool:
    """``-ngl`` is a flag; ``-1`` (a negative number, e.g. ``--cache-ram -1``) is a value."""
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def _without_overridden(extra: list[str], base: list[str]) -> list[str]:
    """Plan flags replace earlier flags of the same name instead of repeating them."""
    for i, token in enumerate(extra):
        if _is_flag(token) and token in base:
            j = base.index(token)
            if j + 1 < len(base) and i + 1 < len(extra) and not _is_flag(extra[i + 1]):
                base[j + 1] = extra[i + 1]
                extra[i] = extra[i + 1] = ""
    return [t for t in extra if t]


def kv_relevant(argv: Sequence[str]) -> tuple[str, ...]:
    """The flags of an argv that change whether a saved KV state is valid (for fingerprints)."""
    keep = {
        "-np",
        "--parallel",
        "-c",
        "--ctx-size",
        "-ctk",
        "--cache-type-k",
        "-ctv",
        "--cache-type-v",
        "-fa",
        "--flash-attn",
        "-ub",
        "--ubatch-size",
        "--swa-full",
        "-kvu",
        "--kv-unified",
        "-no-kvu",
        "--no-kv-unified",
        "--ctx-checkpoints",
        "-ctxcp",
        "--swa-checkpoints",
        "-cms",
        "--checkpoint-min-step",
        "--chat-template",
        "--chat-template-file",
        "--jinja",
        "--no-jinja",
        "--rope-scaling",
        "--rope-freq-base",
        "--rope-freq-scale",
        "--kv-unified-per-slot",
    }
    flags_without_value = {
        "--swa-full",
        "-kvu",
        "--kv-unified",
        "-no-kvu",
        "--no-kv-unified",
        "--jinja",
        "--no-jinja",
    }
    if "--rpc" in argv:
        # Layers on RPC workers compute differently: a slot file saved with a split is
        # not the one-host state (measured on Gemma 3 270M, docs/scale.md#slot-files),
        # so the workers and the split join the identity; without --rpc nothing changes.
        keep |= {"--rpc", "-ngl", "--gpu-layers", "--n-gpu-layers", "-ts", "--tensor-split"}
    out: list[str] = []
    it = iter(range(len(argv)))
    for i in it:
        tok = argv[i]
        if tok in keep:
            out.append(tok)
            if tok not in flags_without_value and i + 1 < len(argv):
                out.append(argv[i + 1])
                next(it, None)
    return tuple(out)
