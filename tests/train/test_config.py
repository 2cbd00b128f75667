"""TrainConfig: TOML < --set < options, unknown keys, types, resolution, TOML round trip."""

import dataclasses
import datetime
import tomllib

import pytest

from merit_core.errors import ConfigError
from merit_core.optim.registry import default_hparams, default_lr, get_spec
from merit_core.train.config import (
    TrainConfig,
    dumps_toml,
    load_config,
    parse_override,
    resolve,
)
from merit_core.train.run_folder import save_config


def test_defaults_are_the_cpu_default_run():
    c = load_config()
    assert (c.model, c.optimizer, c.data) == ("gpt2-tiny", "merit", None)
    r = resolve(c, now=datetime.datetime(2026, 1, 2, 3, 4, 5)).config
    assert r.out == "runs/20260102-030405-gpt2-tiny-merit"
    assert r.micro_batch_size == r.batch_size and r.steps > 0 and r.min_lr == pytest.approx(r.lr * r.min_lr_ratio)


def test_lr_and_weight_decay_default_to_the_optimizer_registry():
    lion = default_hparams("lion")
    r = resolve(load_config(None, ["weight_decay=0.5", "optimizer=Lion"])).config
    assert (r.lr, r.weight_decay, r.min_lr) == (lion["lr"], 0.5, pytest.approx(lion["lr"] * 0.1))  # no measured lr
    assert r.optimizer == "lion"  # the registry name
    tuned = resolve(load_config()).config  # the default CPU run has a measured lr
    assert (tuned.lr, tuned.weight_decay) == (default_lr("merit", "gpt2-tiny", 16, 128, 128).lr, 0.01)
    assert tuned.lr == 2.83e-2
    small = resolve(load_config(None, ["model=gpt2-small", "batch_size=64", "seq_len=1024"])).config
    assert small.lr == 2e-3  # the measured GPT-2 small entry
    assert resolve(load_config(None, ["lr=1e-3"])).config.lr == 1e-3
    spec = get_spec("lion")
    settable = {k: v for k, v in spec.defaults.items() if k != "weight_decay"}
    no_decay = dataclasses.replace(spec, defaults=settable, kinds={k: spec.kinds[k] for k in settable})
    with pytest.raises(ConfigError, match="weight_decay is not set and optimizer 'lion' has no default"):
        resolve(load_config(None, ["optimizer=lion"]), spec=no_decay)
    with pytest.raises(ConfigError, match="unknown optimizer 'lino'"):
        resolve(load_config(None, ["optimizer=lino"]))
    with pytest.raises(ConfigError, match="top-level key 'lr'"):
        load_config(None, ["optimizer_args.lr=1"])


def test_resolve_returns_the_default_lr_with_the_source_the_start_line_prints():
    small = resolve(load_config(None, ["model=gpt2-small", "batch_size=64", "seq_len=1024"]))
    assert small.lr == default_lr("merit", "gpt2-small", 64, 1024, 768) and small.config.lr == small.lr.lr == 2e-3
    assert small.lr.source.startswith("merit's measured default for gpt2-small at batch 64 x 1024; run: ")
    lion = resolve(load_config(None, ["optimizer=lion", "weight_decay=0"]))
    assert lion.lr.entry is None and lion.lr.source == "lion's registry default (no measured lr for it)"
    assert lion.config.lr == lion.lr.lr == default_hparams("lion")["lr"]
    scaled = resolve(load_config(None, ["batch_size=64"]))  # 4x the gpt2-tiny entry's batch: sqrt-scaled
    assert scaled.lr.scaled and scaled.config.lr == scaled.lr.lr == pytest.approx(2 * 2.83e-2, rel=0.01)
    assert resolve(load_config(None, ["lr=1e-3"])).lr is None  # the user's lr has no source to print
    assert resolve(load_config(None, ["lr=1e-3", "optimizer=lion"])).lr is None


