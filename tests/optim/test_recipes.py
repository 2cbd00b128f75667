"""CONTRIBUTING.md's "add an optimizer" recipe, followed once: a toy optimizer registered with one spec
works through build_optimizer, compare's lr grid, the fsdp check, the loop's step hook and `merit train`."""

import dataclasses
import json
import tomllib

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from merit_core.errors import ConfigError
from merit_core.optim.builders import construct, decay_groups
from merit_core.optim.registry import (
    OptimizerSpec,
    StepHook,
    build_optimizer,
    default_hparams,
    optimizer_names,
    register_optimizer,
    unregister_optimizer,
)


def _build_toy(name, model_or_params, hp):
    """The builder the recipe asks for: decay groups from the registry, errors as ConfigError."""
    groups = decay_groups(model_or_params, hp)
    return construct(name, torch.optim.SGD, groups, **hp)


@pytest.fixture
def toy():
    """Register 'toy' (SGD with momentum) for one test; its hook records the updates it ran after."""
    calls = []

    def hook(ctx):
        logits = ctx.logits()  # the step's first micro-batch through the training forward
        calls.append((ctx.step, tuple(logits.shape[:2]), ctx.world_size))

    spec = register_optimizer(
        OptimizerSpec(
            name="toy",
            summary="SGD with momentum (a test of the add-an-optimizer recipe)",
            builder=_build_toy,
            defaults=dict(
                lr=0.05, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, decay_embeddings=True
            ),
            lr_centre={"small": 0.1, "gpt2": 0.01},
            fsdp_refused="the toy optimizer was never checked on DTensor shards",
            step_hook=StepHook(interval=lambda opt: 2, run=hook),
        )
    )
    yield spec, calls
    unregister_optimizer("toy")
    assert "toy" not in optimizer_names()


def test_toy_builds_and_its_hyperparameters_are_checked(toy):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer("TOY", model, momentum=0.5, weight_decay=0.1)
    assert isinstance(opt, torch.optim.SGD)
    decay, no_decay = opt.param_groups
    assert (decay["lr"], decay["momentum"], decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.5, 0.1, 0.0)
    assert "toy" in optimizer_names() and default_hparams("toy")["dampening"] == 0.0
    # 'dampening' is a name no built-in optimizer has: its kind comes from its default, so a bad
    # value is one ConfigError line, not a KeyError
    with pytest.raises(ConfigError, match="'dampening' must be a number, got 'x'"):
        build_optimizer("toy", model, dampening="x")
    with pytest.raises(ConfigError, match="unknown hyperparameter 'momentun'.*did you mean 'momentum'"):
        build_optimizer("toy", model, momentun=0.5)
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer(toy[0])


def test_inconsistent_specs_fail_when_defined():
    common = dict(name="bad", summary="-", builder=_build_toy, lr_centre={"small": 0.1, "gpt2": 0.01})
    with pytest.raises(ValueError, match="'clip' .* needs its kind"):
        OptimizerSpec(**common, defaults=dict(lr=0.1, clip=None))
    assert (
        OptimizerSpec(**common, defaults=dict(lr=0.1, clip=None), kinds={"clip": float | None}).kinds["clip"]
        == float | None
    )
    with pytest.raises(ValueError, match="kinds given for unknown"):
        OptimizerSpec(**common, defaults=dict(lr=0.1), kinds={"lrr": float})
    with pytest.raises(ValueError, match="the default of 'lr'"):
        OptimizerSpec(**common, defaults=dict(lr="big"))
    no_centre = {k: v for k, v in common.items() if k != "lr_centre"}
    with pytest.raises(ValueError, match="exactly one of lr_centre"):
        OptimizerSpec(**no_centre, defaults=dict(lr=0.1))  # a new optimizer never silently gets a default lr
    with pytest.raises(ValueError, match="lr_family 'nope'"):
        register_optimizer(OptimizerSpec(**no_centre, defaults=dict(lr=0.1), lr_family="nope"))
    for centre in ({"small": 0.1}, {"small": 0.1, "gpt2": 0.0}, {"small": 0.1, "gpt2": 0.01, "large": 1e-3}):
        with pytest.raises(ValueError, match="lr_centre must give a positive lr for 'small' and for 'gpt2'"):
            OptimizerSpec(**{**common, "lr_centre": centre}, defaults=dict(lr=0.1))
    with pytest.raises(ValueError, match="lower case"):
        OptimizerSpec(**{**common, "name": "Bad_Name"}, defaults=dict(lr=0.1))
    assert "bad" not in optimizer_names()


