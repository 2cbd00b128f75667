"""The instability statistics where a user sees them: `merit train` eval records, `merit inspect`
of a run folder (tables, --per-head, --json, the trajectory figure, the verdict, the spectral
bound) and update size from the run's optimizer state."""

import json

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core import instability_rules as rules
from merit_core.diagnostics import verdict as v
from merit_core.metric_names import (
    ACTIVATION_RATIO,
    LOG_Z_MEAN,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MIN,
    UPDATE_RATIO,
)
from tests.cli_runs import train_args


@pytest.fixture(scope="module")
def run(model_cfg, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    result = CliRunner().invoke(cli, train_args(model_cfg, data_dir, out, "--steps", "4", "--set", "warmup_steps=2"))
    assert result.exit_code == 0, result.output
    return out


def test_train_records_the_cheap_statistics(run):
    from merit_core.metrics import read_metrics
    from merit_core.train.trackers import scalars

    evals = [r for r in read_metrics(run) if MAX_ATTENTION_LOGIT in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # before the first update, then every eval_every
    for r in evals:
        n_layers = len(r[MAX_ATTENTION_LOGIT])
        assert len(r[NORMALIZED_ENTROPY_MIN]) == len(r[ACTIVATION_RATIO]) == n_layers
        assert all(0 <= v <= 1 for v in r[NORMALIZED_ENTROPY_MIN])
        assert all(v >= 1 for v in r[ACTIVATION_RATIO])
        assert isinstance(r[LOG_Z_MEAN], float)
    assert UPDATE_RATIO not in evals[0] and all(r[UPDATE_RATIO] > 0 for r in evals[1:])  # MERIT, once it has state
    tracked = scalars(evals[-1])
    assert tracked[f"eval/{NORMALIZED_ENTROPY_MIN}"] == min(evals[-1][NORMALIZED_ENTROPY_MIN])
    assert tracked[f"eval/{ACTIVATION_RATIO}"] == max(evals[-1][ACTIVATION_RATIO])
    assert tracked[f"eval/{LOG_Z_MEAN}"] == evals[-1][LOG_Z_MEAN]


def test_inspect_run_tables_json_and_trajectory(run, tmp_path):
    out, fig = tmp_path / "inspect.json", tmp_path / "traj.png"
    res = CliRunner().invoke(cli, ["inspect", str(run), "--per-head", "--json", str(out), "--plot", str(fig)])
    assert res.exit_code == 0, res.output
    assert "min H/log n" in res.output and "max act ratio" in res.output and "mean log Z" in res.output
    assert "max Δw/w" in res.output
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "trajectory" in res.output
    text = " ".join(res.output.split())
    assert "spectral bound" in text and "verdict" in text
    assert f"{run}: healthy over its 2 checkpoints, steps 2-4 (worst per signal)" in text
    assert "max_logit_growth" in text and "log_z_drift" in text and "e-folds per step" in text
    report = json.loads(out.read_text())
    assert [c["step"] for c in report["checkpoints"]] == [2, 4]
    _check_verdicts(report)
    _check_spectral_bounds(report)
    for c in report["checkpoints"]:
        assert c["output"][LOG_Z_MEAN] == c["summary"][LOG_Z_MEAN]
        assert c["updates"]["optimizer"] == "merit" and c["updates"]["step"] == c["step"]
        ratios = [w[UPDATE_RATIO] for w in c["updates"]["weights"]]
        assert c["summary"][UPDATE_RATIO] == max(ratios) > 0
        assert all("merit" in w for w in c["updates"]["weights"])
        layer_min = min(l[NORMALIZED_ENTROPY_MIN] for l in c["layers"])
        assert c["summary"][NORMALIZED_ENTROPY_MIN] == layer_min
        head_min = min(h[NORMALIZED_ENTROPY_MIN] for l in c["layers"] for h in l["heads"])
        assert head_min == layer_min
    # training measured the same update ratio live (float32, MERIT's update_ratios) as inspect from the
    # checkpoint (float64, a zero-gradient step of a rebuilt optimizer)
    from merit_core.metrics import read_metrics

    live = {r["step"]: r[UPDATE_RATIO] for r in read_metrics(run) if UPDATE_RATIO in r}
    for c in report["checkpoints"]:
        assert live[c["step"]] == pytest.approx(c["summary"][UPDATE_RATIO], rel=1e-4)


def _check_verdicts(report) -> None:
    """The run's verdict and each checkpoint's, read against the JSON's own numbers."""
    first, last = report["checkpoints"]
    assert first["verdict"]["notes"] == [v.FIRST_NOTE] and not first["verdict"]["history"]
    assert [s["signal"] for s in first["verdict"]["signals"]] == [
        rules.MAX_LOGIT,
        rules.ENTROPY,
        rules.UPDATE,
        rules.BOUND,
    ]
    assert last["verdict"]["history"] and [s["signal"] for s in last["verdict"]["signals"]] == list(
        rules.VERDICT_SIGNALS
    )
    signals = {s["signal"]: s for s in last["verdict"]["signals"]}
    assert signals[rules.MAX_LOGIT]["value"] == last["summary"][MAX_ATTENTION_LOGIT]
    assert signals[rules.ENTROPY]["value"] == last["summary"][NORMALIZED_ENTROPY_MIN]
    assert signals[rules.UPDATE]["value"] == last["summary"][UPDATE_RATIO]
    drift = abs(last["output"][LOG_Z_MEAN] - first["output"][LOG_Z_MEAN])
    assert signals[rules.LOG_Z]["value"] == pytest.approx(drift) and signals[rules.LOG_Z]["step"] == 4
    tightest = max(min(l["spectral_logit_bound"], l["logit_bound"]) for l in last["layers"])
    assert signals[rules.BOUND]["value"] == tightest < rules.LOGIT_LIMIT
    # 4 steps at a small lr: every number is far from every threshold
    assert {s["level"] for s in signals.values()} == {rules.HEALTHY} and last["verdict"]["level"] == rules.HEALTHY
    (given,) = report["inputs"]
    assert given["kind"] == "run" and given["verdict"]["steps"] == [2, 4] and given["verdict"]["level"] == rules.HEALTHY
    assert [s["signal"] for s in given["verdict"]["signals"]] == list(rules.VERDICT_SIGNALS)


def _check_spectral_bounds(report) -> None:
    """The spectral bound per layer and head in the JSON: at least the measured logit, at most the max-norm bound."""
    for c in report["checkpoints"]:
        for layer in c["layers"]:
            assert 0 < layer["input_max_l2"] <= layer["input_max_l1"]
            heads = layer["heads"]
            assert layer["spectral_logit_bound"] == max(h["spectral_logit_bound"] for h in heads)
            for h in heads:
                assert h[MAX_ATTENTION_LOGIT] <= h["spectral_logit_bound"] <= h["logit_bound"]


def test_inspect_one_checkpoint_shows_layer_columns_and_updates(run, tmp_path):
    fig = tmp_path / "one.png"
    res = CliRunner().invoke(cli, ["inspect", str(run / "step_4"), "--per-head", "--plot", str(fig)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # titles wrap at the console's width
    assert "act max/median" in text and "attention entropy / log n per head" in text
    assert "next update / weight (merit, step 4" in text and "row wins" in text
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the verdict of a checkpoint by itself: the level rules only, and it says so
    assert "step_4: healthy at step 4" in text and v.NO_HISTORY_NOTE in text
    assert "max_logit" in text and "update_ratio" in text and "log_z_drift" not in text
    assert "spectral bound" in text


def test_update_size_uses_the_run_optimizer_and_schedule(run):
    from merit_core.checkpoint.resolve import SafetensorsReader, find_checkpoints
    from merit_core.diagnostics.checkpoint_model import load_model
    from merit_core.diagnostics.update_size import checkpoint_update_sizes
    from merit_core.schedule import lr_at
    from merit_core.train.config import load_config

    ckpt = find_checkpoints(run)[0]
    report = checkpoint_update_sizes(ckpt, load_model(ckpt, SafetensorsReader(ckpt)))
    assert report.optimizer == "merit" and report.step == ckpt.step == 2 and report.dtype == "float64"
    c = load_config(run / "config.toml")
    want_lr = lr_at(2, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps, total_steps=c.steps)
    assert report.lr == pytest.approx(want_lr, rel=1e-12) and want_lr > 0
    assert report.weights and all(0 < w.ratio < 1 for w in report.weights)
    assert all(w.merit is not None for w in report.weights)
