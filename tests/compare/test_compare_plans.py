"""merit compare's planning and aggregation, training monkeypatched away: seeds, best lr on the mean,
grid extension at an edge, the ablation preset and the default plan's step counts."""

from __future__ import annotations

import math
import statistics

import pytest

import merit_core.compare as compare
from merit_core.compare import load_spec, run_compare
from merit_core.compare.environment import DEFAULT_PERTURBATIONS, FLOORS, perturbations
from merit_core.compare.grid import next_extensions, plan_runs
from merit_core.compare.markdown_report import ablation_lines, render_report
from merit_core.compare.results import BestResult, CellResult, CompareSettings, CompareSummary, Measured
from merit_core.compare.runner import compare_threads, other_threads
from merit_core.compare.spec import PRESETS
from merit_core.compare.summary import RunRead, cells, select_best
from merit_core.compare.verdicts import resolved
from merit_core.errors import ConfigError
from merit_core.train.hardware import float_environment
from tests.compare.records import best_of, curve, record, seeded, synthetic_summary, with_env


def test_seeds_aggregate_and_the_best_lr_is_chosen_on_the_mean():
    records = [
        # lr 1e-3 holds the single lowest run (4.0) but the higher mean (4.2): the mean decides
        *seeded("adamw", 8, 1e-3, [4.0, 4.4], logits=[10.0, 30.0]),
        *seeded("adamw", 8, 3e-3, [4.1, 4.15]),
        # one diverged seed makes the whole cell diverged, even with the lowest finished loss
        *seeded("merit", 8, 1e-3, [3.0, None], statuses=["finished", "diverged"]),
        *seeded("merit", 8, 3e-3, [3.9, 3.95]),
    ]
    best = {(b.optimizer, b.batch_size): b for b in select_best(records, {r.name: curve(r) for r in records})}
    adamw, merit = best["adamw", 8], best["merit", 8]
    assert adamw.lr == 3e-3 and adamw.final_val_loss == pytest.approx(4.125)
    assert adamw.final_val_loss_std == pytest.approx(statistics.stdev([4.1, 4.15]))
    assert adamw.final_val_loss_values == [4.1, 4.15] and adamw.seeds == [0, 1]
    assert adamw.run_names == ["adamw-b8-lr0.003", "adamw-b8-lr0.003-s1"]
    assert adamw.lr_at_edge == "high" and adamw.grid == [1e-3, 3e-3]
    assert [c.seed for c in adamw.seed_curves] == [0, 1]
    assert adamw.curve == curve(records[2])  # the first seed's trajectory
    assert merit.lr == 3e-3 and merit.n_diverged == 1
    by_lr = {(c.optimizer, c.lr): c for c in cells(records)}
    assert all(type(c) is CellResult for c in by_lr.values())
    assert by_lr["adamw", 1e-3].max_attention_logit == pytest.approx(20.0)
    assert by_lr["adamw", 1e-3].max_attention_logit_values == [10.0, 30.0]
    assert by_lr["merit", 1e-3].status == "diverged" and by_lr["merit", 1e-3].final_val_loss is None
    assert "seed 1" in by_lr["merit", 1e-3].message
    # one seed: the mean is the value itself and there is no spread
    (single,) = select_best(seeded("lamb", 8, 1e-2, [3.3]))
    assert single.final_val_loss == 3.3 and single.final_val_loss_std is None


