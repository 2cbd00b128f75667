"""Click option helpers shared by the commands: numbers, --device, --dtype, options declared by
merit_core.settings, and their metavars."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from merit_core.errors import ConfigError
from merit_core.settings import (
    DEVICE_HELP,
    DEVICE_PATTERN,
    DEVICE_WORDS,
    DTYPE_SPELLINGS,
    TrainConfig,
    default_of,
    setting_of,
    shown_default,
    value_type,
)
from merit_core.values import parse_number


class _Number:
    """:func:`number`'s callback: the converter and the metavar it gives its option."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.metavar = "INTEGER" if kind is int else "FLOAT"

    def __call__(self, ctx: click.Context, param: click.Parameter, value: str | None) -> int | float | None:
        if value is None:
            return None
        name = (param.name or "").replace("_", "-")
        return parse_number(value, self.kind, f"--{name}")  # ASCII digits only


def number(kind: type) -> _Number:
    """A click callback: the option's text -> int/float, or a one-line ConfigError naming the option.

    The callback carries the metavar (INTEGER / FLOAT) that `fill_metavars` gives its option, so
    `--help` shows `--lr FLOAT` rather than click's `TEXT` for an untyped option.
    """

    return _Number(kind)


def number_option(name: str, kind: type, *, default: int | float | None = None, help: str):
    """An option holding one int or float, read by `number` (a value that is not one is a one-line
    ConfigError naming the option); its metavar is N for an int, F for a float."""
    return click.option(
        name,
        default=None if default is None else str(default),
        metavar="N" if kind is int else "F",
        callback=number(kind),
        help=help,
    )


class _AsciiDigits:
    """Mixed into click's number types: the text is first read by merit_core.values.parse_number
    (ASCII digits only; click's own int() reads '١٢' as 12), then by click as before."""

    kind: type = int

    def convert(self, value, param, ctx):
        if isinstance(value, str) and param is not None:
            shown = next((o for o in param.opts if o.startswith("--")), param.opts[0] if param.opts else param.name)
            parse_number(value, self.kind, str(shown))
        return super().convert(value, param, ctx)


class _Int(_AsciiDigits, click.types.IntParamType):
    kind = int


class _Float(_AsciiDigits, click.types.FloatParamType):
    kind = float


class _IntRange(_AsciiDigits, click.IntRange):
    kind = int


class _FloatRange(_AsciiDigits, click.FloatRange):
    kind = float


def ascii_numbers(command: click.Command) -> click.Command:
    """Give every int and float option and argument of `command` (plain or a range) the same type
    reading ASCII digits only, whichever command declared it with `type=int`."""
    for param in command.params:
        kind = param.type
        if isinstance(kind, click.IntRange):
            param.type = _IntRange(kind.min, kind.max, kind.min_open, kind.max_open, kind.clamp)
        elif isinstance(kind, click.FloatRange):
            param.type = _FloatRange(kind.min, kind.max, kind.min_open, kind.max_open, kind.clamp)
        elif isinstance(kind, click.types.IntParamType) and not isinstance(kind, _AsciiDigits):
            param.type = _Int()
        elif isinstance(kind, click.types.FloatParamType) and not isinstance(kind, _AsciiDigits):
            param.type = _Float()
    return command


def fill_metavars(command: click.Command) -> click.Command:
    """Give each option converted by a `number` callback (and no metavar of its own) that callback's
    metavar; every number option reads ASCII digits only (`ascii_numbers`)."""
    ascii_numbers(command)
    for param in command.params:
        metavar = getattr(param.callback, "metavar", None)
        if isinstance(param, click.Option) and param.metavar is None and metavar is not None:
            param.metavar = metavar
    return command


def device_callback(ctx, param, value):
    """--device as typed -> lower case, if it is auto, cpu, cuda, cuda:N (or mps); else one ConfigError line."""
    if value is None:
        return None
    name = value.strip().lower()
    if not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(f"--device {value}: use {DEVICE_WORDS}")
    return name


def device_option():
    """--device for eval and inspect: the words train's `device` setting takes (auto, cpu, cuda or
    cuda:N), auto by default."""
    return click.option(
        "--device",
        default=default_of(TrainConfig, "device"),
        metavar=setting_of(TrainConfig, "device").metavar,
        callback=device_callback,
        help=DEVICE_HELP,
    )


