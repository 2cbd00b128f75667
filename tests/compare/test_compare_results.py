"""The typed summary (merit_core.compare.results): summary.json reads back into it and writes out
unchanged, and REPORT.md's sections, the verdicts and the terminal tables read it."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from rich.console import Console

from merit_cli.compare_cmd import measures_table, results_table
from merit_core.compare.markdown_report import environment_lines, grid_table, render_report, setup_lines
from merit_core.compare.results import (
    BestResult,
    CellResult,
    CompareSettings,
    CompareSummary,
    Curve,
    EnvironmentCheck,
    EnvironmentSample,
    RunResult,
    SeedCurve,
)
from merit_core.compare.verdicts import findings, fmt, mean_std, no_verdict, resolution

ROOT = Path(__file__).resolve().parents[2]
# The committed CPU reproduction: a summary.json of an earlier version (its runs carry no
# `instability`), every part present (cells, seeds, environment checks, Hessians).
COMPARE_CPU = ROOT / "results" / "compare-cpu" / "summary.json"
GOLDEN = ROOT / "tests" / "golden" / "compare_summary.json"  # keys sorted, volatile keys dropped


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _kept(old, new, where: str = "") -> None:
    """Every key and value of `old` is in `new` (which may add keys)."""
    if isinstance(old, dict):
        for key, value in old.items():
            assert key in new, (where, key)
            _kept(value, new[key], f"{where}.{key}")
    elif isinstance(old, list):
        assert len(old) == len(new), where
        for i, (a, b) in enumerate(zip(old, new)):
            _kept(a, b, f"{where}[{i}]")
    else:
        assert old == new, (where, old, new)


def test_summary_json_reads_back_with_every_value_kept():
    data = _load(COMPARE_CPU)
    typed = CompareSummary.from_dict(data)
    assert isinstance(typed.settings, CompareSettings) and isinstance(typed.best[0].environment, EnvironmentCheck)
    assert all(type(r) is RunResult for r in typed.runs) and all(type(c) is CellResult for c in typed.cells)
    merit = typed.best_for("merit", 16)
    assert type(merit.curve) is Curve and merit.curve.step == data["best"][5]["curve"]["step"]
    assert [type(s) for s in merit.seed_curves] == [SeedCurve] * len(merit.seeds)
    written = typed.to_dict()
    _kept(data, written)
    # an earlier version's summary (no instability record, no provenance): every value kept, the
    # fields it lacked at their defaults
    older = copy.deepcopy(data)
    for run in older["runs"]:
        del run["instability"]
    del older["settings"]["provenance"]
    typed_older = CompareSummary.from_dict(older)
    _kept(older, typed_older.to_dict())
    assert typed_older.runs[0].instability is None and typed_older.to_dict()["runs"][0]["instability"] is None
    # this version's summary reads back to itself (the standard serializer, dataclasses.asdict)
    assert CompareSummary.from_dict(written).to_dict() == written
    golden = _load(GOLDEN)
    _kept(golden, CompareSummary.from_dict(golden).to_dict())
    # a key a newer version adds is dropped, never an error
    newer = copy.deepcopy(written)
    newer["best"][0]["future"] = {"a": 1}
    assert CompareSummary.from_dict(newer).to_dict() == written


def test_a_built_record_writes_every_field():
    entry = {"name": "adamw-b2-lr0.001", "optimizer": "adamw", "batch_size": 2, "lr": 1e-3, "status": "finished"}
    entry["environment"] = {"run": "adamw-b2-lr0.001-env2t", "seed": 0, "threads": 2, "status": "finished"}
    built = BestResult.from_dict(entry)
    out = built.to_dict()
    assert out["lr_extended"] == [] and out["hessian"] is None and out["environment"]["hessian"] is None
    assert set(out) == {f.name for f in dataclasses.fields(BestResult)}
    built.environment.hessian = {"largest_algebraic_eigenvalue_spread": 0.5}
    assert built.to_dict()["environment"]["hessian"] == {"largest_algebraic_eigenvalue_spread": 0.5}
    # the nested records read back typed: each environment sample and curve
    entry["environment"]["samples"] = [{"run": "adamw-b2-lr0.001-env2t", "seed": 0, "status": "finished"}]
    entry["seed_curves"] = [{"seed": 0, "step": [0, 4], "val_loss": [8.0, 4.0], "max_attention_logit": [1.0, 2.0]}]
    again = BestResult.from_dict(entry)
    assert again.environment.samples == [EnvironmentSample(run="adamw-b2-lr0.001-env2t", status="finished")]
    assert again.seed_curves == [SeedCurve(0, [0, 4], [8.0, 4.0], [1.0, 2.0])] and again.curve is None
    assert BestResult.from_dict(again.to_dict()) == again


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
    rows = [r for r in environment_lines(summary) if r.startswith(f"| merit | 16 | {merit.lr:.3g} |")]
    assert len(rows) == len(env.samples) == 3  # one row per perturbation
    for row, sample in zip(rows, env.samples):
        assert f"| {fmt(sample.final_val_loss_original)} | {fmt(sample.final_val_loss_rerun)} |" in row
        assert f"| {fmt(sample.final_val_loss_difference)} |" in row
    row = rows[0]
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