def test_report_calls_a_difference_within_the_seed_spread_not_resolved():
    a = {"final_val_loss": 4.0, "final_val_loss_values": [3.9, 4.1]}
    b = {"final_val_loss": 4.05, "final_val_loss_values": [4.0, 4.1]}
    c = {"final_val_loss": 4.5, "final_val_loss_values": [4.4, 4.6]}
    # seeds apart but no environment spread measured: not resolved
    assert resolved(Measured(a), Measured(c)) is False

    def figures(d):  # an environment spread of 0.01 each
        return Measured(d, environment=Measured({"final_val_loss_spread": 0.01, "max_attention_logit_spread": 0.5}))

    ma, mb, mc = figures(a), figures(b), figures(c)
    assert resolved(ma, mb) is False and resolved(ma, mc) is True
    assert resolved(Measured({"final_val_loss": 4.0}), mc) is None

    records = [*seeded("adamw", 8, 1e-3, [4.0, 4.2]), *seeded("merit", 8, 1e-3, [4.05, 4.1])]
    records += [*seeded("adamw", 64, 1e-3, [4.6, 4.7]), *seeded("merit", 64, 1e-3, [4.3, 4.35])]
    # a second, worse lr per cell: the claims get a verdict only from cells with an lr grid
    records += [r for o in ("adamw", "merit") for b in (8, 64) for r in seeded(o, b, 3e-3, [5.0, 5.1])]
    summary = synthetic_summary()
    summary.settings.seeds = [0, 1]
    summary.runs, summary.best = records, with_env(best_of(records))
    text = render_report(summary)
    assert "**Batch 8:** merit had the lowest final validation loss, 4.0750 ± 0.0354" in text
    assert "not resolved: within the spread of 2 seeds" in text
    assert (
        "Paper claim 1 (MERIT has the lowest loss at large batch): at batch 64, **holds here**: MERIT 4.3250 ± "
        "0.0354 vs adamw 4.6500 ± 0.0707 (resolved by 2 seeds and beyond the environment spread 0.0200)" in text
    )
    # the loss change from batch 8 to 64 is compared seed by seed (paired seeds); its environment
    # spread is the sum of both ends' (0.01 + 0.01 per change)
    assert (
        "The smallest change: merit (+0.2500); the largest: adamw (+0.5500) (resolved by 2 seeds and beyond the "
        "environment spread 0.0400)." in text
    )
    assert "2 seed(s) per learning rate" in text and "One seed" not in text
    assert "| merit | 8 | 0.001 | 0: 4.0500, 1: 4.1000 |" in text  # each seed's value


def fake_training(monkeypatch, target):
    """Every run 'finishes' at once with a loss that is lowest at lr target[optimizer]."""
    trained = []

    done: set[str] = set()

    def execute(runs, how):
        trained.append(sorted(run.name for run in runs if how.states[run.name] in ("new", "partial")))
        done.update(run.name for run in runs)
        return {**how.states, **{run.name: "finished" for run in runs}}

    def run_state(run):  # no folders: a run is finished once the fake trained it
        return "finished" if run.name in done else "new"

    def run_record(run, state, host_isa=None):
        loss = 3.0 + (math.log10(run.lr) - math.log10(target[run.optimizer])) ** 2
        r = record(run.optimizer, run.batch_size, run.lr, loss)
        r.name, r.seed, r.steps, r.tokens, r.qk_bound_by_layer = run.name, run.seed, run.steps, run.tokens, None
        r.threads, r.perturbation = run.threads, None if run.perturbation is None else run.perturbation.describe()
        return RunRead(r, curve(r))

    monkeypatch.setattr(compare, "execute", execute)
    monkeypatch.setattr(compare, "run_state", run_state)
    monkeypatch.setattr(compare.runner, "run_state", run_state)  # read again by runner.state_now
    monkeypatch.setattr(compare.summary, "run_record", run_record)
    return trained


