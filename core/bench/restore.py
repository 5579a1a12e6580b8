"""`warmslot bench restore`: what a verified restore costs against a cold prefill.

One run per model starts a Core (its own temporary folders, one slot, the cache
manager off so nothing else touches the slot) on a llama-server that Warmslot
launches, and talks to that server directly with the launch's key. For each
context size (8k, 32k and 64k tokens by default; a size that does not fit the
slot's context, which the model's trained context bounds, is skipped and says why):

1. **cold** — an erased slot evaluates the whole prompt and predicts one token;
2. **save** — the slot is written to a file (server time, wall time, bytes);
3. the probe reference is taken as Warmslot takes it: restore the file, run the
   known-answer probe (`core.cache.probe`) and record its answer;
4. **restore**, twice — once with the file dropped from the page cache
   (``posix_fadvise(DONTNEED)`` after an ``fsync``; the share of the file still
   cached is measured with ``mincore`` and reported) and once with it cached:
   the file check Warmslot runs before a restore (`StateStore.check_file`), the
   server's restore, the probe and its check (``check_answer``: the state must
   reproduce the reference), and the first token of a new turn after the prefix.

The ratio is cold ÷ (check + restore + verify + first token), computed from those
measured parts. The disk's read bandwidth is measured in the same run on a
scratch file beside the slot files (at least 256 MiB, cold and cached), and each
restore is compared with the time the file alone takes to read at that bandwidth.
The goals (docs/benchmarks.md#restore): cold ÷ restored ≥ 150× at 32k tokens, and
restore ≤ 3 × file size ÷ bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core.bench.disk import cached_fraction, drop_cache, file_read, measure_bandwidth
from core.bench.overhead import Machine
from core.bench.restore_report import (
    Bandwidth,
    Goal,
    ModelReport,
    RestoreReport,
    RestoreTrial,
    SizeResult,
    Skipped,
    format_report,
)
from core.bench.slot_client import Server, prompt_tokens
from core.cache.probe import (
    PROBE_SUFFIX,
    check_answer,
    probe_reference,
    probe_request,
    probe_request_for,
)
from core.cache.store import StateRecord, StateStore, file_sha256
from core.config import Settings
from core.paths import Paths
from core.server.client import CompletionAnswer

DEFAULT_SIZES = (8192, 32768, 65536)
RESERVE = 128  # cells the probe suffix, its answer and the next turn need after the prompt
GOAL_RATIO = 150.0
GOAL_RATIO_AT = 32768
GOAL_BANDWIDTH_FACTOR = 3.0
BANDWIDTH_FILE_MIB = 256
TURN = "\n\nUser: Summarise what the code above does, in one sentence.\nAssistant:"
# A shorter probe: timed beside the current one on the same restored state. It missed an
# 8-byte flip on Gemma 3 (docs/cache.md#verification), so it only is measured.
SHORT_PROBE_SUFFIX = "\n"
SHORT_PROBE_TOKENS = 2
Log = Callable[[str], None]


def _ms(timings: Mapping[str, object] | None, key: str) -> float | None:
    value = (timings or {}).get(key)
    return round(float(value), 2) if isinstance(value, int | float) else None


def run_size(
    server: Server,
    store: StateStore,
    identity: str,
    n: int,
    *,
    seed: int,
    suffix: list[int],
    turn: list[int],
    short_suffix: list[int] | None = None,
    log: Log | None = None,
) -> SizeResult:
    """Cold prefill, save, reference probe and the two restores for one prompt size."""
    tokens = prompt_tokens(server, n, seed)
    server.slot("erase")
    cold, cold_wall = server.complete(tokens, 1)
    ct = cold.get("timings") or {}
    if log:
        log(f"  {n} tokens: cold {cold_wall / 1000:.2f} s (cache_n {ct.get('cache_n')})")
    name = f"ws-{uuid.uuid4().hex}.bin"
    saved, save_wall = server.slot("save", name)
    path = server.slot_dir / name
    t0 = time.perf_counter()
    digest = file_sha256(path)
    hash_ms = (time.perf_counter() - t0) * 1000
    # The reference as Warmslot records it: from the file as a restore lays it out.
    server.slot("erase")
    server.slot("restore", name)
    ref_resp, ref_ms = _probe(server, tokens, suffix)
    now = time.time()
    rec = StateRecord(
        filename=name,
        identity=identity,
        fingerprint=uuid.uuid4().hex,
        client="bench",
        source="bench",
        prefix_n=n,
        n_tokens=int(saved.get("n_saved", n)),
        bytes=path.stat().st_size,
        sha256=digest,
        ttl_class="short",
        pinned=False,
        created=now,
        last_used=now,
        verified_at=now,
        verify_result="reference",
        probe={"prefix": tokens, "suffix": suffix, **probe_reference(ref_resp)},
    )
    store.add(rec)
    read_cold = file_read(path, cold=True)
    read_warm = file_read(path, cold=False)
    trials = {
        cache: restore_once(
            server,
            store,
            rec,
            tokens,
            turn,
            cold_cache=cache == "cold",
            short_suffix=short_suffix,
        )
        for cache in ("cold", "warm")
    }
    result: SizeResult = {
        "tokens": n,
        "cold": {
            "wall_ms": round(cold_wall, 1),
            "prompt_ms": _ms(ct, "prompt_ms"),
            "prompt_n": ct.get("prompt_n"),
            "cache_n": ct.get("cache_n"),
        },
        "save": {
            "wall_ms": round(save_wall, 1),
            "server_ms": _ms(saved.get("timings"), "save_ms"),
            "bytes": rec.bytes,
            "n_saved": saved.get("n_saved"),
            "sha256_ms": round(hash_ms, 1),
        },
        "reference_probe_ms": round(ref_ms, 1),
        "file_read": {**read_cold, "warm_ms": read_warm["ms"]},
        "restore": trials,
    }
    (server.slot_dir / name).unlink(missing_ok=True)
    return result


def _probe(server: Server, prefix: list[int], suffix: list[int]) -> tuple[CompletionAnswer, float]:
    return server.completion(probe_request(prefix, suffix, 0))


def restore_once(
    server: Server,
    store: StateStore,
    rec: StateRecord,
    tokens: list[int],
    turn: list[int],
    *,
    cold_cache: bool,
    short_suffix: list[int] | None = None,
) -> RestoreTrial:
    """One restore as Warmslot runs it, timed in parts, then the next turn's first token;
    with `short_suffix`, a shorter probe timed on the same state after it."""
    server.slot("erase")
    path = store.path(rec)
    if cold_cache:
        drop_cache(path)
    cached = cached_fraction(path)
    t0 = time.perf_counter()
    problem = store.check_file(rec)
    check_ms = (time.perf_counter() - t0) * 1000
    if problem is not None:
        raise RuntimeError(f"the saved file failed its check: {problem}")
    resp, restore_wall = server.slot("restore", rec.filename)
    if int(resp.get("n_restored", -1)) != rec.n_tokens:
        raise RuntimeError(f"restored {resp.get('n_restored')} tokens, expected {rec.n_tokens}")
    t1 = time.perf_counter()
    answer, _ = server.completion(probe_request_for(rec.probe, 0))
    pt = answer.get("timings") or {}
    verdict = check_answer(answer, pt.get("cache_n"), rec.prefix_n, rec.probe, tolerance=0.0)
    verify_ms = (time.perf_counter() - t1) * 1000
    first, first_wall = server.complete([*tokens, *turn], 1)
    ft = first.get("timings") or {}
    total = check_ms + restore_wall + verify_ms + first_wall
    # The shorter probe on the same restored state, for comparison (timed only).
    short_ms: float | None = None
    if short_suffix:
        server.slot("erase")
        server.slot("restore", rec.filename)
        t2 = time.perf_counter()
        server.completion(probe_request(tokens, short_suffix, 0, SHORT_PROBE_TOKENS))
        short_ms = (time.perf_counter() - t2) * 1000
    return {
        "cached_fraction_before": cached,
        "check_ms": round(check_ms, 2),
        "restore_wall_ms": round(restore_wall, 2),
        "restore_server_ms": _ms(resp.get("timings"), "restore_ms"),
        "verify_ms": round(verify_ms, 2),
        "verify_prompt_ms": _ms(pt, "prompt_ms"),
        "verify_predicted_ms": _ms(pt, "predicted_ms"),
        "verify_result": verdict or "ok",
        "probe_tokens": len(rec.probe["suffix"]) + len(rec.probe["tokens"]),
        "verify_short_ms": None if short_ms is None else round(short_ms, 2),
        "short_probe_tokens": len(short_suffix) + SHORT_PROBE_TOKENS if short_suffix else None,
        "first_token_ms": round(first_wall, 2),
        "first_token_prompt_n": ft.get("prompt_n"),
        "first_token_cache_n": ft.get("cache_n"),
        "total_ms": round(total, 2),
    }


# ----------------------------------------------------------------------------- a run


def derive(result: SizeResult, bandwidth: Bandwidth) -> None:
    """Add the ratios, computed from the measured parts only."""
    cold = result["cold"]["wall_ms"]
    size = result["save"]["bytes"]
    for cache, trial in result["restore"].items():
        parts = (
            trial["check_ms"]
            + trial["restore_wall_ms"]
            + trial["verify_ms"]
            + trial["first_token_ms"]
        )
        trial["ratio"] = round(cold / parts, 1) if parts > 0 else None
        mb_s = bandwidth["cold_mb_s" if cache == "cold" else "warm_mb_s"]
        read_ms = size / 1e3 / mb_s if mb_s else None
        trial["read_at_bandwidth_ms"] = round(read_ms, 2) if read_ms else None
        restore = trial["check_ms"] + trial["restore_wall_ms"]
        trial["restore_vs_read"] = round(restore / read_ms, 2) if read_ms else None


def server_settings(model: str, ctx: int, threads: int, binary: str) -> Settings:
    s = Settings()
    s.proxy.port = 0
    s.server.model = model
    s.server.binary = binary
    s.server.build = "off"  # a benchmark never builds a server
    s.server.slots = 1
    s.server.ctx_per_slot = ctx
    s.server.threads = threads
    s.server.cache_ram_mib = 0  # no RAM copy to serve a "cold" or restored prompt from
    s.cache.enabled = False
    return s


def slot_context(model: str, sizes: list[int]) -> tuple[int, int]:
    """(the model's trained context, the slot context to launch with)."""
    from core.server.gguf_facts import read_facts

    trained = read_facts(model).n_ctx_train or max(sizes) + RESERVE
    want = max(sizes) + RESERVE
    ctx = min(trained, (want + 255) // 256 * 256)
    return trained, ctx


def run_model(
    model: str,
    sizes: list[int],
    *,
    threads: int = 0,
    binary: str = "",
    bandwidth_mib: int = BANDWIDTH_FILE_MIB,
    log: Log | None = None,
    user: Paths | None = None,
) -> ModelReport:
    """Every size on one llama-server launch of `model`; returns the model's report.
    `user`: the installation whose llama-server builds the run uses (`Paths.scratch`)."""
    from core.engine import Core

    trained, ctx = slot_context(model, sizes)
    settings = server_settings(model, ctx, threads, binary)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="warmslot-bench-restore-") as tmp:
        core = Core(user.scratch(Path(tmp)) if user else Paths.under(Path(tmp)), settings)
        core.start(wait_ready=True, timeout=600)
        try:
            sup = core.supervisor
            assert sup is not None and sup.port is not None and sup.resolved is not None
            slot_dir = sup.resolved.slot_dir or core.paths.slot_dir
            server = Server(
                f"http://{settings.server.host}:{sup.port}", sup.auth_headers(), slot_dir
            )
            n_ctx = _slot_ctx(server, ctx)
            binary_info = sup.resolved.binary
            argv = list(sup.argv)
            if log:
                log(
                    f"{Path(model).name}: llama-server {binary_info.version} "
                    f"(patches: {', '.join(binary_info.patches) or 'none'}), slot context {n_ctx}"
                )
            import sqlite_utils

            store = StateStore(sqlite_utils.Database(Path(tmp) / "bench.sqlite3"), slot_dir.parent)
            identity = slot_dir.name
            suffix = server.tokenize(PROBE_SUFFIX, add_special=False)
            short = server.tokenize(SHORT_PROBE_SUFFIX, add_special=False)
            turn = server.tokenize(TURN, add_special=False)
            nbytes = bandwidth_mib << 20
            rows: list[SizeResult] = []
            skipped: list[Skipped] = []
            measured: list[SizeResult] = []
            for i, size in enumerate(sizes):
                if size + RESERVE > n_ctx:
                    why = (
                        f"the model's trained context is {trained} tokens"
                        if size + RESERVE > trained
                        else f"the slot's context is {n_ctx} tokens"
                    )
                    # Where the size is the trained context itself, run it with room for
                    # the probe and the next turn: the row says how many tokens it held.
                    if size <= trained and n_ctx - RESERVE >= size * 0.95:
                        size = n_ctx - RESERVE
                    else:
                        skipped.append({"tokens": size, "why": why})
                        if log:
                            log(f"  {size} tokens: skipped ({why})")
                        continue
                rows.append(
                    run_size(
                        server,
                        store,
                        identity,
                        size,
                        seed=1000 + i,
                        suffix=suffix,
                        turn=turn,
                        short_suffix=short,
                        log=log,
                    )
                )
                nbytes = max(nbytes, rows[-1]["save"]["bytes"])
            bandwidth = measure_bandwidth(slot_dir, nbytes)
            for r in rows:
                derive(r, bandwidth)
                measured.append(r)
        finally:
            core.stop()
    return {
        "model": {"path": model, "name": Path(model).name, "bytes": os.path.getsize(model)},
        "trained_context": trained,
        "slot_context": n_ctx,
        "server": {
            "binary": str(binary_info.path),
            "version": binary_info.version,
            "patches": list(binary_info.patches),
            "argv": argv,
        },
        "load_avg_before": [round(x, 2) for x in load0],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "bandwidth": bandwidth,
        "sizes": measured,
        "skipped": skipped,
    }


def _slot_ctx(server: Server, fallback: int) -> int:
    import urllib.request

    req = urllib.request.Request(server.base + "/slots", headers=server.auth)
    with urllib.request.urlopen(req, timeout=30) as resp:
        slots = json.loads(resp.read())
    return int(slots[0].get("n_ctx", fallback)) if slots else fallback


def goals(models: list[ModelReport]) -> list[Goal]:
    """The two goals (docs/benchmarks.md#restore), per model and size, from the reported numbers."""
    out: list[Goal] = []
    for m in models:
        for r in m["sizes"]:
            for cache, t in r["restore"].items():
                out.append(
                    {
                        "model": m["model"]["name"],
                        "tokens": r["tokens"],
                        "page_cache": cache,
                        "ratio": t["ratio"],
                        "ratio_goal_met": (t["ratio"] or 0) >= GOAL_RATIO
                        if r["tokens"] >= GOAL_RATIO_AT * 0.95
                        else None,
                        "restore_vs_read": t["restore_vs_read"],
                        "bandwidth_goal_met": t["restore_vs_read"] is not None
                        and t["restore_vs_read"] <= GOAL_BANDWIDTH_FACTOR,
                    }
                )
    return out


def machine() -> Machine:
    from core.bench.overhead import machine as overhead_machine

    return overhead_machine()


def run(
    models: list[str],
    sizes: list[int],
    *,
    threads: int = 0,
    binary: str = "",
    bandwidth_mib: int = BANDWIDTH_FILE_MIB,
    log: Log | None = None,
    user: Paths | None = None,
) -> RestoreReport:
    """The whole report: every model, every size."""
    reports = [
        run_model(
            m,
            sizes,
            threads=threads,
            binary=binary,
            bandwidth_mib=bandwidth_mib,
            log=log,
            user=user,
        )
        for m in models
    ]
    return {
        "machine": machine(),
        "sizes_asked": sizes,
        "models": reports,
        "goals": goals(reports),
        "goal_ratio": GOAL_RATIO,
        "goal_ratio_at": GOAL_RATIO_AT,
        "goal_bandwidth_factor": GOAL_BANDWIDTH_FACTOR,
    }


def add_parser(bench_sub: Any) -> None:
    """Register ``warmslot bench restore``."""
    p = bench_sub.add_parser(
        "restore",
        help="cold prefill vs verified restore at 8k / 32k / 64k tokens, with disk bandwidth",
    )
    p.add_argument(
        "--model",
        action="append",
        help="GGUF to bench (repeat for several; default: the configured or demo model)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="also bench the generated tiny dense model (trained context: the largest size)",
    )
    p.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="prompt sizes in tokens, comma-separated (default 8192,32768,65536)",
    )
    p.add_argument("--threads", type=int, help="llama-server threads (default: the setting)")
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=BANDWIDTH_FILE_MIB,
        help="size of the scratch file the disk's bandwidth is read from (at least the "
        "largest state file)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    from core import config as config_mod
    from core.errors import ConfigError
    from core.server import model as model_mod
    from core.server.tinymodel import make_tiny_model

    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        raise ConfigError("--sizes takes token counts, e.g. 8192,32768", key="--sizes") from None
    if not sizes or min(sizes) < 64:
        raise ConfigError("--sizes must be at least 64 tokens each", key="--sizes")
    paths = Paths.default(getattr(args, "dev_dir", None))
    settings = config_mod.load(paths.config_file)
    models = [str(model_mod.resolve(paths, m).path) for m in args.model or []]
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="warmslot-bench-tiny-") as tmp:
        if args.tiny:
            tiny = make_tiny_model(Path(tmp) / "tiny.gguf", n_ctx=max(sizes) + RESERVE)
            models.insert(0, str(tiny))
        if not models:
            models = [str(model_mod.resolve(paths, settings.server.model).path)]
        threads = settings.server.threads if args.threads is None else args.threads
        report = run(
            models,
            sizes,
            threads=threads,
            binary=settings.server.binary,
            bandwidth_mib=args.bandwidth_mib,
            log=log,
            user=paths,
        )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
