"""The estimate before step 1 (merit_core.train.estimate): one line above about an hour on a CPU with a
config that fits, a confirmation asked through the callbacks, and a timing that leaves the run as it was."""

from __future__ import annotations

import pytest
import torch

from merit_core.errors import RunInterrupted
from merit_core.train import estimate
from merit_core.train.callbacks import TrainCallbacks
from tests.cli.test_run_safety import TINY


def test_the_long_run_line_names_a_config_that_fits_an_hour():
    slow = estimate.Estimate(seconds_per_step=170.0, steps=300)  # gpt2-small's step on a 2-core CPU
    line = estimate.long_run_line(slow, "gpt2-small", estimate.tiny_of("gpt2-small"))
    assert line == (
        "estimate: about 14.2 h for 300 steps of gpt2-small on this CPU (3 min a step, from a timed first "
        "micro-batch); within an hour: --model gpt2-tiny, or --steps 21"
    )
    assert estimate.long_run_line(estimate.Estimate(1.0, 3600), "gpt2-small", "gpt2-tiny") is None  # an hour: quiet
    assert estimate.tiny_of("llama-130m") == "llama-tiny" and estimate.tiny_of("my/config.json") == "gpt2-tiny"
    tiny = estimate.long_run_line(estimate.Estimate(4000.0, 2), "gpt2-tiny", "gpt2-tiny")
    assert tiny is not None and tiny.endswith("within an hour: a smaller --batch-size or --seq-len")


def _values(model_cfg, data_dir, out) -> dict:
    return {**TINY, "eval_batch_size": 2, "model": str(model_cfg), "data": str(data_dir), "steps": 3, "out": str(out)}


def test_a_long_run_says_so_and_asks_and_the_timing_leaves_the_run_alone(model_cfg, data_dir, tmp_path, monkeypatch):
    from merit_core.train import training_run
    from merit_core.train.config import load_config

    timed = []
    real = training_run.time_first_micro_batch

    def checked(trainer):
        before = torch.get_rng_state()
        result = real(trainer)
        assert torch.equal(before, torch.get_rng_state())  # the run draws what it would have drawn
        assert all(p.grad is None for p in trainer.model.parameters())
        timed.append(result)
        return result

    monkeypatch.setattr(training_run, "time_first_micro_batch", checked)
    monkeypatch.setattr(estimate, "LONG_SECONDS", 0.0)  # every run is "long" here

    class Declines(TrainCallbacks):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def on_note(self, message: str) -> None:
            self.notes.append(message)

        def confirm(self, message: str) -> bool:
            self.asked = message
            return False

    declines = Declines()
    with pytest.raises(RunInterrupted, match=r"^not started: estimate: about .* for 3 steps .*nothing was trained$"):
        training_run.run_training(load_config(values=_values(model_cfg, data_dir, tmp_path / "a")), declines)
    assert declines.notes[0] == declines.asked and "--model gpt2-tiny" in declines.asked
    (first,) = timed
    assert first.steps == 3 and first.seconds_per_step > 0
    # the default callbacks (a library caller, a run off a terminal) go on
    training_run.run_training(load_config(values=_values(model_cfg, data_dir, tmp_path / "b")), TrainCallbacks())
    assert (tmp_path / "b" / "step_3").is_dir()
