"""merit compare without training: spec parsing, lr grids, best-lr selection, report text, worker env."""

from __future__ import annotations

import math

import pytest

from merit_core.compare.grid import AUTO_FACTORS, auto_lr_grid, config_mismatch, plan_runs, round_lr
from merit_core.compare.markdown_report import render_report
from merit_core.compare.results import BestResult
from merit_core.compare.runner import worker_env
from merit_core.compare.spec import load_spec, parse_batch_sizes, parse_lrs, parse_optimizers
from merit_core.compare.summary import rank_key, select_best
from merit_core.errors import ConfigError
from tests.compare.records import best_of, record, synthetic_summary


def test_best_lr_selection_with_diverged_and_nonfinite_runs():
    records = [
        record("adamw", 8, 1e-3, 4.10),
        record("adamw", 8, 3e-3, 3.90),
        record("adamw", 8, 1e-2, None, "diverged"),
        record("merit", 8, 1e-3, math.nan),
        record("merit", 8, 3e-3, 4.00),
        record("merit", 8, 1e-2, 4.00),
        record("lamb", 8, 1e-3, None, "diverged"),
        record("lamb", 8, 3e-3, None, "diverged"),
        record("merit", 64, 1e-2, 4.5),
        record("merit", 64, 3e-2, 4.2),
    ]
    best = {(b.optimizer, b.batch_size): b for b in select_best(records)}
    assert list(best) == [("adamw", 8), ("merit", 8), ("lamb", 8), ("merit", 64)]
    assert all(type(b) is BestResult for b in best.values())  # typed where it is built
    assert best["adamw", 8].lr == 3e-3 and best["adamw", 8].n_diverged == 1
    assert best["adamw", 8].lr_at_edge is None and best["adamw", 8].grid == [1e-3, 3e-3, 1e-2]
    # a NaN loss never wins; equal losses -> the smaller lr
    assert best["merit", 8].lr == 3e-3 and best["merit", 8].final_val_loss == 4.00
    # everything diverged: reported as diverged, not an error
    assert best["lamb", 8].status == "diverged" and best["lamb", 8].n_diverged == 2
    assert best["lamb", 8].lr_at_edge is None
    assert best["merit", 64].lr_at_edge == "high"
    assert rank_key(records[2]) == (2, math.inf, 1e-2)  # diverged: after finished and unstable cells


def test_report_is_computed_from_the_numbers():
    text = render_report(synthetic_summary())
    assert (
        "**Batch 8:** merit had the lowest final validation loss, 3.4000 (lr 0.001); then adamw 3.5000 "
        "(+0.1000, +2.9%)" in text
    )
    assert "**Batch 64:** merit had the lowest final validation loss, 3.6000" in text
    assert "adamw 3.5000 -> 3.9000 (+0.4000)" in text and "merit 3.4000 -> 3.6000 (+0.2000)" in text
    assert "The largest is 8.00x the smallest." in text
    # one seed each: MERIT is lower, but nothing is resolved, so the claim does not "hold"
    assert (
        "Paper claim 1 (MERIT has the lowest loss at large batch): at batch 64, **not resolved**: MERIT 3.6000 vs "
        "adamw 3.9000 (not resolved: one seed, spread not measured)" in text
    )
    assert "Diverged runs (non-finite loss; ranked last): merit b64 lr 0.01" in text
    assert "1.35M parameters" in text

    flipped = synthetic_summary()
    for r in flipped.runs:
        if r.optimizer == "adamw":
            r.final_val_loss -= 1.0
    flipped.best = best_of(flipped.runs)
    text = render_report(flipped)
    assert "**Batch 64:** adamw had the lowest final validation loss, 2.9000" in text
    assert "at batch 64, **not resolved**: MERIT 3.6000 vs adamw 2.9000" in text


