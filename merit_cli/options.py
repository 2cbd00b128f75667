"""Click option helpers shared by the commands."""

from __future__ import annotations

from merit_core.errors import ConfigError


def number(kind: type):
    """A click callback: the option's text -> int/float, or a one-line ConfigError naming the option."""

    def convert(ctx, param, value):
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError:
            word = "an integer" if kind is int else "a number"
            raise ConfigError(f"--{param.name.replace('_', '-')} must be {word}, got {value!r}") from None

    return convert