def test_grid_extends_past_an_edge_until_interior_or_the_limit(tmp_path, model_cfg, data_dir, monkeypatch):
    # auto grids at batch 8 x 32 (256 tokens per step, as gpt2-tiny's measured batch 2 x 128, the
    # nearest measured width): adamw 3.33e-4, 1e-3, 3e-3; merit 3.33e-3, 1e-2, 3e-2
    trained = fake_training(monkeypatch, {"adamw": 0.1, "merit": 0.00333 / 1.5})
    spec = load_spec(
        None,
        optimizers="adamw,merit",
        batch_sizes="8",
        tokens=8192,
        out=str(tmp_path / "cmp"),
        train_values=dict(model=str(model_cfg), data=str(data_dir), seq_len=32),
    )
    result = run_compare(spec)
    threads = compare_threads("auto", None)
    alt = other_threads(threads)
    made, _ = perturbations(DEFAULT_PERTURBATIONS, threads, float_environment(threads))
    assert (
        trained
        == [
            [f"adamw-b8-lr{lr}" for lr in ("0.000333", "0.001", "0.003")]
            + [f"merit-b8-lr{lr}" for lr in ("0.00333", "0.01", "0.03")],
            ["adamw-b8-lr0.009", "merit-b8-lr0.00111"],  # one x3 step past each edge holding the best
            ["adamw-b8-lr0.027"],  # adamw still on its top edge; merit's best (0.00333) is now interior
            # the best cells topped up to 3 seeds (the default best_seeds)
            ["adamw-b8-lr0.027-s1", "adamw-b8-lr0.027-s2", "merit-b8-lr0.00333-s1", "merit-b8-lr0.00333-s2"],
            # each best cell's first seed again, under each perturbation the host can make (the environment check):
            # those at the grid's thread count first, then the one at another thread count
            sorted(f"{cell}{p.suffix}" for cell in ("adamw-b8-lr0.027", "merit-b8-lr0.00333") for p in made[1:]),
            [f"adamw-b8-lr0.027-env{alt}t", f"merit-b8-lr0.00333-env{alt}t"],
        ]
    )
    assert made[0].suffix == f"-env{alt}t"
    assert result.summary.best_for("adamw", 8).seeds == [0, 1, 2]
    env = result.summary.best_for("adamw", 8).environment
    # the fake re-runs equal their originals: the spread is the floor, never 0
    assert env.threads == alt and env.final_val_loss_spread == FLOORS["final_val_loss"] * env.final_val_loss_original
    assert result.summary.settings.environment["check_threads"] == alt
    adamw = result.summary.best_for("adamw", 8)
    merit = result.summary.best_for("merit", 8)
    assert adamw.lr == 0.027 and adamw.lr_extended == [0.009, 0.027]
    assert adamw.lr_at_edge == "high" and adamw.edge_reason == "limit"  # the stated limit: 2 per side
    assert merit.lr == 0.00333 and merit.lr_extended == [0.00111] and merit.lr_at_edge is None
    text = (spec.out / "REPORT.md").read_text()
    assert "adamw at batch 8: the grid was extended past its edge (added lr 0.009, 0.027)." in text
    assert "still the largest of its grid (after 2 extension(s) on that side, the stated limit)" in text
    assert (
        "merit at batch 8: the grid was extended past its edge (added lr 0.00111); the best lr is now interior" in text
    )

    # a given list is never extended, and --max-extensions 0 turns extension off
    assert next_extensions(load_spec(None, lrs="1e-3,3e-3"), result.summary.best, {}) == {}
    zero = load_spec(None, optimizers="adamw", batch_sizes="8", max_extensions=0)
    best = [BestResult("adamw-b8-lr0.003", "adamw", 8, 3e-3, "finished", lr_at_edge="high", grid=[3.33e-4, 1e-3, 3e-3])]
    assert next_extensions(zero, best, {}) == {}
    assert next_extensions(load_spec(None, optimizers="adamw", batch_sizes="8"), best, {}) == {("adamw", 8): [0.009]}


def test_ablation_preset_plans_the_components_at_the_large_batch():
    spec = load_spec(None, preset="ablations")
    runs = plan_runs(spec)
    assert (
        spec.optimizers
        == list(PRESETS["ablations"])
        == [
            "merit",
            "merit-noclip",
            "merit-nobound",
            "max-lamb",
            "l2-merit",
            "lamb-ref",
        ]
    )
    large = max(load_spec(None).all_batch_sizes)
    assert {r.batch_size for r in runs} == {large} and len(runs) == 6 * 3
    assert {r.optimizer: r.grid for r in runs}["merit-noclip"] == {r.optimizer: r.grid for r in runs}["merit"]
    assert str(spec.out).endswith("-ablations")
    assert load_spec(None, preset="ablations", batch_sizes="8,256").all_batch_sizes == [256]
    with pytest.raises(ConfigError, match="give either the preset or --optimizers"):
        load_spec(None, preset="ablations", optimizers="adamw")
    with pytest.raises(ConfigError, match="unknown preset 'ablation'"):
        load_spec(None, preset="ablation")