def test_auto_grid_rule():
    from merit_core.optim.registry import default_lr

    # measured optimizers: centred on the registry's measured lr for that model, batch and seq len
    assert auto_lr_grid("adamw", 16, 2, "gpt2-tiny", 128) == sorted(round_lr(2.83e-3 * f) for f in AUTO_FACTORS)
    assert auto_lr_grid("merit", 2, 2, "gpt2-tiny", 128, quick=True) == [1e-2]
    assert auto_lr_grid("lamb", 16, 2, "gpt2-tiny", 128, quick=True) == [2.83e-2]  # measured at 16, not scaled from 2
    assert auto_lr_grid("merit", 64, 64, "gpt2-small", 1024, quick=True) == [2e-3]
    # between entries: the nearest one x sqrt(tokens per step ratio), as merit train's default
    assert auto_lr_grid("merit", 32, 2, "gpt2-tiny", 128, quick=True) == [
        default_lr("merit", "gpt2-tiny", 32, 128, 128).lr
    ]
    assert auto_lr_grid("merit", 32, 2, "gpt2-tiny", 128, quick=True) == [round_lr(2.83e-2 * 2**0.5)]
    # ablations follow MERIT; unmeasured optimizers their registry default (x 5/3 on small models)
    # at the smallest batch, x sqrt(batch / smallest batch) above it
    assert auto_lr_grid("merit-noclip", 8, 8, "gpt2-tiny", 128) == auto_lr_grid("merit", 8, 8, "gpt2-tiny", 128)
    assert round_lr(1e-4 * 5 / 3) in auto_lr_grid("lion", 8, 8, "gpt2-tiny", 128)
    assert round_lr(1e-4 * 5 / 3 * 2) in auto_lr_grid("lion", 32, 8, "gpt2-tiny", 128)
    assert 1e-4 in auto_lr_grid("lion", 480, 480, "gpt2-small", 1024)


def test_quick_and_single_lr_reports_give_no_verdict():
    from merit_core.compare.verdicts import findings

    summary = synthetic_summary()
    assert any(line.startswith("Paper claim 1") for line in findings(summary))
    summary.settings.quick = True
    lines = findings(summary)
    assert not any(line.startswith("Paper claim") and "**holds" in line for line in lines)
    assert not any("does not hold" in line for line in lines)
    assert any("**no verdict**: this is a smoke run (--quick" in line for line in lines)
    summary.settings.quick = False
    for b in summary.best:
        b.grid = [b.lr]
    assert any("**no verdict**: one lr only for" in line for line in findings(summary))


def test_spec_parsing_and_layers(tmp_path):
    assert parse_optimizers(" AdamW, merit ,adamw") == ["adamw", "merit"]
    assert parse_batch_sizes("64, 8,1k") == [8, 64, 1024]
    assert parse_lrs("AUTO") == "auto" and parse_lrs("3e-3,1e-3") == [1e-3, 3e-3]
    config = tmp_path / "c.toml"
    config.write_text(
        'optimizers = ["adamw", "merit"]\nbatch_sizes = [480, 1024]\ntokens = 1_000_000\n'
        'lrs = {adamw = [6e-4, 1.2e-3]}\n[train]\nmodel = "gpt2-small"\nseq_len = 1024\n'
        "[per_optimizer.merit]\nbatch_sizes = [1024]\noptimizer_args = {betas = [0.9, 0.99]}\n"
    )
    spec = load_spec(config, tokens=2_000_000)
    assert spec.batch_sizes == {"adamw": [480, 1024], "merit": [1024]}
    assert spec.lrs == {"adamw": [6e-4, 1.2e-3], "merit": "auto"} and spec.tokens == 2_000_000
    assert spec.optimizer_args["merit"] == {"betas": [0.9, 0.99]} and spec.out.name == "compare-gpt2-small"
    runs = plan_runs(spec)
    # MERIT's centre: its measured GPT-2 small lr (2e-3 at 64 x 1024) x sqrt(1024 / 64)
    merit_lrs = sorted(round_lr(8e-3 * f) for f in AUTO_FACTORS)
    assert [r.name for r in runs] == [
        "adamw-b480-lr0.0006",
        "adamw-b480-lr0.0012",
        "adamw-b1024-lr0.0006",
        "adamw-b1024-lr0.0012",
        *[f"merit-b1024-lr{lr:.3g}" for lr in merit_lrs],
    ]
    assert {r.steps for r in runs if r.batch_size == 480} == {5}  # ceil(2e6 / (480 * 1024))
    assert runs[-1].config.optimizer_args == {"betas": [0.9, 0.99]} and runs[-1].config.steps == 2
    with pytest.raises(ConfigError, match="put it under \\[train\\]"):
        config.write_text("seq_len = 64\n")
        load_spec(config)
    with pytest.raises(ConfigError, match="set them in \\[per_optimizer.NAME\\]"):
        load_spec(None, overrides=["optimizer_args.betas=[0.9, 0.9]"])
    with pytest.raises(ConfigError, match="unknown hyperparameter 'beta'"):
        config.write_text("[per_optimizer.merit]\noptimizer_args = {beta = 0.9}\n")
        load_spec(config)


