"""`merit train --watch` end to end on a tiny GPT-2: a planted divergence (the lr raised mid-run,
growing 30% a step) is warned before the loss meets the divergence rule
(merit_core.instability_rules.divergence_step); a healthy run gives no warning; `--on-instability stop`
stops without saving the warned weights, naming a checkpoint from before the warning; `rewind`
goes back to it, halves the lr and finishes, through the resume's verified restore (a checkpoint
altered since it was written is refused)."""

import math
import tomllib

import pytest

from merit_core.checkpoint import runs
from merit_core.instability_rules import divergence_step
from merit_core.metric_names import WATCH_REWIND, WATCH_WARNINGS
from merit_core.metrics import read_metrics
from tests.cli_runs import invoke, train_args
from tests.train.planted_lr import raised_lr_for

LR, PLANT_AT, STEPS, GROWTH = 3e-3, 8, 44, 1.3
SETTINGS = dict(
    batch_size=8,
    micro_batch_size=8,
    seq_len=32,
    lr=LR,
    warmup_steps=2,
    eval_every=0,
    save_every=4,
    log_every=1,
    eval_batches=1,
    eval_batch_size=4,
    watch_every=2,  # the run is short: a probe every 2 steps (the default cadence is merit_core.settings')
)


@pytest.fixture
def planted(monkeypatch):
    """From update PLANT_AT on, the lr of a run whose configured lr is LR grows 25% a step (a run
    whose lr was lowered by a rewind is left alone)."""
    from merit_core.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "lr_for", raised_lr_for(Trainer.lr_for, LR, PLANT_AT, GROWTH))


def _train(model_cfg, data_dir, out, *extra):
    return invoke(
        train_args(model_cfg, data_dir, out, "--steps", str(STEPS), "--optimizer", "adamw", *extra, settings=SETTINGS)
    )


def _warnings(out) -> list[dict]:
    return [w for r in read_metrics(out) for w in r.get(WATCH_WARNINGS) or ()]


def _losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"] if r["loss"] is not None else math.nan) for r in read_metrics(out) if "loss" in r]


def test_a_planted_divergence_is_warned_before_the_loss_diverges(model_cfg, data_dir, tmp_path, planted):
    out = tmp_path / "run"
    result = _train(model_cfg, data_dir, out, "--on-instability", "warn")
    diverged = divergence_step(_losses(out))
    warned = _warnings(out)
    assert diverged is not None, "the planted lr did not make the run diverge"
    assert warned, "no warning"
    assert PLANT_AT < warned[0]["step"] < diverged
    assert f"instability warning at step {warned[0]['step']}: {warned[0]['signal']}" in result.output


def test_a_healthy_run_gives_no_warning(model_cfg, data_dir, tmp_path):
    out = tmp_path / "run"
    result = _train(model_cfg, data_dir, out)
    assert result.exit_code == 0
    assert divergence_step(_losses(out)) is None
    assert _warnings(out) == [] and "instability warning" not in result.output
    watched = [r["step"] for r in read_metrics(out) if "watch_loss" in r]
    assert watched == list(range(2, STEPS + 1, 2))  # the cadence set above: every 2 steps


LATE_STEPS, LATE_AT, LATE_GROWTH = 200, 100, 1.1
LATE = dict(SETTINGS, warmup_steps=10, save_every=0)


def test_a_late_planted_divergence_is_warned_twenty_steps_ahead(model_cfg, data_dir, tmp_path, monkeypatch):
    """The lr raised from update 100 on (10% a step) makes the loss diverge 40 or more steps later;
    the watcher warns 20 or more steps before it, and after the raise."""
    from merit_core.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "lr_for", raised_lr_for(Trainer.lr_for, LR, LATE_AT, LATE_GROWTH))
    out = tmp_path / "run"
    args = train_args(model_cfg, data_dir, out, "--steps", str(LATE_STEPS), "--optimizer", "adamw", settings=LATE)
    result = invoke(args)  # the default, --on-instability record: the warnings go to metrics.jsonl only
    diverged = divergence_step(_losses(out))
    assert diverged is not None and diverged - LATE_AT >= 40, diverged
    warned = _warnings(out)
    assert warned, "no warning"
    assert LATE_AT < warned[0]["step"] <= diverged - 20, (warned[0], diverged)
    assert result.exit_code == 0 and "instability warning" not in result.output


def test_a_healthy_run_as_long_is_silent(model_cfg, data_dir, tmp_path):
    out = tmp_path / "run"
    result = invoke(
        train_args(model_cfg, data_dir, out, "--steps", str(LATE_STEPS), "--optimizer", "adamw", settings=LATE)
    )
    assert result.exit_code == 0
    assert divergence_step(_losses(out)) is None
    assert _warnings(out) == [] and "instability warning" not in result.output


def test_stop_leaves_the_checkpoint_from_before_the_warning(model_cfg, data_dir, tmp_path, planted):
    out = tmp_path / "run"
    result = _train(model_cfg, data_dir, out, "--on-instability", "stop")
    assert result.exit_code == 2
    warned = _warnings(out)[0]["step"]
    saved = [s for s, _ in runs.checkpoints(out)]
    assert saved and max(saved) < warned  # the warned weights were not saved
    line = result.stderr.strip().splitlines()[-1]
    assert f"step_{max(saved)}" in line and f"--lr {LR / 2:g}" in line and "stopped" in line


def test_rewind_continues_from_that_checkpoint_with_half_the_lr(model_cfg, data_dir, tmp_path, planted):
    out = tmp_path / "run"
    result = _train(model_cfg, data_dir, out, "--on-instability", "rewind")
    assert result.exit_code == 0, result.output
    records = read_metrics(out)
    rewinds = [r[WATCH_REWIND] for r in records if WATCH_REWIND in r]
    rewind = rewinds[0]
    assert rewind["to_step"] < rewind["from_step"] and (rewind["lr_before"], rewind["lr_after"]) == (LR, LR / 2)
    assert f"rewound to {out / runs.step_name(rewind['to_step'])}" in result.output
    assert f"lr lowered {LR:g} -> {LR / 2:g}" in result.output
    # a later warning may rewind again (each time halving): config.toml has the last lr, for --resume
    assert [r["lr_after"] for r in rewinds] == [LR / 2 ** (i + 1) for i in range(len(rewinds))]
    config = tomllib.loads((out / "config.toml").read_text())
    assert config["lr"] == rewinds[-1]["lr_after"]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # the abandoned steps were dropped from metrics.jsonl
    assert max(s for s, _ in runs.checkpoints(out)) == STEPS


def test_rewind_verifies_the_checkpoint_as_resume_does(model_cfg, data_dir, tmp_path, planted, monkeypatch):
    """A rewind goes through the resume's restore: a checkpoint whose weights changed after it was
    written (one byte of a tensor, so the file still loads) is refused by its recorded checksum, in
    one line, rather than trained on."""
    from merit_core.train import run_folder

    write = run_folder.save_checkpoint

    def altered(*args, **kwargs):
        path = write(*args, **kwargs)
        weights = path / runs.WEIGHTS_NAME
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1  # the last byte of the last tensor's data
        weights.write_bytes(bytes(data))
        return path

    monkeypatch.setattr(run_folder, "save_checkpoint", altered)
    out = tmp_path / "run"
    result = _train(model_cfg, data_dir, out, "--on-instability", "rewind")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "differs from the checksum its checkpoint recorded" in lines[0], lines
    assert not any(WATCH_REWIND in r for r in read_metrics(out))
