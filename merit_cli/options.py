"""Click option helpers shared by the commands: numbers, --device, --dtype, and their metavars."""

from __future__ import annotations

import click

from merit_core.devices import canonical_dtype, check_device
from merit_core.errors import ConfigError


def number(kind: type):
    """A click callback: the option's text -> int/float, or a one-line ConfigError naming the option.

    The callback carries the metavar (INTEGER / FLOAT) that `fill_metavars` gives its option, so
    `--help` shows `--lr FLOAT` rather than click's `TEXT` for an untyped option.
    """

    def convert(ctx, param, value):
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError:
            word = "an integer" if kind is int else "a number"
            raise ConfigError(f"--{param.name.replace('_', '-')} must be {word}, got {value!r}") from None

    convert.metavar = "INTEGER" if kind is int else "FLOAT"
    return convert


def fill_metavars(command: click.Command) -> click.Command:
    """Give each option converted by a `number` callback (and no metavar of its own) that callback's metavar."""
    for param in command.params:
        metavar = getattr(param.callback, "metavar", None)
        if isinstance(param, click.Option) and param.metavar is None and metavar is not None:
            param.metavar = metavar
    return command


def _device(ctx, param, value):
    return None if value is None else check_device(value)


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
    """A click callback: a dtype as users type it (bf16, bfloat16, fp32, ...) -> its full name, one of `allowed`."""

    def convert(ctx, param, value):
        if value is None:
            return None
        name = canonical_dtype(value)
        if name not in allowed:
            extra = " (float16 needs loss scaling, which merit train does not do)" if name == "float16" else ""
            raise ConfigError(f"--dtype {value}: use {', '.join(allowed)}{extra}")
        return name

    return convert
