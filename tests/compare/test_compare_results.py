"""The typed summary (merit_core.compare.results): summary.json reads back into it and writes out
unchanged, and REPORT.md's sections, the verdicts and the terminal tables read it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from rich.console import Console

from merit_cli.compare_cmd import measures_table, results_table
from merit_core.compare.report import environment_lines, grid_table, render_report, setup_lines
from merit_core.compare.results import (
    BestResult,
    CellResult,
    CompareSettings,
    CompareSummary,
    EnvironmentCheck,
    RunResult,
)
from merit_core.compare.verdicts import findings, fmt, mean_std, no_verdict, resolution

ROOT = Path(__file__).resolve().parents[2]
# The committed CPU reproduction: a summary.json of an earlier version (its runs carry no
# `instability`), every part present (cells, seeds, environment checks, Hessians).
COMPARE_CPU = ROOT / "results" / "compare-cpu" / "summary.json"
GOLDEN = ROOT / "tests" / "golden" / "compare_summary.json"  # keys sorted, volatile keys dropped


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_summary_json_round_trips_unchanged():
    data = _load(COMPARE_CPU)
    typed = CompareSummary.from_dict(data)
    assert isinstance(typed.settings, CompareSettings) and isinstance(typed.best[0].environment, EnvironmentCheck)
    assert all(type(r) is RunResult for r in typed.runs) and all(type(c) is CellResult for c in typed.cells)
    # the same JSON text: values, keys and their order; no field an older version lacked is added
    assert json.dumps(typed.to_dict()) == json.dumps(data)
    assert "instability" not in typed.to_dict()["runs"][0] and typed.runs[0].instability is None

    golden = _load(GOLDEN)  # no `environment` and no `tokens_per_s*` keys: they stay out
    assert CompareSummary.from_dict(golden).to_dict() == golden

    # keys a newer version adds are kept, in place at the end of their record
    newer = copy.deepcopy(data)
    newer["settings"]["future"] = 1
    newer["best"][0]["future"] = {"a": 1}
    newer["best"][0]["environment"]["future"] = [2]
    again = CompareSummary.from_dict(newer)
    assert again.best[0].extra == {"future": {"a": 1}} and again.best[0].environment.extra == {"future": [2]}
    assert json.dumps(again.to_dict()) == json.dumps(newer)


def test_a_built_record_writes_every_field():
    entry = {"name": "adamw-b2-lr0.001", "optimizer": "adamw", "batch_size": 2, "lr": 1e-3, "status": "finished"}
    entry["environment"] = {"run": "adamw-b2-lr0.001-env2t", "seed": 0, "threads": 2, "status": "finished"}
    read, built = BestResult.from_dict(entry), BestResult.from_dict(entry, built=True)
    assert read == built  # the same record; only what to_dict leaves out differs
    assert "lr_extended" not in read.to_dict() and "hessian" not in read.to_dict()
    assert built.to_dict()["lr_extended"] == [] and built.to_dict()["hessian"] is None
    # the environment check's Hessian is written only once measured (--hessian, largest batch)
    assert "hessian" not in built.to_dict()["environment"]
    built.environment.hessian = {"largest_algebraic_eigenvalue_spread": 0.5}
    assert built.to_dict()["environment"]["hessian"] == {"largest_algebraic_eigenvalue_spread": 0.5}


def test_report_verdicts_and_tables_read_the_typed_record():
    summary = CompareSummary.from_dict(_load(COMPARE_CPU))
    merit, adamw = summary.best_for("merit", 16), summary.best_for("adamw", 16)
    assert no_verdict(summary) is None
    verdict = resolution(merit, adamw)
    claim = next(line for line in findings(summary) if line.startswith("Paper claim 1"))
    assert f"MERIT {mean_std(merit, 'final_val_loss')} vs adamw {mean_std(adamw, 'final_val_loss')}" in claim
    assert f"({verdict.text})" in claim
    assert merit.final_val_loss_std is not None and mean_std(merit, "final_val_loss").endswith(
        fmt(merit.final_val_loss_std)
    )
    # the environment check: one row per best cell, from its EnvironmentCheck
    env = merit.environment
    (row,) = [r for r in environment_lines(summary) if r.startswith(f"| merit | 16 | {merit.lr:.3g} |")]
    assert f"| {fmt(env.final_val_loss_original)} | {fmt(env.final_val_loss_rerun)} |" in row
    assert f"| {fmt(env.final_val_loss_spread)} |" in row
    assert any(line.startswith("| merit | 16 |") and f"**{merit.lr:.3g}: " in line for line in grid_table(summary))
    assert f"- Model: {summary.settings.model} ({summary.settings.n_params:,} parameters)" in setup_lines(summary)
    text = render_report(summary)
    assert claim in text and row in text

    console = Console(width=200, record=True)
    console.print(results_table(summary))
    console.print(measures_table(summary))
    terminal = console.export_text()
    assert f"{merit.final_val_loss:.4f} ± {merit.final_val_loss_std:.4f}" in terminal
    assert "largest alg. eig" in terminal
