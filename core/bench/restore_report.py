"""`warmslot bench restore`'s report: its shape (what `--json` prints, TypedDicts) and
the text tables `format_report` prints (core/bench/restore.py measures)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from core.bench.overhead import Machine

# ----------------------------------------------------------------------------- the report
# `warmslot bench restore --json`: what `run` returns and `format_report` prints.


class Bandwidth(TypedDict):
    """The disk's read bandwidth (`measure_bandwidth`)."""

    bytes: int
    cold_cached_fraction: float | None  # left in the page cache after the drop
    cold_ms: float
    cold_mb_s: float
    warm_ms: float
    warm_mb_s: float


class FileRead(TypedDict):
    """One sequential read of a state file (`_file_read`)."""

    ms: float
    cached_fraction_before: float | None


class FileReads(FileRead):
    """The cold read, with the cached read's time beside it."""

    warm_ms: float


class ColdRun(TypedDict):
    """The cold prefill of a prompt size (its numbers as the server sent them)."""

    wall_ms: float
    prompt_ms: float | None
    prompt_n: int | None
    cache_n: int | None


class SaveRun(TypedDict):
    """The slot save of that prefill, and the hash of its file."""

    wall_ms: float
    server_ms: float | None
    bytes: int
    n_saved: int | None
    sha256_ms: float


class RestoreTrial(TypedDict):
    """One verified restore (`restore_once`); `derive` adds the last three."""

    cached_fraction_before: float | None
    check_ms: float
    restore_wall_ms: float
    restore_server_ms: float | None
    verify_ms: float
    verify_prompt_ms: float | None
    verify_predicted_ms: float | None
    verify_result: str  # "ok", or why the check failed
    probe_tokens: int
    verify_short_ms: float | None
    short_probe_tokens: int | None
    first_token_ms: float
    first_token_prompt_n: int | None
    first_token_cache_n: int | None
    total_ms: float
    ratio: NotRequired[float | None]
    read_at_bandwidth_ms: NotRequired[float | None]
    restore_vs_read: NotRequired[float | None]


class SizeResult(TypedDict):
    """One prompt size (`run_size`): cold, save, and a restore per page-cache state."""

    tokens: int
    cold: ColdRun
    save: SaveRun
    reference_probe_ms: float
    file_read: FileReads
    restore: dict[str, RestoreTrial]  # "cold" / "warm" page cache


class Skipped(TypedDict):
    """A size the model or slot cannot hold, and why."""

    tokens: int
    why: str


class ModelFile(TypedDict):
    path: str
    name: str
    bytes: int


class ServerRun(TypedDict):
    """The llama-server a model ran on."""

    binary: str
    version: str
    patches: list[str]
    argv: list[str]


class ModelReport(TypedDict):
    """Every size of one model (`run_model`)."""

    model: ModelFile
    trained_context: int
    slot_context: int
    server: ServerRun
    load_avg_before: list[float]
    load_avg_after: list[float]
    bandwidth: Bandwidth
    sizes: list[SizeResult]
    skipped: list[Skipped]


class Goal(TypedDict):
    """The two goals (docs/benchmarks.md#restore) judged on one model, size and page-cache
    state (`goals`)."""

    model: str
    tokens: int
    page_cache: str
    ratio: float | None
    ratio_goal_met: bool | None  # None: the size is below `GOAL_RATIO_AT`
    restore_vs_read: float | None
    bandwidth_goal_met: bool


class RestoreReport(TypedDict):
    """The whole report (`run`)."""

    machine: Machine
    sizes_asked: list[int]
    models: list[ModelReport]
    goals: list[Goal]
    goal_ratio: float
    goal_ratio_at: int
    goal_bandwidth_factor: float


# ----------------------------------------------------------------------------- the disk


# ----------------------------------------------------------------------------- output


