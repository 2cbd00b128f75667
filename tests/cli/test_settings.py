"""merit_core.settings: every setting of train and compare declared once, torch-free, and the
command-line help, the checks and the resolved type all read from it."""

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest

from merit_cli.compare_cmd import compare
from merit_cli.options import setting_help
from merit_cli.train_cmd import train
from merit_core import settings
from merit_core.errors import ConfigError
from merit_core.settings import (
    COMPARE,
    COMPARE_TRAIN,
    CompareDefaults,
    ResolvedConfig,
    TrainConfig,
    option_names,
    setting_of,
    shown_default,
)

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy", "click", "rich")


def test_importing_the_settings_loads_no_torch_transformers_or_numpy():
    code = f"import sys, merit_core.settings; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name is not None}


def test_every_train_setting_has_help_and_the_train_options_are_the_declared_ones():
    for f in dataclasses.fields(TrainConfig):
        assert setting_of(TrainConfig, f.name).help, f.name
    options = _options(train)
    declared = set(option_names(TrainConfig))
    # the options that are not settings of the run: listing configs, --set, help and the start confirmation
    assert declared == set(options) - {"list_configs", "overrides", "help", "yes"}
    assert {"batch_size", "lr", "tf32", "resume"} <= declared  # the option kinds: value, value, switch, flag


def test_train_help_texts_are_the_settings_help_and_default():
    options = _options(train)
    for name in option_names(TrainConfig):
        assert options[name].help == setting_help(TrainConfig, name), name
        assert options[name].show_default is False  # the default is in the help, from the setting
    # the defaults a reader sees, against the dataclass's own values
    defaults = TrainConfig()
    assert options["batch_size"].help.endswith(f"[default: {defaults.batch_size}]")
    assert options["vocab_size"].help.endswith(f"[default: {settings.VOCAB_SIZE}]")
    assert options["steps"].help.endswith(f"[default: {settings.DEFAULT_STEPS}, or from --tokens]")
    assert options["tf32"].help.endswith("[default: on]") and defaults.tf32 is True
    assert "[default:" not in options["resume"].help and defaults.resume is False
    assert options["tf32"].opts == ["--tf32"] and options["tf32"].secondary_opts == ["--no-tf32"]
    assert tuple(options["parallel"].type.choices) == settings.PARALLEL


def test_compare_help_texts_come_from_the_settings():
    options = _options(compare)
    for name in ("optimizers", "batch_sizes", "lrs", "tokens", "out", "jobs", "seeds", "best_seeds", "hessian"):
        assert options[name].help == setting_help(CompareDefaults, name), name
    assert options["environment_check"].help == setting_help(CompareDefaults, "environment_check")
    assert options["max_extensions"].help == setting_help(CompareDefaults, "max_extensions")
    assert options["model"].help == setting_help(TrainConfig, "model", COMPARE_TRAIN["model"])
    assert options["seq_len"].help == setting_help(TrainConfig, "seq_len", COMPARE_TRAIN["seq_len"])
    assert options["tokens"].help.endswith(f"[default: {COMPARE.tokens}]")
    assert options["optimizers"].help.endswith(f"[default: {','.join(COMPARE.optimizers)}]")
    assert str(COMPARE.quick_tokens) in options["quick"].help
    # every option that shows a default shows the one its setting declares: none is written by hand
    for command in (train, compare):
        for name, option in _options(command).items():
            text = option.help or ""
            assert "(default" not in text, (command.name, name)
            if "[default:" in text:
                declared = [
                    setting_help(
                        cls, name, *([COMPARE_TRAIN[name]] if cls is TrainConfig and name in COMPARE_TRAIN else [])
                    )
                    for cls in (TrainConfig, CompareDefaults)
                    if name in {f.name for f in dataclasses.fields(cls)}
                ]
                assert text in declared, (command.name, name)


def test_the_default_comparison_is_the_declared_one():
    from merit_core.compare.spec import load_spec

    spec = load_spec()
    assert spec.optimizers == list(COMPARE.optimizers) == ["adamw", "lamb", "merit"]
    assert spec.all_batch_sizes == list(COMPARE.batch_sizes)
    assert spec.tokens == COMPARE.tokens and load_spec(quick=True).tokens == COMPARE.quick_tokens
    assert (spec.seeds, spec.best_seeds, spec.max_extensions) == (COMPARE.seeds, COMPARE.best_seeds, 2)
    assert spec.environment_check is COMPARE.environment_check is True
    assert spec.train == COMPARE_TRAIN
    assert COMPARE_TRAIN["model"] == TrainConfig().model and COMPARE_TRAIN["seq_len"] == TrainConfig().seq_len


