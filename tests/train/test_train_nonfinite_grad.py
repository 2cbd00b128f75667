"""The training loop's response to a non-finite gradient with a finite loss: MERIT turns the
poisoned parameters NaN (merit_core/optim/merit/common.py, NONFINITE_RULE), the trainer's finite
check on the gradient norm stops the run at that step, says so in one line and keeps the last
good checkpoint."""

import torch

from merit_core.checkpoint import runs
from merit_core.metrics import read_metrics
from tests.cli_runs import invoke, train_args


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient backward: a finite loss with non-finite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_nonfinite_gradient_stops_the_run_at_that_step(model_cfg, data_dir, tmp_path, monkeypatch):
    from merit_core.train.trainer import Trainer

    original = Trainer._loss

    def poisoned(self, module, x, y, scale):
        loss = original(self, module, x, y, scale)
        return _NanGrad.apply(loss) if module.training and self.step >= 2 else loss

    monkeypatch.setattr(Trainer, "_loss", poisoned)
    out = tmp_path / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "6", "--optimizer", "merit"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "non-finite at step 3" in lines[0] and str(out / "step_2") in lines[0]
    assert [s for s, _ in runs.checkpoints(out)] == [2]  # the NaN weights never became a checkpoint
    last = read_metrics(out)[-1]
    assert last["step"] == 3 and last["loss"] is not None  # the loss was finite, the gradient was not