def test_precedence_file_then_set_then_options(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('lr = 1e-3\nbatch_size = 64\nmodel = "gpt2-small"\n[optimizer_args]\nbetas = [0.9, 0.95]\n')
    c = load_config(
        path,
        ["lr=3e-4", "optimizer_args.eps=1e-8", "model=llama-60m", "compile=true"],
        {"batch_size": 16, "seed": None},
    )
    assert c.lr == 3e-4 and c.batch_size == 16 and c.model == "llama-60m" and c.compile is True
    assert c.optimizer_args == {"betas": [0.9, 0.95], "eps": 1e-8}
    assert c.seed == 0  # None option = not given


@pytest.mark.parametrize(
    "item, expected",
    [
        ("lr=3e-4", ("lr", 3e-4)),
        ("steps=100", ("steps", 100)),
        ("model=gpt2-small", ("model", "gpt2-small")),
        ('data="a b"', ("data", "a b")),
        ("compile=false", ("compile", False)),
        ("optimizer_args.betas=[0.9, 0.99]", ("optimizer_args.betas", [0.9, 0.99])),
    ],
)
def test_override_values_are_toml_literals(item, expected):
    assert parse_override(item) == expected


@pytest.mark.parametrize(
    "items, message",
    [
        (["lrr=1e-3"], "unknown config key 'lrr'; did you mean 'lr'?"),
        (["batch_sise=8"], "did you mean 'batch_size'?"),
        (["zzz=1"], "unknown config key 'zzz'; known keys: model, optimizer"),
        (["lr.x=1"], "unknown config key 'lr.x'"),
        (["lr=fast"], "lr must be a number, got 'fast'"),
        (["steps=2.5"], "steps must be an integer"),
        (["compile=1"], "compile must be auto, true or false"),
        (["batch_size=0"], "batch_size must be positive"),
        (["batch_size=10", "micro_batch_size=4"], "batch_size 10 is not divisible by micro_batch_size 4"),
        (["dtype=fp8"], "dtype must be one of"),
        (["noequals"], "--set expects KEY=VALUE"),
    ],
)
def test_bad_overrides_name_the_problem(items, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, items)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_in_file_and_missing_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("optimiser = 'adamw'\n")
    with pytest.raises(ConfigError, match="unknown config key 'optimiser'; did you mean 'optimizer'"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("lr = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "broken.toml")


def test_resolve_steps_from_tokens_and_world_size():
    c = load_config(None, ["tokens=1000000", "batch_size=32", "seq_len=128", "warmup_ratio=0.1"])
    r = resolve(c, world_size=2).config
    assert r.steps == 245 and r.tokens is None  # ceil(1e6 / 4096)
    assert r.warmup_steps == 24 and r.micro_batch_size == 16
    with pytest.raises(ConfigError, match="not divisible by the world size 3"):
        resolve(c, world_size=3)
    with pytest.raises(ConfigError, match=r"micro_batch_size 16 x world size 4"):
        resolve(load_config(None, ["batch_size=32", "micro_batch_size=16"]), world_size=4)
    with pytest.raises(ConfigError, match="disagree"):
        resolve(load_config(None, ["tokens=1000", "steps=7"]))


def test_saved_config_round_trips(tmp_path):
    c = resolve(
        load_config(None, ["optimizer_args.betas=[0.9, 0.95]", 'out="runs/x \\"q\\""', "lr=1e-05", "resume=true"]),
    ).config
    save_config(c, tmp_path / "config.toml")
    text = (tmp_path / "config.toml").read_text()
    assert "resume" not in text and "tokens" not in text  # None values and the resume action are left out
    again = load_config(tmp_path / "config.toml")
    assert again == TrainConfig(**{**c.to_dict(), "resume": False})


def test_dumps_toml_handles_nesting_and_special_floats():
    data = {"a": 1, "b": float("inf"), "s": 'x\n"y', "t": {"u": (1, 2), "v": {"w": True, "n": None}}, "n": None}
    text = dumps_toml(data)  # tomli-w's document; None (no TOML value) is left out at every level
    assert tomllib.loads(text) == {"a": 1, "b": float("inf"), "s": 'x\n"y', "t": {"u": [1, 2], "v": {"w": True}}}
    with pytest.raises(ConfigError, match="cannot write the config as TOML"):
        dumps_toml({"when": object()})


def test_shipped_configs_are_valid():
    from pathlib import Path

    from merit_core.optim import resolve_hparams

    # compare-*.toml are `merit compare` specs, checked in tests/test_compare_units.py
    paths = sorted(
        p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.toml") if not p.stem.startswith("compare-")
    )
    assert {p.stem for p in paths} >= {
        "debug",
        "gpt2-small",
        "gpt2-medium",
        "gpt2-large",
        "llama-130m",
        "llama-350m",
        "gpt2-small-adamw-480",
    }
    for path in paths:
        c = load_config(path)
        resolve_hparams(c.optimizer, **c.optimizer_args)
        for world in (1,) if path.stem == "debug" else (1, 8):
            r = resolve(c, world_size=world).config
            assert r.batch_size % (r.micro_batch_size * world) == 0
    small = load_config(paths[[p.stem for p in paths].index("gpt2-small")])
    assert (small.batch_size, small.seq_len) == (1024, 1024)