def test_the_checks_are_the_declared_bounds_and_choices():
    from merit_core.train.config import load_config

    bounded = [(f.name, setting_of(TrainConfig, f.name).bound) for f in dataclasses.fields(TrainConfig)]
    assert ("batch_size", "positive") in bounded and ("grad_clip", "nonnegative") in bounded
    for name, bound in bounded:
        if bound is None:
            continue
        bad = 0 if bound == "positive" else -1
        with pytest.raises(ConfigError, match=f"^{name} must be {'positive' if bad == 0 else '>= 0'}"):
            load_config(None, [f"{name}={bad}"])
    for name in ("dtype", "kernels", "parallel"):
        choices = setting_of(TrainConfig, name).choices
        assert choices and TrainConfig().to_dict()[name] in choices
        with pytest.raises(ConfigError, match=f"^{name} must be one of {', '.join(choices)}"):
            load_config(None, [f"{name}=bogus"])


def test_resolve_returns_the_resolved_type_without_optional_fields():
    from merit_core.train.config import load_config, resolve

    hints = typing.get_type_hints(ResolvedConfig)
    assert option_names(ResolvedConfig) == option_names(TrainConfig)  # the declarations carry over
    assert setting_of(ResolvedConfig, "lr") == setting_of(TrainConfig, "lr")
    for name in ("lr", "min_lr", "warmup_steps", "weight_decay", "steps", "out"):
        assert type(None) not in typing.get_args(hints[name]), name
        assert type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[name]), name
    given = load_config(None, ["tokens=4096", "batch_size=4", "seq_len=64", "optimizer=adamw"])
    resolved = resolve(given).config
    assert isinstance(resolved, ResolvedConfig) and isinstance(resolved, TrainConfig)
    assert resolved.steps == 16 and resolved.tokens is None  # 4096 tokens / (4 x 64) per step
    assert resolved.warmup_steps == int(given.warmup_ratio * 16)
    assert resolved.min_lr == pytest.approx(resolved.lr * given.min_lr_ratio)
    assert resolved.weight_decay is not None and resolved.out.startswith("runs")
    assert resolved.micro_batch_size == 4  # the whole batch on one process


def test_a_new_setting_is_one_declaration():
    """What a setting added to TrainConfig gets from its declaration alone: an option of its kind,
    help with its default, a type for the option's value."""
    from merit_cli.options import setting_option

    @dataclasses.dataclass(kw_only=True)
    class Extended(TrainConfig):
        watch_every: int = settings.setting(25, "Steps between watch checks.", option="value", bound="positive")

    assert shown_default(Extended, "watch_every") == "25"
    command = setting_option(Extended, "watch_every")(click.Command("x", callback=lambda **kw: kw))
    option = command.params[0]
    assert option.opts == ["--watch-every"] and option.help == "Steps between watch checks.  [default: 25]"
    assert command.main(["--watch-every", "5"], standalone_mode=False) == {"watch_every": 5}
    assert command.main([], standalone_mode=False) == {"watch_every": None}  # not given: the config decides


def _tracked_python() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.split() if line.startswith(("merit_core/", "merit_cli/"))]


def test_the_vocabulary_device_words_and_dtype_spellings_are_written_once():
    owner = ROOT / "merit_core" / "settings.py"
    # 4096 in other senses: a path's length in bytes, a count of held-out tokens, a read's size
    other_senses = ("PATH_MAX = 4096", "SMALL_VAL_TOKENS = 4096", "[:4096]")
    found = []
    for path in _tracked_python():
        if path == owner:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            if re.search(r"\b4_?096\b", line) and not any(s in line for s in other_senses):
                found.append(where)
            if "cuda(:" in line or re.search(r"['\"]bf16['\"]\s*:", line) or re.search(r"['\"]fp32['\"]\s*:", line):
                found.append(where)
    assert found == []
