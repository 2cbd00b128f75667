"""CONTRIBUTING.md's "add a training metric" recipe, followed once: a value returned by
`Trainer.evaluate` reaches metrics.jsonl at every eval step of `merit train`."""

import math

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.metrics import read_metrics
from merit_core.train.trainer import Trainer


def _weight_norm(model: torch.nn.Module) -> float:
    """The toy metric: the global l2 norm of the trainable weights (a tied head counted once)."""
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()))


@pytest.fixture
def weight_norm_metric(monkeypatch):
    """The recipe's one edit, a new key in what Trainer.evaluate returns, for one test."""
    evaluate = Trainer.evaluate

    def with_weight_norm(self):
        return {**evaluate(self), "weight_norm": _weight_norm(self.model)}

    monkeypatch.setattr(Trainer, "evaluate", with_weight_norm)


def test_new_eval_metric_lands_in_metrics_jsonl(weight_norm_metric, model_cfg, data_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    sets = {"batch_size": 8, "micro_batch_size": 4, "seq_len": 16, "eval_every": 1, "eval_batches": 1, "lr": 1e-2}
    args = ["train", "--optimizer", "adamw", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(out)]
    args += ["--steps", "2", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + result.stderr

    evals = [r for r in read_metrics(out) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all("weight_norm" in r for r in evals)
    assert evals[0]["weight_norm"] != evals[-1]["weight_norm"]  # measured each time, not a constant
    # the last eval ran on the weights the final checkpoint holds
    final = AutoModelForCausalLM.from_pretrained(out / "step_2")
    assert evals[-1]["weight_norm"] == pytest.approx(_weight_norm(final), rel=1e-6)
