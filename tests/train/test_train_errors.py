"""Bad input to `merit train`: one clear line, exit code 2, and nothing written."""

import json

import pytest
from click.testing import CliRunner

from merit_cli.main import cli

DATA_SENTENCES = 600  # the data_dir fixture's corpus (tests/conftest.py)


@pytest.fixture
def empty_data(tmp_path, data_dir):
    folder = tmp_path / "empty"
    folder.mkdir()
    meta = json.loads((data_dir / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "train_tokens": 0, "val_tokens": 0}))
    (folder / "train.bin").write_bytes(b"")
    (folder / "val.bin").write_bytes(b"")
    return folder


def fails_cleanly(args, cwd, expected):
    result = CliRunner().invoke(cli, ["train", *args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output + result.stderr
    assert len(lines) == 1, lines
    assert expected in lines[0]
    assert sorted(p.name for p in cwd.iterdir()) == [], "nothing may be written"
    return lines[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "lrr=1e-3"], "unknown config key 'lrr'; did you mean 'lr'?"),
        (["--set", "optimizer_args"], "--set expects KEY=VALUE"),
        (["--model", "gpt3-tiny"], "unknown model 'gpt3-tiny'"),
        (["--optimizer", "adamx"], "unknown optimizer 'adamx'"),
        (["--batch-size", "10", "--micro-batch-size", "4"], "batch_size 10 is not divisible by micro_batch_size 4"),
        (["--model", "gpt2-tiny", "--seq-len", "512"], "seq_len 512 is beyond the context of gpt2-tiny (256 tokens)"),
        (["--resume"], "--resume needs the run folder"),
        (["--device", "tpu"], "--device tpu: use auto, cpu, cuda or cuda:N"),
        (["--lr", "fast"], "--lr must be a number, got 'fast'"),
        (["--batch-size", "1.5"], "--batch-size must be an integer, got '1.5'"),
    ],
)
def test_bad_options(args, expected, tmp_path, monkeypatch, data_dir):
    monkeypatch.chdir(tmp_path)  # the default run folder would be ./runs/...
    fails_cleanly(["--data", str(data_dir), *args], tmp_path, expected)


def test_bad_data_and_resume(tmp_path, monkeypatch, model_cfg, data_dir, empty_data):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    base = ["--model", str(model_cfg), "--seq-len", "32", "--batch-size", "4", "--steps", "2"]
    fails_cleanly([*base, "--data", str(tmp_path / "no-such-corpus.txt")], work, "no-such-corpus.txt")
    fails_cleanly([*base, "--data", str(empty_data)], work, "tokens")
    fails_cleanly([*base, "--data", str(data_dir), "--seq-len", "100"], work, "beyond the context")
    resume = [*base, "--data", str(data_dir), "--resume", "--out", str(work / "run")]
    line = fails_cleanly(resume, work, "nothing to resume")
    assert "drop --resume" in line
    config = tmp_path / "bad.toml"
    config.write_text("optimiser = 'adamw'\n")
    fails_cleanly([str(config)], work, "unknown config key 'optimiser'; did you mean 'optimizer'?")
    fails_cleanly([str(tmp_path / "missing.toml")], work, "config file not found")


def test_existing_run_needs_resume(tmp_path, model_cfg, data_dir):
    out = tmp_path / "run"
    args = [
        "train",
        "--model",
        str(model_cfg),
        "--data",
        str(data_dir),
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--out",
        str(out),
        "--set",
        "eval_batches=1",
    ]
    assert CliRunner().invoke(cli, args).exit_code == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "already holds checkpoints; pass --resume" in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
