"""`warmslot models` and `warmslot clients`: pick a model you already have, set up clients.

``warmslot models`` lists the GGUF models found in LM Studio's, llama.cpp's,
Hugging Face's and Ollama's folders, Warmslot's own and ``server.model_dirs``
(`core.models.catalog`), with size, architecture, trained context, whether the
model is sliding-window/hybrid and whether it fits with the configured slots and
context. ``warmslot models use N|PATH`` sets ``server.model``. ``warmslot clients``
prints setup snippets for opencode, aider, Claude Code and Codex CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from core import config as config_mod
from core import fmt
from core.clients import (
    base_url,
    client_model_name,
    client_setups,
    format_setups,
    options_section,
    proxy_address,
    readme_section,
    slot_context,
)
from core.config.keys import key_required
from core.errors import ConfigError, ModelNotFound
from core.models.catalog import Catalog, ModelEntry, for_settings, profile_note
from core.paths import Paths
from core.server.gguf_facts import read_facts

__all__ = ["cmd_clients", "cmd_models", "cmd_use", "format_table", "register"]


def _fits_cell(e: ModelEntry) -> str:
    if e.fits is None:
        return "—"
    return "yes" if e.fits else "NO"


def format_table(cat: Catalog) -> str:
    """The catalog as a numbered table, errors and fit reasons under their rows."""
    if not cat.entries:
        lines = ["No GGUF models found. Looked in:"]
        lines += [f"  {r.path}  ({r.source})" for r in cat.roots]
        return "\n".join(lines)
    head = (
        f"{'#':>3}  {'name':<46} {'source':<18} {'size':>9}  {'arch':<10} {'ctx':>7}  "
        f"{'SWA/hybrid':<15} fits"
    )
    lines = [head]
    for i, e in enumerate(cat.entries, 1):
        name = e.name if len(e.name) <= 44 else "…" + e.name[-43:]
        mark = "*" if e.current else " "
        swa = "" if e.kind in ("", "dense") else e.kind
        ctx = f"{e.n_ctx_train:,}" if e.n_ctx_train else ""
        size = fmt.size(e.size) if e.size > 0 else ""  # nothing for a file that is missing
        lines.append(
            f"{i:>3}  {mark}{name:<45} {e.source_label:<18} {size:>9}  "
            f"{e.architecture[:10]:<10} {ctx:>7}  {swa:<15} {_fits_cell(e)}"
        )
        if e.error:
            lines.append(f"       error: {e.error}")
        elif e.fits is False:
            lines.append(f"       {e.fit}")
    lines.append("")
    if any(e.current for e in cat.entries):
        lines.append("* = server.model (the model Warmslot serves).")
    else:
        lines.append("server.model is empty: Warmslot serves the demo model (Gemma 3 270M).")
    if any(e.needs_patched_server for e in cat.entries):
        lines.append(
            "Sliding-window/hybrid models: the disk tier needs the patched server "
            "(server.build = auto builds it)."
        )
    lines += [f"note: {n}" for n in cat.notes]
    lines.append("Use one: warmslot models use NUMBER|PATH · client setup: warmslot clients")
    return "\n".join(lines)


def _catalog(args: argparse.Namespace, paths: Paths, *, fit: bool) -> Catalog:
    settings = config_mod.load(paths.config_file)
    return for_settings(paths, settings, fit=fit, extra_dirs=getattr(args, "dir", None) or ())


def cmd_models(args: argparse.Namespace) -> int:
    """List the models found, with facts and fit."""
    paths = Paths.default(getattr(args, "dev_dir", None))
    cat = _catalog(args, paths, fit=not args.no_fit)
    if args.json:
        print(json.dumps(cat.to_dict(), indent=2))
    else:
        print(format_table(cat))
    return 0


def _running_note(paths: Paths, chosen: Path) -> str:
    """Whether a running Warmslot must restart to serve `chosen`."""
    from core.cli.main import fetch_status

    st = fetch_status(paths)
    if st is None:
        return "No Warmslot is running: the next start serves it."
    served = m["path"] if (m := st["server"]["model"]) is not None else ""
    pid = st["warmslot"]["pid"]
    if served and os.path.realpath(served) == os.path.realpath(chosen):
        return f"The running Warmslot (pid {pid}) already serves it."
    return (
        f"A running Warmslot (pid {pid}) serves {Path(served).name if served else 'no model'}; "
        "it reads its settings when it starts, so restart it to switch: stop `warmslot "
        "serve` (Ctrl-C) and start it again, or Quit the tray and reopen it (the tray's "
        "own model chooser switches without that)."
    )


def cmd_use(args: argparse.Namespace) -> int:
    """Set server.model to a listed model (by number) or a GGUF file."""
    paths = Paths.default(getattr(args, "dev_dir", None))
    target: str = args.model
    if target.isdigit():
        cat = _catalog(args, paths, fit=False)
        n = int(target)
        if not 1 <= n <= len(cat.entries):
            raise ConfigError(
                f"there is no model number {n}",
                expected=f"1..{len(cat.entries)} (see `warmslot models`) or a path",
                got=target,
            )
        entry = cat.entries[n - 1]
        if entry.error:
            raise ModelNotFound(f"{entry.name}: {entry.error}")
        chosen = Path(entry.path)
    else:
        chosen = Path(target).expanduser().absolute()
    facts = read_facts(chosen)  # refuses a missing, damaged or non-GGUF file
    config_mod.set_value(paths.config_file, "server.model", str(chosen))
    kind = ""
    if facts.is_swa or facts.is_recurrent:
        kind = " — sliding-window/hybrid: the disk tier needs the patched server"
    print(f"server.model = {chosen}\n  {facts.architecture}, trained context "
          f"{facts.n_ctx_train:,}{kind}")  # fmt: skip
    print(_running_note(paths, chosen))
    if note := profile_note(config_mod.load(paths.config_file)):
        print(f"note: {note}")
    return 0


def cmd_clients(args: argparse.Namespace) -> int:
    """Print setup snippets for opencode, aider, Claude Code and Codex CLI."""
    if getattr(args, "markdown", False):  # the documents' sections (core.clients)
        print("README.md, between the client-setup markers:\n")
        print(readme_section())
        print("\ndocs/clients.md, between the client-options markers:\n")
        print(options_section())
        return 0
    paths = Paths.default(getattr(args, "dev_dir", None))
    settings = config_mod.load(paths.config_file)
    from core.cli.main import fetch_status

    st = fetch_status(paths)
    url = proxy_address(st["warmslot"]["proxy"] if st is not None else "", settings)
    model = args.model or client_model_name(settings)
    # Named keys (core.keys) or proxy.api_key: the snippets then read the key.
    key = key_required(paths.config_file, settings.proxy.api_key)
    # Each agent waits as long as Warmslot waits for llama-server (docs/clients.md#timeouts).
    # Each agent compacts before its slot is full (docs/clients.md#context-size).
    context = slot_context(st, settings)
    setups = client_setups(
        url, model, api_key=key, timeout_s=settings.proxy.upstream_timeout_s, context=context
    )
    if args.json:
        doc: dict[str, object] = {
            "base_url": base_url(url),
            "model": model,
            "context": context,
            "clients": [dataclasses.asdict(s) for s in setups],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(format_setups(setups, url, api_key=key))
    return 0


def register(subparsers: Any) -> None:
    """Add ``models`` (with ``use``) and ``clients`` to the main CLI."""
    p = subparsers.add_parser(
        "models",
        help="models you already have (LM Studio, llama.cpp, Hugging Face, Ollama) and their fit",
        description="List GGUF models found on this machine with size, architecture, "
        "trained context, sliding-window/hybrid and whether they fit; `use` picks one.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-fit", action="store_true", help="skip the fit plan (and GPU/RAM probing)")
    p.add_argument("--dir", action="append", metavar="DIR", help="also look in DIR (repeatable)")
    p.set_defaults(func=cmd_models)
    sub = p.add_subparsers(dest="models_command", metavar="{use}")
    u = sub.add_parser("use", help="set server.model to a listed model or a GGUF file")
    u.add_argument("model", help="a number from `warmslot models`, or a path to a .gguf")
    u.add_argument("--dir", action="append", metavar="DIR", help="as for `warmslot models`")
    u.set_defaults(func=cmd_use)

    c = subparsers.add_parser(
        "clients", help="setup snippets for opencode, aider, Claude Code and Codex CLI"
    )
    c.add_argument("--model", help="model name to put in the snippets")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.add_argument(
        "--markdown",
        action="store_true",
        help="print the README's and docs/clients.md's setup sections (with the defaults)",
    )
    c.set_defaults(func=cmd_clients)
