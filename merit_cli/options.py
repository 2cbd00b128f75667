"""Click option helpers shared by the commands: numbers, --device, --dtype, and their metavars."""

from __future__ import annotations

import re

import click

from merit_core.errors import ConfigError
from merit_core.values import describe

# The device names train, eval and inspect take (train's config checks the same words).
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


class _Number:
    """:func:`number`'s callback: the converter and the metavar it gives its option."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.metavar = "INTEGER" if kind is int else "FLOAT"

    def __call__(self, ctx: click.Context, param: click.Parameter, value: str | None) -> int | float | None:
        if value is None:
            return None
        try:
            return self.kind(value)
        except ValueError:
            name = (param.name or "").replace("_", "-")
            raise ConfigError(f"--{name} must be {describe(self.kind)}, got {value!r}") from None


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


def fill_metavars(command: click.Command) -> click.Command:
    """Give each option converted by a `number` callback (and no metavar of its own) that callback's metavar."""
    for param in command.params:
        metavar = getattr(param.callback, "metavar", None)
        if isinstance(param, click.Option) and param.metavar is None and metavar is not None:
            param.metavar = metavar
    return command


def _device(ctx, param, value):
    """--device as typed -> lower case, if it is auto, cpu, cuda, cuda:N (or mps); else one ConfigError line."""
    if value is None:
        return None
    name = value.strip().lower()
    if not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(f"--device {value}: use auto, cpu, cuda or cuda:N")
    return name


def device_option(default: str | None = "auto"):
    """--device, the same words in every command: auto, cpu, cuda or cuda:N (train, eval, inspect)."""
    shown = "" if default is not None else " [default: auto]"
    return click.option(
        "--device",
        default=default,
        show_default=default is not None,
        metavar="DEVICE",
        callback=_device,
        help=f"auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda or cuda:N.{shown}",
    )


def dtype_callback(allowed: tuple[str, ...]):
    """A click callback: a dtype as users type it (bf16, bfloat16, fp32, ...) -> its full name, one of `allowed`.

    The spellings are eval's (merit_core.evaluation.checkpoint.resolve_dtype), so every command reads them alike.
    """

    def convert(ctx, param, value):
        if value is None:
            return None
        from merit_core.evaluation.checkpoint import resolve_dtype

        try:
            name = "auto" if value.strip().lower() == "auto" else resolve_dtype(value.strip(), "cpu")
        except ConfigError:
            name = None
        if name not in allowed:
            extra = " (float16 needs loss scaling, which merit train does not do)" if name == "float16" else ""
            raise ConfigError(f"--dtype {value}: use {', '.join(allowed)}{extra}")
        return name

    return convert
