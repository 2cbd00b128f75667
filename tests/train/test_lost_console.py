"""`merit train` whose reader goes away: `| head` (stdout closed) and SIGHUP (the terminal or ssh
session gone) stop the run like SIGTERM: a checkpoint at the step where it stopped, one line, no
traceback; metrics.jsonl keeps every step trained."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from merit_core.checkpoint import runs
from merit_core.metrics import read_metrics
from tests.cli.test_run_safety import TINY, subprocess_env, train_args

DATA_SENTENCES = 600  # the data_dir fixture's corpus (tests/conftest.py), as test_run_safety's

ENDLESS = ("--steps", "100000", "--set", "save_every=0", "--set", "eval_every=0")


def _check_stopped(out, err: str, name: str) -> None:
    (step, _), *_ = runs.checkpoints(out)
    assert step >= 1 and f"stopped by {name}" in err and f"after step {step}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert max(r["step"] for r in read_metrics(out) if "loss" in r) == step  # the metrics went on to the end


def test_merit_train_whose_reader_leaves_checkpoints_where_it_stopped(model_cfg, data_dir, tmp_path):
    """`| sed '/^train step=2/q'`: the reader leaves after the second step's log line, as `head -n N`
    does once N lines are shown (counted by the step line, not by N: how many note lines come before the
    first step depends on the machine, e.g. the time estimate is printed only for a run over an hour;
    with `head -1` the reader leaves during the header, and the run stops the same way before its first
    step, with nothing to save)."""
    out = tmp_path / "run"
    command = shlex.join([sys.executable, "-m", "merit_cli", *train_args(model_cfg, data_dir, out, *ENDLESS)])
    err_file, code_file = tmp_path / "err.txt", tmp_path / "code.txt"
    reader = shlex.quote("/^train step=2/q")
    shell = f"{command} 2>{err_file} | sed {reader}; echo ${{PIPESTATUS[0]}} >{code_file}"
    started = time.monotonic()
    shown = subprocess.run(["bash", "-c", shell], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert shown.stdout.splitlines()[-1].startswith("train step=2/") and time.monotonic() - started < 90
    assert code_file.read_text().strip() == "141"
    _check_stopped(out, err_file.read_text(), "SIGPIPE")


def test_sighup_checkpoints_where_it_stopped(model_cfg, data_dir, tmp_path):
    """In process (the signal path is the same as SIGTERM's, which test_run_safety runs end to end)."""
    from merit_core.errors import RunInterrupted
    from merit_core.train.callbacks import TrainCallbacks
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    class HangUpAtStep3(TrainCallbacks):
        def on_log(self, record):
            if record["step"] == 3:
                os.kill(os.getpid(), signal.SIGHUP)

    out = tmp_path / "run"
    values = {**TINY, "eval_batch_size": 2, "model": str(model_cfg), "data": str(data_dir), "steps": 8, "out": str(out)}
    # a terminal's default disposition, whatever this suite was started with (under nohup: ignored, which
    # merit keeps: tests/train/test_stop_signals.py)
    started_with = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(RunInterrupted) as stopped:
            run_training(load_config(values=values), HangUpAtStep3())
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # the handler is restored
    finally:
        signal.signal(signal.SIGHUP, started_with)
    assert stopped.value.exit_code == 129 and stopped.value.checkpoint == out / "step_3"
    _check_stopped(out, str(stopped.value), "SIGHUP")