def test_compare_grids_the_toy_around_its_centre(toy):
    from merit_core.compare.grid import AUTO_FACTORS, plan_runs, round_lr
    from merit_core.compare.spec import load_spec

    runs = plan_runs(load_spec(None, optimizers="toy", batch_sizes="8,32", tokens=8192))
    grids = {r.batch_size: r.grid for r in runs}
    assert grids[8] == tuple(sorted(round_lr(0.1 * f) for f in AUTO_FACTORS))  # gpt2-tiny is a small model
    assert grids[32] == tuple(sorted(round_lr(0.2 * f) for f in AUTO_FACTORS))  # x sqrt(32 / 8)
    assert {r.config.optimizer for r in runs} == {"toy"}


def test_fsdp_refuses_the_toy_with_its_reason(toy, tmp_path, monkeypatch):
    from merit_cli.main import cli
    from merit_core.train.fsdp import check_fsdp_optimizer

    with pytest.raises(ConfigError, match="'toy' does not support --parallel fsdp: the toy optimizer was never"):
        check_fsdp_optimizer("toy")
    check_fsdp_optimizer("merit")  # supported: no error
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["train", "--parallel", "fsdp", "--optimizer", "toy", "--out", "run"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output + result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unmeasured_optimizer_takes_its_registry_default_lr(toy):
    from merit_core.train.config import TrainConfig, resolve

    resolved = resolve(TrainConfig(optimizer="toy"))
    assert resolved.config.lr == resolved.lr.lr == 0.05
    assert resolved.lr.source == "toy's registry default (no measured lr for it)"  # what the start line prints


def test_measured_lrs_are_the_default_for_their_model_and_batch(toy):
    from merit_core.optim.registry import MeasuredLr, register_optimizer
    from merit_core.train.config import TrainConfig, resolve

    spec, _ = toy
    measured = dataclasses.replace(
        spec, lr_centre=None, measured_lrs=(MeasuredLr("gpt2-tiny", 16, 128, 0.2, "a test table"),)
    )
    register_optimizer(measured, replace=True)
    assert resolve(TrainConfig(optimizer="toy")).config.lr == 0.2
    assert resolve(TrainConfig(optimizer="toy", batch_size=64)).config.lr == pytest.approx(0.4)
    given = resolve(TrainConfig(optimizer="toy", lr=0.01))
    assert given.config.lr == 0.01 and given.lr is None


def _train(cli, optimizer, model_cfg, data_dir, out, steps, sets):
    """`merit train` through the CLI with --set KEY=VALUE for each of `sets`; asserts it succeeded."""
    args = ["train", "--optimizer", optimizer, "--model", str(model_cfg), "--data", str(data_dir), "--out", str(out)]
    args += ["--steps", str(steps), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + result.stderr
    return result


def test_merit_train_with_the_toy_runs_its_hook(toy, model_cfg, data_dir, tmp_path):
    from merit_cli.main import cli
    from merit_core.metrics import read_metrics

    _, calls = toy
    out = tmp_path / "run"
    sets = {"batch_size": 8, "micro_batch_size": 4, "seq_len": 16, "log_every": 1, "eval_batches": 1}
    result = _train(cli, "toy", model_cfg, data_dir, out, 2, sets)
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses)
    assert calls == [(1, (4, 16), 1)]  # after update index 1 (= every - 1), on the first micro-batch
    state = json.loads((out / "step_2" / "trainer_state.json").read_text())
    config = tomllib.loads((out / "config.toml").read_text())
    assert state["optimizer"] == config["optimizer"] == "toy"
    assert config["lr"] == 0.05  # an optimizer without measured lrs: the spec's default
    assert "lr 0.05 (toy's registry default (no measured lr for it))" in " ".join(result.output.split())


def test_the_start_line_says_an_extrapolated_lr_and_its_cap(model_cfg, data_dir, tmp_path):
    """A 32-wide model has no lr entry (nearest: gpt2-tiny's), and batch 2048 x 16 is 16x the batch-16
    entry's tokens: 2.83e-2 x 4 = 0.113, capped at MERIT's largest stable gpt2-tiny lr, 0.0283."""
    from merit_cli.main import cli

    out = tmp_path / "run"
    sets = {"batch_size": 2048, "micro_batch_size": 512, "seq_len": 16, "eval_batches": 1, "eval_batch_size": 2}
    result = _train(cli, "merit", model_cfg, data_dir, out, 1, sets)
    line = " ".join(result.output.split())
    # the start line's short account (merit_cli.train_cmd.lr_source): the entry it scaled and the cap
    assert "lr 0.0283 (extrapolated from the lr measured for gpt2-tiny at batch 16 x 128, 0.0283, " in line
    assert "capped at 0.0283, the largest lr trained stably on gpt2-tiny; run: results/compare-cpu)" in line
    assert tomllib.loads((out / "config.toml").read_text())["lr"] == 0.0283
