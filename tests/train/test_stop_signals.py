"""Stop signals in a training run: one ignored at start (`nohup`'s SIGHUP) stays ignored, a second stop
signal aborts at once, and a stop that arrives between micro-batches abandons the step under way
instead of finishing a long accumulation first. In process, on the tiny config of test_run_safety."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from merit_core.checkpoint import runs
from merit_core.errors import RunInterrupted
from merit_core.metrics import read_metrics
from merit_core.train.callbacks import TrainCallbacks
from tests.cli.test_run_safety import TINY


def _values(model_cfg: Path, data_dir: Path, out: Path, steps: int) -> dict:
    return {
        **TINY,
        "eval_batch_size": 2,
        "model": str(model_cfg),
        "data": str(data_dir),
        "steps": steps,
        "out": str(out),
    }


def _run(values: dict, callbacks: TrainCallbacks) -> None:
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    run_training(load_config(values=values), callbacks)


def test_an_ignored_sighup_stays_ignored_and_the_run_survives_a_hang_up(model_cfg, data_dir, tmp_path):
    class HangUpAtStep2(TrainCallbacks):
        def on_log(self, record: dict) -> None:
            if record["step"] == 2:
                os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing happens

    out = tmp_path / "run"
    started_with = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what `nohup` starts a program with
    try:
        _run(_values(model_cfg, data_dir, out, 5), HangUpAtStep2())
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, started_with)
    assert max(r["step"] for r in read_metrics(out) if "loss" in r) == 5  # trained to the end
    assert max(step for step, _ in runs.checkpoints(out)) == 5


def test_a_second_sigterm_aborts_within_a_second_saying_the_step_is_lost(model_cfg, data_dir, tmp_path):
    """The second SIGTERM arrives while the run is still busy after the first (here: in the log callback of
    step 2, before the loop gets to stop): it raises at once instead of waiting for a checkpoint."""
    sent: dict[str, float] = {}

    class TwoTermsAtStep2(TrainCallbacks):
        def on_log(self, record: dict) -> None:
            if record["step"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                sent["second"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # a long piece of work the abort must cut short
                pytest.fail("the second SIGTERM did not abort")

    out = tmp_path / "run"
    with pytest.raises(RunInterrupted) as aborted:
        _run(_values(model_cfg, data_dir, out, 8), TwoTermsAtStep2())
    assert time.monotonic() - sent["second"] < 1.0
    message = str(aborted.value)
    assert aborted.value.exit_code == 143
    assert message.startswith("aborted by a second stop signal (SIGTERM) during step 3: that step's work is lost")
    assert "\n" not in message
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are restored


def test_a_stop_between_micro_batches_abandons_the_step(model_cfg, data_dir, tmp_path, monkeypatch):
    """TINY accumulates 2 micro-batches a step; SIGTERM arrives after step 3's first micro-batch is handed
    over: the run stops with step 2's checkpoint, step 3 never updates the weights nor the metrics."""
    from merit_core.train import trainer as trainer_module

    real = trainer_module.prefetched
    handed = {"n": 0}

    def prefetched(micro_batches, device):
        for item in real(micro_batches, device):
            handed["n"] += 1
            if handed["n"] == 2 * 2 + 1:  # step 3's first micro-batch
                os.kill(os.getpid(), signal.SIGTERM)
            yield item

    real_loss = trainer_module.Trainer._loss
    computed = {"n": 0}

    def counted_loss(self, *args, **kwargs):
        computed["n"] += 1
        return real_loss(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "prefetched", prefetched)
    monkeypatch.setattr(trainer_module.Trainer, "_loss", counted_loss)
    out = tmp_path / "run"
    with pytest.raises(RunInterrupted) as stopped:
        _run({**_values(model_cfg, data_dir, out, 8), "eval_every": 0}, TrainCallbacks())  # no eval's loss
    assert "stopped by SIGTERM after step 2" in str(stopped.value)
    assert stopped.value.checkpoint == out / "step_2"
    assert max(r["step"] for r in read_metrics(out) if "loss" in r) == 2
    # the run's duration estimate times one micro-batch before step 1 (merit_core.train.estimate); then
    # steps 1-2 and step 3's first micro-batch: step 3's second was handed over but never computed
    assert computed["n"] == 1 + 2 * 2 + 1