def test_ablation_report_states_each_component():
    records = [
        *seeded("merit", 64, 3e-2, [4.00, 4.02], logits=[2.0, 2.2]),
        *seeded("merit-noclip", 64, 3e-2, [4.30, 4.35]),  # hurt, resolved
        *seeded("merit-nobound", 64, 3e-2, [3.99, 4.05]),  # within the spread
        *seeded("max-lamb", 64, 3e-2, [None, None], statuses=["diverged", "diverged"]),
    ]
    summary = CompareSummary(
        settings=CompareSettings(optimizers=["merit", "merit-noclip", "merit-nobound", "max-lamb"], batch_sizes=[64]),
        runs=records,
        best=with_env(best_of(records)),
    )
    lines = ablation_lines(summary)
    assert lines[0].startswith("Without element-wise clipping of the update ratios (merit-noclip): hurt: loss 4.3250")
    assert "(+0.3150, +7.86%; resolved by 2 seeds and beyond the environment spread 0.0200)" in lines[0]
    assert "(merit-nobound): hurt" in lines[1] and "not resolved: within the spread of 2 seeds" in lines[1]
    assert lines[2] == (
        "Without element-wise ratios (one max-norm ratio per tensor instead) (max-lamb): "
        "diverged at every lr tried, where MERIT did not."
    )


def test_default_plan_step_counts():
    """The default comparison: >= 50 optimizer steps at its large batch (see merit_core.compare.__doc__)."""
    runs = plan_runs(load_spec(None))
    assert len(runs) == 18 and {r.optimizer for r in runs} == {"adamw", "lamb", "merit"}
    assert {(r.batch_size, r.steps, r.tokens) for r in runs} == {(2, 512, 131_072), (16, 64, 131_072)}
    assert min(r.steps for r in runs if r.batch_size == 16) >= 50
    assert all(r.config.model == "gpt2-tiny" and r.config.seq_len == 128 for r in runs)
    quick = plan_runs(load_spec(None, quick=True))
    assert [(r.batch_size, r.steps) for r in quick if r.optimizer == "merit"] == [(2, 256), (16, 32)]
    assert len(quick) == 6


def test_shipped_cpu_reproduction_spec():
    """compare-cpu.toml: >= 100 steps at the large batch, >= 2 seeds, the Hessian on, 36 base runs."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "compare-cpu.toml"
    spec = load_spec(path)
    runs = plan_runs(spec)
    assert spec.seeds >= 2 and spec.hessian and spec.max_extensions == 2
    assert spec.best_seeds == 3 and spec.environment_check
    assert min(r.steps for r in runs if r.batch_size == max(spec.all_batch_sizes)) >= 100
    assert len(runs) == 3 * 2 * 3 * 2 and {r.seed for r in runs} == {0, 1}
    assert {r.tokens for r in runs} == {212_992}


def test_cli_reports_grid_extensions(tmp_path, model_cfg, data_dir, monkeypatch):
    from click.testing import CliRunner

    from merit_cli.main import cli

    fake_training(monkeypatch, {"adamw": 0.1})
    args = ["--model", str(model_cfg), "--data", str(data_dir), "--seq-len", "32", "--optimizers", "adamw"]
    args += ["--batch-sizes", "8", "--tokens", "8192", "--out", str(tmp_path / "cmp")]
    result = CliRunner().invoke(cli, ["compare", *args])
    assert result.exit_code == 0, result.output
    assert "adding adamw b8 lr 0.009" in result.output and "adding adamw b8 lr 0.027" in result.output
    assert "grids extended past an edge: adamw b8 +0.009, 0.027" in result.output
