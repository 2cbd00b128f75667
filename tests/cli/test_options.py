"""Shared options and spellings: numeric metavars, one --device, train's --dtype, eval's -o and lm-eval's flags."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.evaluation.results import CheckpointResult, output_file

ROOT = Path(__file__).resolve().parents[2]


def _help(command: str) -> str:
    result = CliRunner().invoke(cli, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def test_numeric_options_show_their_kind_not_text():
    train = _help("train")
    for option, metavar in (
        ("--lr", "FLOAT"),
        ("--steps", "INTEGER"),
        ("--batch-size", "INTEGER"),
        ("--save-every-minutes", "FLOAT"),
        ("--micro-batch-size", "INTEGER|auto"),
        ("--device", "DEVICE"),
        ("--dtype", "DTYPE"),
    ):
        assert f"{option} {metavar}" in train
    assert "--lr TEXT" not in train and "--steps TEXT" not in train
    assert "--device DEVICE" in _help("inspect") and "cuda:N" in _help("inspect")
    assert "--batch-size INTEGER|auto" in _help("eval")


@pytest.mark.parametrize("command", ["train", "eval", "inspect"])
def test_one_device_option_everywhere(command, tmp_path):
    """The same words and the same one-line refusal in every command (before any work starts)."""
    args = [command, "--device", "tpu"] + ([str(tmp_path)] if command != "train" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "--device tpu: use auto, cpu, cuda or cuda:N" in result.output


def test_inspect_accepts_cuda_n():
    """`inspect --device cuda:N` parses as in train and eval; without a GPU it is refused by name."""
    from merit_cli.options import device_callback
    from merit_core.devices import resolve_device

    assert device_callback(None, None, "CUDA:1") == "cuda:1"
    if not __import__("torch").cuda.is_available():
        with pytest.raises(Exception, match="--device cuda:1: no CUDA GPU is visible"):
            resolve_device("cuda:1")


def test_train_dtype_accepts_short_names(monkeypatch):
    """--dtype bf16 / fp32 reach the config as bfloat16 / float32; fp16 is refused with the reason."""
    from merit_core.train import training_run

    seen = []
    monkeypatch.setattr(training_run, "run_training", lambda config, report: seen.append(config.dtype))
    for given, want in (("bf16", "bfloat16"), ("BFloat16", "bfloat16"), ("fp32", "float32"), ("auto", "auto")):
        result = CliRunner().invoke(cli, ["train", "--dtype", given, "--steps", "1"])
        assert result.exit_code == 0, result.output
        assert seen[-1] == want
    result = CliRunner().invoke(cli, ["train", "--dtype", "fp16"])
    assert result.exit_code == 2 and "loss scaling" in result.output


def test_inspect_missing_path_answers_before_loading_torch():
    """`merit inspect nothere.safetensors`: the one-line answer, with neither torch nor transformers imported."""
    code = (
        "import sys; from merit_cli.main import cli\n"
        "try:\n    cli(['inspect', 'nothere.safetensors'], prog_name='merit')\n"
        "except SystemExit as e:\n    print('EXIT', e.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "EXIT 2 False False", proc.stdout + proc.stderr
    assert "checkpoint not found: nothere.safetensors" in proc.stderr
    assert time.perf_counter() - start < 10  # it took 12.8 s when torch and transformers loaded first


def test_eval_output_is_a_file_name_or_a_folder(tmp_path):
    """-o results.json is that file; -o DIR (as prepare -o DIR) is a new results-<time>.json in DIR."""
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert output_file(tmp_path / "r.json", now) == tmp_path / "r.json"
    assert output_file(tmp_path, now) == tmp_path / "results-20260102T030405.json"
    assert output_file(tmp_path / "new", now) == tmp_path / "new" / "results-20260102T030405.json"
    (tmp_path / "results-20260102T030405.json").write_text("{}")  # never overwritten
    assert output_file(tmp_path, now) == tmp_path / "results-20260102T030405-2.json"


@pytest.fixture
def fake_eval(monkeypatch):
    """merit eval with the evaluation replaced: records what it was asked for, returns one empty result."""
    from merit_cli import eval_cmd

    calls = []

    def evaluate(checkpoints, settings, progress=None, quiet=True, note=None):
        calls.append((checkpoints, settings))
        return [CheckpointResult(path=checkpoints[0], label="ckpt", results={}, meta={})]

    monkeypatch.setattr(eval_cmd, "evaluate_checkpoints", evaluate)
    return calls


def test_eval_reads_lm_eval_spellings(fake_eval, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "runs" / "a" / "step_5"  # a local checkpoint must exist (a hub name need not)
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"")  # never read: the evaluation is replaced
    args = [
        "eval",
        "--model",
        "hf",
        "--model_args",
        "pretrained=runs/a/step_5,dtype=bf16",
        "--tasks",
        "wikitext",
        "--batch_size=4",
        "--num_fewshot",
        "2",
        "--bootstrap_iters",
        "0",
        "--output_path",
        str(tmp_path / "out"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    ((checkpoints, settings),) = fake_eval
    assert checkpoints == ["runs/a/step_5"] and list(settings.tasks) == ["wikitext"]
    assert (settings.dtype, settings.batch_size, settings.num_fewshot, settings.bootstrap_iters) == ("bf16", "4", 2, 0)
    # --output_path DIR, as lm-eval takes it: merit's results file in DIR, and lm-eval's own DIR/<model>/results_*.json
    (written,) = (tmp_path / "out").glob("results-*.json")
    (lm_eval_file,) = (tmp_path / "out" / "runs__a__step_5").glob("results_*.json")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([written.name, "runs__a__step_5"])


@pytest.mark.parametrize(
    ("args", "equivalent"),
    [
        (["--model", "vllm"], "lm-eval's --model hf"),
        (["--model_args", "pretrained=x,trust_remote_code=True"], "only when given --trust-remote-code"),
        (["--model_args", "pretrained=x,revision=main"], "pretrained=CKPT as the CKPT argument"),
    ],
)
def test_eval_refuses_lm_eval_flags_it_lacks_in_one_line(fake_eval, args, equivalent):
    result = CliRunner().invoke(cli, ["eval", *args, "--tasks", "wikitext"])
    assert result.exit_code == 2 and not fake_eval
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and equivalent in lines[0]
