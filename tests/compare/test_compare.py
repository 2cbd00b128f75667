"""`merit compare` end to end on a 2-layer, 32-dim GPT-2: run folders, skip, resume, outputs, bad input."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.checkpoint import runs
from merit_core.checkpoint.state import read_trainer_state
from merit_core.compare import CompareCallbacks, load_spec, plan_compare, run_compare
from merit_core.compare.runner import STATUS_FILE, run_state
from merit_core.metrics import read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRAIN = dict(eval_batches=2, eval_batch_size=4, eval_every=4, log_every=1, save_every=2, keep_checkpoints=0)


class Counting(CompareCallbacks):
    """Records which runs trained, and whether they resumed."""

    def __init__(self):
        self.started: list[tuple[str, bool]] = []
        self.ended: list[tuple[str, str]] = []

    def on_run_start(self, run, resumed):
        self.started.append((run.name, resumed))

    def on_run_end(self, run, state, message):
        self.ended.append((run.name, state))


def tiny_spec(model_cfg, data_dir, out, **kwargs):
    values = dict(optimizers="adamw,merit", batch_sizes="2,4", lrs="1e-3,1e-2", tokens=512, out=str(out), jobs=1)
    values.update(best_seeds=1, environment_check=False)  # the grid only (top-ups and the check: test_compare_plans)
    values.update(kwargs)
    sets = [f"{k}={v}" for k, v in TRAIN.items()]
    return load_spec(
        None, overrides=sets, train_values=dict(model=str(model_cfg), data=str(data_dir), seq_len=32), **values
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_cfg, data_dir):
    """One comparison (2 optimizers x 2 batch sizes x 2 lrs = 8 runs), trained once for the module."""
    out = tmp_path_factory.mktemp("cmp") / "cmp"
    spec = tiny_spec(model_cfg, data_dir, out)
    calls = Counting()
    result = run_compare(spec, calls)
    return spec, result, calls


def test_every_run_is_a_train_run_folder(finished):
    spec, result, calls = finished
    assert len(calls.started) == 8 and all(not resumed for _, resumed in calls.started)
    records = result.summary.to_dict()["runs"]
    assert {(r["optimizer"], r["batch_size"], r["lr"]) for r in records} == {
        (o, b, lr) for o in ("adamw", "merit") for b in (2, 4) for lr in (1e-3, 1e-2)
    }
    for r in records:
        run_dir = spec.out / "runs" / f"{r['optimizer']}-b{r['batch_size']}-lr{r['lr']:.3g}"
        assert r["run_dir"] == str(run_dir)
        # same token budget: 512 tokens at seq 32 -> 8 steps at batch 2, 4 steps at batch 4
        assert r["tokens"] == 512 and r["steps"] == 512 // (32 * r["batch_size"])
        assert (run_dir / "config.toml").is_file() and (run_dir / "curves.png").is_file()
        step, ckpt = runs.checkpoints(run_dir)[-1]
        assert step == r["steps"] and read_trainer_state(ckpt).optimizer == r["optimizer"]
        final = [m for m in read_metrics(run_dir) if "val_loss" in m][-1]
        assert final["step"] == r["steps"] and final["val_loss"] == pytest.approx(r["final_val_loss"])
        assert r["max_attention_logit_by_layer"] == final["max_attention_logit"]
        assert r["max_attention_logit"] == max(final["max_attention_logit"])
        assert r["status"] == "finished" and math.isfinite(r["final_val_loss"])
        # merit inspect's max-norm product ||W_Q||_m ||W_K||_m of the final weights, per layer
        from merit_core.diagnostics.weights import weight_stats

        stats = weight_stats(ckpt, include_other=False).to_dict()["layers"]
        assert r["qk_bound_by_layer"] == [layer["q_max_norm"] * layer["k_max_norm"] for layer in stats]


def test_summary_json_shape_and_best(finished):
    spec, result, _ = finished
    data = json.loads((spec.out / "summary.json").read_text())
    assert set(data) == {"settings", "runs", "cells", "best"}
    assert data == json.loads(json.dumps(result.summary.to_dict()))  # the typed result is summary.json
    required = {
        "optimizer",
        "batch_size",
        "lr",
        "tokens",
        "final_val_loss",
        "max_attention_logit",
        "max_attention_logit_by_layer",
        "run_dir",
        "status",
    }
    assert all(required <= set(r) for r in data["runs"])
    assert len(data["best"]) == 4
    for b in data["best"]:
        group = [r for r in data["runs"] if (r["optimizer"], r["batch_size"]) == (b["optimizer"], b["batch_size"])]
        assert b["final_val_loss"] == min(r["final_val_loss"] for r in group)
        assert b["grid"] == [1e-3, 1e-2] and len(b["max_attention_logit_by_layer"]) == 2
        assert b["curve"]["step"][0] == 0 and b["curve"]["step"][-1] == b["steps"]
    assert data["settings"]["tokens_per_run"] == 512 and data["settings"]["steps"] == {"2": 8, "4": 4}


def test_plot_is_a_png(finished):
    spec, _, _ = finished
    raw = (spec.out / "compare.png").read_bytes()
    assert raw.startswith(PNG_MAGIC)
    import matplotlib.image

    image = matplotlib.image.imread(spec.out / "compare.png")
    assert image.shape[0] > 300 and image.shape[1] > 1000


def test_report_states_the_numbers(finished):
    spec, result, _ = finished
    text = (spec.out / "REPORT.md").read_text()
    for b in result.summary.to_dict()["best"]:
        assert f"{b['final_val_loss']:.4f}" in text
    for batch in (2, 4):
        winner = min(
            (b for b in result.summary.to_dict()["best"] if b["batch_size"] == batch), key=lambda b: b["final_val_loss"]
        )
        assert f"**Batch {batch}:** {winner['optimizer']} had the lowest final validation loss" in text
    assert "512 tokens" in text and "Caveats" in text and "One seed" in text


def test_report_and_plot_show_lr_sensitivity(finished):
    spec, result, _ = finished
    text = (spec.out / "REPORT.md").read_text()
    section = text.split("## Learning-rate sensitivity")[1].split("\n## ")[0]
    summary = result.summary.to_dict()
    for cell in summary["cells"]:  # every lr of every grid, with its loss and max logit
        row = f"| {cell['optimizer']} | {cell['batch_size']} | {cell['lr']:.3g} | {cell['final_val_loss']:.4f} |"
        assert row in section
        assert f"{cell['max_attention_logit']:.2f} | 0 of 1 |" in section
    for name in ("adamw", "merit"):
        for batch in (2, 4):
            assert f"- {name} at batch {batch}: good lrs" in section
    import matplotlib.image

    image = matplotlib.image.imread(spec.out / "compare.png")
    assert image.shape[0] > 900  # the second row: loss and max logit against lr


def test_rerun_skips_finished_and_resumes_unfinished(finished, model_cfg, data_dir):
    spec, result, _ = finished
    run_dirs = [spec.out / "runs" / name for name in ("adamw-b2-lr0.001", "merit-b4-lr0.01")]
    stamps = {p: p.stat().st_mtime_ns for d in run_dirs for p in d.glob("step_*/model.safetensors")}
    calls = Counting()
    again = run_compare(tiny_spec(model_cfg, data_dir, spec.out), calls)
    assert calls.started == [] and again.trained == []
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert again.summary.to_dict()["best"] == result.summary.to_dict()["best"]

    # an interrupted run: its final checkpoint is gone, an earlier one remains
    victim = spec.out / "runs" / "merit-b2-lr0.01"
    before = [r for r in result.summary.to_dict()["runs"] if r["name"] == "merit-b2-lr0.01"][0]
    shutil.rmtree(victim / "step_8")
    assert [s for s, _ in runs.checkpoints(victim)][-1] == 6
    calls = Counting()
    resumed = run_compare(tiny_spec(model_cfg, data_dir, spec.out), calls)
    assert calls.started == [("merit-b2-lr0.01", True)] and calls.ended == [("merit-b2-lr0.01", "finished")]
    after = [r for r in resumed.summary.to_dict()["runs"] if r["name"] == "merit-b2-lr0.01"][0]
    assert after["final_val_loss"] == pytest.approx(before["final_val_loss"], rel=1e-6)
    assert [s for s, _ in runs.checkpoints(victim)][-1] == 8


def test_diverged_run_is_reported_and_skipped(tmp_path, model_cfg, data_dir, monkeypatch):
    from merit_core.errors import TrainingDiverged
    from merit_core.train import training_run as train_run

    real = train_run.run_training

    def sometimes_diverges(config, callbacks=None):
        if config.lr == 1e-2:
            raise TrainingDiverged("training stopped: the loss became non-finite at step 3")
        return real(config, callbacks)

    monkeypatch.setattr(train_run, "run_training", sometimes_diverges)
    spec = tiny_spec(model_cfg, data_dir, tmp_path / "cmp", optimizers="adamw", batch_sizes="4")
    result = run_compare(spec, Counting())
    by_lr = {r["lr"]: r for r in result.summary.to_dict()["runs"]}
    assert by_lr[1e-2]["status"] == "diverged" and by_lr[1e-2]["final_val_loss"] is None
    assert "non-finite" in by_lr[1e-2]["message"]
    assert result.summary.to_dict()["best"][0]["lr"] == 1e-3 and result.summary.to_dict()["best"][0]["n_diverged"] == 1
    assert "Diverged runs" in (spec.out / "REPORT.md").read_text()
    plan = plan_compare(spec)
    assert plan.states == {"adamw-b4-lr0.001": "finished", "adamw-b4-lr0.01": "diverged"}
    assert (spec.out / "runs" / "adamw-b4-lr0.01" / STATUS_FILE).is_file()


def test_parallel_jobs_run_in_worker_processes(tmp_path, model_cfg, data_dir):
    spec = tiny_spec(model_cfg, data_dir, tmp_path / "cmp", optimizers="merit", batch_sizes="4", jobs=2)
    calls = Counting()
    result = run_compare(spec, calls)
    assert sorted(calls.ended) == [("merit-b4-lr0.001", "finished"), ("merit-b4-lr0.01", "finished")]
    assert all(r["status"] == "finished" and r["final_val_loss"] is not None for r in result.summary.to_dict()["runs"])
    assert (spec.out / "logs" / "merit-b4-lr0.01.log").is_file()
    for run in plan_compare(spec).runs:
        assert run_state(run) == "finished"


def test_other_settings_in_the_same_folder_are_refused(finished, model_cfg, data_dir):
    spec, _, _ = finished
    result = CliRunner().invoke(
        cli,
        [
            "compare",
            "--model",
            str(model_cfg),
            "--data",
            str(data_dir),
            "--seq-len",
            "32",
            "--out",
            str(spec.out),
            "--optimizers",
            "adamw",
            "--batch-sizes",
            "2",
            "--lrs",
            "1e-3",
            "--tokens",
            "1024",
            *[a for k, v in TRAIN.items() for a in ("--set", f"{k}={v}")],
        ],
    )
    assert result.exit_code == 2
    assert "holds a run with other settings (steps: 8 != 16)" in result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--optimizers", "adamw,sgdx"], "unknown optimizer 'sgdx'"),
        (["--optimizers", ""], "no optimizers to compare"),
        (["--lrs", ""], "--lrs is empty"),
        (["--lrs", "1e-3,fast"], "'fast' is not a number"),
        (["--lrs", "-1e-3"], "learning rates must be positive"),
        (["--batch-sizes", ""], "--batch-sizes is empty"),
        (["--batch-sizes", "8,big"], "'big' is not an integer"),
        (["--batch-sizes", "0,8"], "must be a positive integer"),
        (["--tokens", "0"], "tokens must be a positive integer"),
        (["--jobs", "0"], "jobs must be a positive integer"),
        (["--model", "gpt9-huge"], "unknown model 'gpt9-huge'"),
        (["--seq-len", "4096"], "beyond the context"),
        (["--set", "lr=1e-3"], "'lr' is set by the comparison"),
        (["--set", "warmup_ration=0.1"], "unknown config key 'warmup_ration'"),
        (["--seeds", "0"], "seeds must be a positive integer"),
        (["--preset", "ablations", "--optimizers", "adamw"], "give either the preset or --optimizers"),
        (["--include-path", "tasks"], "--include-path and --eval-limit need --eval TASKS"),
        (["--eval", ","], "--eval is empty"),
        (["--max-extensions", "-1"], "max_extensions must be 0 or a positive integer"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, expected):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(cli, ["compare", "--out", str(out), *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not out.exists()


def test_bad_compare_toml(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('optimizers = ["merit"]\nbatch_size = 8\n')
    result = CliRunner().invoke(cli, ["compare", str(config), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "unknown compare key 'batch_size'" in result.stderr
    assert "put it under [train]" in result.stderr
    config.write_text("lrs = {merit = []}\n")
    result = CliRunner().invoke(cli, ["compare", str(config), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "lrs for merit is empty" in result.stderr