def test_config_mismatch_names_the_key():
    spec = load_spec(None, optimizers="merit", batch_sizes="8", lrs="1e-3", tokens=8192)
    (run,) = plan_runs(spec)
    from dataclasses import asdict

    saved = {k: v for k, v in asdict(run.config).items() if v is not None and k != "resume"}
    assert config_mismatch(saved, run.config) is None
    assert config_mismatch({**saved, "eval_every": 3, "device": "cuda"}, run.config) is None
    assert config_mismatch({**saved, "steps": 4, "warmup_steps": 0}, run.config) == "steps: 4 != 8"


def test_worker_env_splits_cores_or_gpus(monkeypatch):
    monkeypatch.setattr("merit_core.compare.runner.usable_cores", lambda: 8)
    env = worker_env(slot=1, jobs=4, n_gpus=0)
    assert env["OMP_NUM_THREADS"] == "2" and env["MKL_NUM_THREADS"] == "2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker_env(slot=5, jobs=6, n_gpus=4)["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert worker_env(slot=5, jobs=6, n_gpus=4)["CUDA_VISIBLE_DEVICES"] == "5"
    assert worker_env(slot=0, jobs=16, n_gpus=0)["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("name", ["compare-gpt2-small", "compare-gpt2-medium"])
def test_shipped_compare_configs_plan_the_paper_runs(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.toml"
    runs = plan_runs(load_spec(path))
    assert {r.optimizer for r in runs} >= {"adamw", "merit"}
    assert 480 in {r.batch_size for r in runs if r.optimizer == "adamw"}
    assert max(r.batch_size for r in runs if r.optimizer == "merit") >= 1024


def test_the_h200_spec_grids_around_the_measured_defaults_of_each_batch():
    from merit_core.config_catalog import find_config
    from merit_core.optim.registry import default_lr

    spec = load_spec(find_config("compare-h200", "compare"))
    runs = plan_runs(spec)
    assert len(runs) == 18 and spec.hessian and spec.jobs == 3 and spec.seeds == 1
    assert {r.optimizer for r in runs} == {"adamw", "lamb", "merit"} and {r.batch_size for r in runs} == {16, 128}
    for r in runs:
        c = r.config
        assert (c.model, c.seq_len, c.compile, c.micro_batch_size, c.data) == ("gpt2-small", 1024, True, 16, None)
        centre = default_lr(r.optimizer, "gpt2-small", r.batch_size, 1024, 768).lr
        assert r.grid == tuple(sorted(round_lr(centre * f) for f in AUTO_FACTORS))
    assert {r.batch_size: r.steps for r in runs} == {16: 320, 128: 40}


def test_gpu_compare_script_is_valid_bash():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_compare.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "compare-h200" in text and "--dry-run" in text and ".gpu-wheels" in text
