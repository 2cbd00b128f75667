"""`merit train` for batch systems and trackers: plain log lines off a terminal, TensorBoard events
read back, missing tracker packages, and a checkpoint tokenizer that transformers 4.5x can load."""

import json

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.errors import ConfigError, MissingDependencyError
from merit_core.train.config import parse_report_to
from merit_core.train.trackers import TENSORBOARD_DIR, build_trackers, scalars

SETS = dict(
    batch_size=8, seq_len=32, lr=3e-3, log_every=1, eval_every=2, save_every=4, eval_batches=1, eval_batch_size=4
)


@pytest.fixture(scope="module")
def tracked_run(model_cfg, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    args = ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(out), "--steps", "4"]
    result = CliRunner().invoke(cli, [*args, *sets, "--report-to", "tensorboard"])  # CliRunner: not a TTY
    assert result.exit_code == 0, result.output
    return out, result.output


def test_plain_lines_per_log_step_and_eval_when_not_a_terminal(tracked_run):
    _, output = tracked_run
    lines = output.splitlines()
    train = [line for line in lines if line.startswith("train step=")]
    evals = [line for line in lines if line.startswith("eval step=")]
    assert [line.split()[1] for line in train] == ["step=1/4", "step=2/4", "step=3/4", "step=4/4"]
    for line in train:
        fields = dict(f.split("=", 1) for f in line.split()[1:])
        assert set(fields) >= {"step", "loss", "lr", "tokens_per_s"}
        float(fields["loss"]), float(fields["lr"]), float(fields["tokens_per_s"])
    assert [line.split()[1] for line in evals] == ["step=0", "step=2", "step=4"]
    assert all("val_loss=" in line and "max_logit=" in line for line in evals)
    assert "checkpoint step=4" in output
    assert "━" not in output  # no progress bar in a log file


def test_tensorboard_events_read_back(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = tracked_run
    events = EventAccumulator(str(out / TENSORBOARD_DIR))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/val_loss", "eval/max_attention_logit"} <= tags
    assert {"eval/max_attention_logit/layer_0", "eval/max_attention_logit/layer_1"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/val_loss")] == [0, 2, 4]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [m["loss"] for m in metrics if "loss" in m]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)
    last_eval = [m for m in metrics if "val_loss" in m][-1]
    assert events.Scalars("eval/max_attention_logit")[-1].value == pytest.approx(max(last_eval["max_attention_logit"]))


def test_checkpoint_tokenizer_declares_a_class_transformers_4_knows(tracked_run):
    from transformers import AutoTokenizer

    out, _ = tracked_run
    config = json.loads((out / "step_4" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # not transformers 5's TokenizersBackend
    tok = AutoTokenizer.from_pretrained(str(out / "step_4"))
    assert tok.decode(tok("the cat sees the moon")["input_ids"]) == "the cat sees the moon"


def test_report_to_parsing():
    assert parse_report_to("none") == [] and parse_report_to(None) == [] and parse_report_to("") == []
    assert parse_report_to(" TensorBoard, wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="unknown tracker 'comet'"):
        parse_report_to("tensorboard,comet")
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        parse_report_to("none,wandb")


def test_scalars_split_train_and_eval_records():
    assert scalars({"step": 3, "tokens": 9, "loss": 2.0, "lr": 0.1}) == {"train/loss": 2.0, "train/lr": 0.1}
    assert scalars({"step": 4, "val_loss": 1.5, "max_attention_logit": [2.0, None, 5.0]}) == {
        "eval/val_loss": 1.5,
        "eval/max_attention_logit": 5.0,
        "eval/max_attention_logit/layer_0": 2.0,
        "eval/max_attention_logit/layer_2": 5.0,
    }


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_missing_tracker_package_is_one_line(name, monkeypatch):
    import merit_core.train.trackers as trackers

    monkeypatch.setattr(trackers, "is_installed", lambda module: module != name)
    monkeypatch.setattr("merit_core.extras.is_installed", lambda module: module != name)
    with pytest.raises(MissingDependencyError) as exc:
        build_trackers(f"{name}")
    assert str(exc.value) == f"--report-to {name} needs the {name} package: pip install {name}"


def test_missing_tracker_fails_before_any_file_is_written(model_cfg, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("merit_core.extras.is_installed", lambda module: module != "wandb")
    monkeypatch.setattr("merit_core.train.trackers.is_installed", lambda module: module != "wandb")
    out = tmp_path / "run"
    args = ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(out), "--steps", "1"]
    result = CliRunner().invoke(cli, [*args, "--report-to", "wandb"])
    assert result.exit_code == 2
    assert "pip install wandb" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_report_to_is_a_config_key():
    from merit_core.train.config import load_config

    assert load_config(None, ["report_to=tensorboard"]).report_to == "tensorboard"
    with pytest.raises(ConfigError, match="unknown tracker"):
        load_config(None, ["report_to=neptune"])