def dtype_callback(allowed: tuple[str, ...]):
    """A click callback: a dtype as users type it (bf16, bfloat16, fp32, ...) -> its full name, one of `allowed`.

    The spellings are merit_core.settings.DTYPE_SPELLINGS, which merit eval reads too, so every command
    reads them alike.
    """

    def convert(ctx, param, value):
        if value is None:
            return None
        word = value.strip().lower()
        name = "auto" if word == "auto" else DTYPE_SPELLINGS.get(word)
        if name not in allowed:
            extra = " (float16 needs loss scaling, which merit train does not do)" if name == "float16" else ""
            raise ConfigError(f"--dtype {value}: use {', '.join(allowed)}{extra}")
        return name

    return convert


def _selection(ctx, param, value):
    """--steps as typed -> a Selection (merit_core.checkpoint's one parser), or one ConfigError line."""
    from merit_core.checkpoint import parse_selection

    return None if value is None else parse_selection(value)


def steps_option(default: str):
    """--steps latest|all|N,M: which checkpoints of a run folder a command takes, the same words in
    inspect and eval (merit_core.checkpoint.resolve parses and applies them)."""
    from merit_core.checkpoint import STEPS_HELP

    return click.option(
        "--steps",
        "selection",
        default=default,
        show_default=True,
        metavar="latest|all|N,M",
        callback=_selection,
        help=STEPS_HELP,
    )


def all_steps_option():
    """--all-steps, kept as another spelling of --steps all (see `selection_of`)."""
    return click.option("--all-steps", is_flag=True, help="The same as --steps all.")


def selection_of(selection, all_steps: bool):
    """The Selection --steps and --all-steps make together (--all-steps with other steps: one ConfigError line)."""
    from merit_core.checkpoint import ALL, LATEST

    if not all_steps:
        return selection
    if selection not in (LATEST, ALL):
        raise ConfigError(f"--all-steps is --steps all; it cannot go with --steps {selection}")
    return ALL


def no_verify_option(what: str = "the checkpoints'"):
    """--no-verify: skip checking a checkpoint's files against the sha256 its trainer_state.json records."""
    return click.option(
        "--no-verify",
        "no_verify",
        is_flag=True,
        help=f"Skip checking {what} files against the checksums recorded when they were written (it says so).",
    )


def setting_help(cls: type, name: str, default: Any = dataclasses.MISSING) -> str:
    """A setting's help as --help shows it: the declared help and, where there is one, its default
    (`default`: another default to show) in click's own `[default: ...]` form."""
    shown = shown_default(cls, name, default)
    return setting_of(cls, name).help + (f"  [default: {shown}]" if shown else "")


def setting_option(cls: type, name: str, *, default: Any = dataclasses.MISSING, **extra: Any):
    """The option `--NAME` of setting `name` of a merit_core.settings dataclass, as it declares it: its
    kind (value, flag, switch, choice), help, metavar and shown default (`default`: another default
    to show, e.g. compare's own for a train setting). The option's value is None when not given, so
    that the config's own precedence decides; `extra` adds or replaces click arguments (a callback)."""
    declared = setting_of(cls, name)
    flag = "--" + name.replace("_", "-")
    decls: tuple[str, ...] = (flag,)
    kwargs: dict[str, Any] = {"help": setting_help(cls, name, default), "show_default": False}
    kwargs["metavar"] = declared.metavar
    if declared.option == "switch":
        decls = (f"{flag}/--no-{flag[2:]}", name)
        kwargs["default"] = None
    elif declared.option == "flag":
        kwargs.update(is_flag=True, default=None)
    elif declared.option == "choice":
        kwargs["type"] = click.Choice(declared.choices or ())
    elif value_type(cls, name) in (int, float):
        kwargs["callback"] = number(value_type(cls, name))
    kwargs.update(extra)
    return click.option(*decls, **kwargs)


def wide_option():
    """--wide for the commands that print tables (inspect, eval, compare): every column unfolded at its
    full width (merit_cli.render.wide_console) instead of tables that fit the terminal."""
    return click.option(
        "--wide",
        is_flag=True,
        help="Print tables with every column at its full width, one line per row, whatever the terminal's "
        "width (for a pipe or a wide terminal); without it a table fits the terminal, its names folding onto "
        "more lines and its columns split into parts.",
    )
