"""`warmslot bench restore` on the tiny model at a small size: the report's structure,
a skipped size says why, and every ratio comes from the measured parts (no timing
assertions: the numbers are whatever this machine gives)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.bench import restore, restore_report
from core.cli import main as cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_bench_restore_reports_measured_parts_and_ratios(tiny_model: Path) -> None:
    report = restore.run([str(tiny_model)], [1024, 8192], threads=2, bandwidth_mib=16)

    (mod,) = report["models"]
    assert mod["trained_context"] == 4096  # the tests' tiny model
    assert mod["skipped"] == [{"tokens": 8192, "why": "the model's trained context is 4096 tokens"}]
    (row,) = mod["sizes"]
    assert row["tokens"] == 1024
    # The cold run evaluated the whole prompt (nothing to reuse in an erased slot).
    assert row["cold"]["cache_n"] == 0 and row["cold"]["prompt_n"] == 1024
    assert row["save"]["n_saved"] == 1024 and row["save"]["bytes"] > 0
    bw = mod["bandwidth"]
    assert bw["bytes"] >= 16 << 20 and bw["cold_mb_s"] > 0 and bw["warm_mb_s"] > 0
    assert set(row["restore"]) == {"cold", "warm"}
    for cache, t in row["restore"].items():
        # Restored from the file, verified against the reference, then reused.
        assert t["verify_result"] == "ok"
        assert t["first_token_cache_n"] >= 1024
        parts = t["check_ms"] + t["restore_wall_ms"] + t["verify_ms"] + t["first_token_ms"]
        assert t["total_ms"] == pytest.approx(parts, abs=0.02)
        assert t["ratio"] == pytest.approx(row["cold"]["wall_ms"] / parts, abs=0.051)
        mb_s = bw["cold_mb_s" if cache == "cold" else "warm_mb_s"]
        read_ms = row["save"]["bytes"] / 1e3 / mb_s
        assert t["read_at_bandwidth_ms"] == pytest.approx(read_ms, abs=0.006)
        assert t["restore_vs_read"] == pytest.approx(
            (t["check_ms"] + t["restore_wall_ms"]) / read_ms, rel=0.01, abs=0.006
        )
    # 1024 tokens is below the 32k goal size: the goal is not judged on it.
    assert {g["ratio_goal_met"] for g in report["goals"]} == {None}
    text = restore_report.format_report(report)
    assert "1024  cold" in text and "1024  warm" in text
    assert "8192 skipped: the model's trained context is 4096 tokens" in text


def test_derive_uses_only_the_measured_parts() -> None:
    row = {
        "cold": {"wall_ms": 30000.0},
        "save": {"bytes": 100_000_000},
        "restore": {
            "cold": {
                "check_ms": 1.0,
                "restore_wall_ms": 99.0,
                "verify_ms": 50.0,
                "first_token_ms": 50.0,
            },
            "warm": {
                "check_ms": 0.5,
                "restore_wall_ms": 19.5,
                "verify_ms": 40.0,
                "first_token_ms": 40.0,
            },
        },
    }
    restore.derive(row, {"cold_mb_s": 1000.0, "warm_mb_s": 5000.0})
    cold, warm = row["restore"]["cold"], row["restore"]["warm"]
    assert (cold["ratio"], cold["read_at_bandwidth_ms"], cold["restore_vs_read"]) == (
        150.0,
        100.0,
        1.0,
    )
    assert (warm["ratio"], warm["read_at_bandwidth_ms"], warm["restore_vs_read"]) == (
        300.0,
        20.0,
        1.0,
    )


def test_the_cli_prints_the_report_as_json(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--dev-dir",
        str(tmp_path / "dev"),
        "bench",
        "restore",
        "--model",
        str(tiny_model),
        "--sizes",
        "512",
        "--threads",
        "2",
        "--bandwidth-mib",
        "8",
        "--json",
    ]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in report["models"][0]["sizes"]] == [512]
    assert report["models"][0]["sizes"][0]["restore"]["warm"]["verify_result"] == "ok"


def test_a_busy_machine_is_named_in_the_report() -> None:
    assert restore_report.busy_note([0.9, 1.3, 1.7], 2) is None  # the quiet run's load
    note = restore_report.busy_note([6.3, 5.0, 4.0], 2)
    assert note is not None and "6.3 on 2 CPUs" in note
    assert restore_report.busy_note([], 2) is None