def format_report(report: RestoreReport) -> str:
    """The report as text: one table per model, a row per size and page-cache state."""
    m = report["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cpus']} CPUs, {m.get('ram_gib', '?')} GiB, {m['system']}",
    ]
    head = (
        f"{'tokens':>7} {'cache':>5} {'cold s':>7} {'save ms':>8} {'file MB':>8} "
        f"{'check':>7} {'restore':>8} {'(server)':>8} {'verify':>7} {'1st tok':>8} "
        f"{'total':>8} {'cold÷':>7} {'read@bw':>8} {'rest÷rd':>7} {'short v':>8}  reuse"
    )
    for mod in report["models"]:
        bw = mod["bandwidth"]
        lines += [
            "",
            f"{mod['model']['name']} — llama-server {mod['server']['version']} "
            f"(patches: {', '.join(mod['server']['patches']) or 'none'}); trained context "
            f"{mod['trained_context']}, slot context {mod['slot_context']}; load "
            f"{mod['load_avg_before']} → {mod['load_avg_after']}",
            f"disk read: {bw['cold_mb_s']:.0f} MB/s cold (page cache dropped, "
            f"{_pct(bw['cold_cached_fraction'])} still cached), {bw['warm_mb_s']:.0f} MB/s "
            f"cached ({bw['bytes'] / 2**20:.0f} MiB file)",
        ]
        busy = busy_note(mod["load_avg_before"], m["cpus"] or 1)
        if busy:
            lines.append(busy)
        lines.append(head)
        for r in mod["sizes"]:
            for cache, t in r["restore"].items():
                reuse = f"{t['first_token_cache_n']}+{t['first_token_prompt_n']}"
                if t["verify_result"] != "ok":
                    reuse += f"  VERIFY FAILED: {t['verify_result']}"
                lines.append(
                    f"{r['tokens']:>7} {cache:>5} {r['cold']['wall_ms'] / 1000:>7.2f} "
                    f"{r['save']['wall_ms']:>8.1f} {r['save']['bytes'] / 1e6:>8.1f} "
                    f"{t['check_ms']:>7.1f} {t['restore_wall_ms']:>8.1f} "
                    f"{_num(t['restore_server_ms']):>8} {t['verify_ms']:>7.1f} "
                    f"{t['first_token_ms']:>8.1f} {t['total_ms']:>8.1f} "
                    f"{_num(t['ratio'], '×'):>7} {_num(t['read_at_bandwidth_ms']):>8} "
                    f"{_num(t['restore_vs_read'], '×'):>7} "
                    f"{_num(t.get('verify_short_ms')):>8}  {reuse}"
                )
        for s in mod["skipped"]:
            lines.append(f"{s['tokens']:>7} skipped: {s['why']}")
    lines += [
        "",
        "ms unless marked; cache: the state file dropped from (cold) or kept in (warm) the "
        "page cache; check: Warmslot's file check before a restore; restore: the server's "
        "restore call (server-side time in brackets); verify: the known-answer probe and its "
        "check; total = check + restore + verify + 1st tok; cold÷ = cold ÷ total; read@bw: "
        "file size ÷ the disk's measured bandwidth (cold or cached); rest÷rd = (check + "
        "restore) ÷ read@bw; short v: a shorter probe (a 1-token suffix, 2 tokens), timed "
        "on the same restored state, not used (docs/cache.md#verification); reuse: cached + "
        "evaluated tokens of the first request after the restore.",
    ]
    for g in report["goals"]:
        if g["ratio_goal_met"] is not None:
            lines.append(
                f"goal cold ÷ restored ≥ {report['goal_ratio']:.0f}× at {g['tokens']} tokens "
                f"({g['model']}, {g['page_cache']} page cache): {g['ratio']}× — "
                + ("met" if g["ratio_goal_met"] else "NOT met")
            )
    return "\n".join(lines)


def busy_note(load_before: list[float], cpus: int) -> str | None:
    """A warning when other work loaded the machine as the run began (1-minute load
    average over half the CPUs): the steps after a restore are a few hundred rows and
    slowed 4–10× under load where the long cold prefill slowed 1–4× (measured,
    docs/benchmarks.md#restore), so the ratios come out low."""
    if not load_before or load_before[0] <= cpus / 2:
        return None
    return (
        f"BUSY MACHINE: load average {load_before[0]:.1f} on {cpus} CPUs before the run — "
        "the ratios below are lower than on a quiet machine (docs/benchmarks.md#restore)"
    )


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v * 100:.0f} %"


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "—"
    return f"{v:.1f}{unit}" if v < 1000 else f"{v:.0f}{unit}"
