"""Typed values from loose input: the one coercer behind train configs, compare specs and optimizer
hyperparameters.

A value arrives from TOML, a ``--set key=value`` override, a command-line option or a Python
call, and is checked against a type hint:

    ========================  =====================================  =========================
    hint                      accepts                                returns
    ========================  =====================================  =========================
    ``float``                 any real number but a bool             a float
    ``int``                   an int but a bool, an integral float   an int
    ``bool``                  True or False only                     the bool
    ``str``                   a string                               the string
    ``tuple[float, float]``   a list or tuple of two numbers         a tuple of two floats
    ``dict[str, Any]``        a dict (a TOML table)                  a fresh dict
    ``X | None``              None, or what X accepts                None, or X's value
    ========================  =====================================  =========================

A bool is never a number (TOML's ``true`` is not 1). A value that does not fit raises
:class:`~merit_core.errors.ConfigError` in one line, ``<what> must be <words>, got <value!r>``;
the words come from :func:`describe`. A hint outside the table is a programming error (TypeError).

Also here: :func:`positive_int` (counts: sizes, seeds, budgets), :func:`parse_number` (a number
typed as text: ASCII digits only), :func:`in_range` (a bounded integer, e.g. a seed), :func:`nest` and
:func:`deep_merge`, which layer dotted ``key=value`` overrides over nested tables.

This module imports nothing of merit but :mod:`merit_core.errors`, so every layer (the optimizer
registry included) may use it.
"""

from __future__ import annotations

import types
import typing
from numbers import Real
from typing import Any

from merit_core.errors import ConfigError

# A pair of numbers (betas): a list or tuple of two numbers, returned as a tuple of floats.
PAIR = tuple[float, float]

_WORDS = {
    float: "a number",
    int: "an integer",
    bool: "true or false",
    str: "a string",
    PAIR: "a pair of numbers",
    dict: "a table",
}


def is_number(value: Any) -> bool:
    """A real number that is not a bool (True is not 1 here)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def as_int(value: Any) -> int | None:
    """An int (not a bool) as is, an integral float as an int; None for anything else."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def describe(hint: Any, mention_none: bool = True) -> str:
    """How an error message says what `hint` accepts: 'a number', 'true, false or None', ...

    `mention_none` False leaves 'or None' out (for settings read from TOML, which cannot write None:
    a key left out means its default). TypeError for a hint outside the module's table."""
    base, nullable = _split_optional(hint)
    if not (nullable and mention_none):
        return _WORDS[base]
    return "true, false or None" if base is bool else f"{_WORDS[base]} or None"


def coerce(value: Any, hint: Any, what: str, mention_none: bool = True) -> Any:
    """`value` checked against `hint` and normalised (see the module's table).

    `what` names the value in the error: ``f"{what} must be {describe(hint)}, got {value!r}"``
    (a table's error also shows how to write one: ``what.key=value``). `mention_none`: see
    :func:`describe`. Raises ConfigError when the value does not fit, TypeError for an
    unsupported hint."""
    base, nullable = _split_optional(hint)
    if value is None and nullable:
        return None
    if base is float and is_number(value):
        return float(value)
    if base is int and (number := as_int(value)) is not None:
        return number
    if base is bool and isinstance(value, bool):
        return value
    if base is str and isinstance(value, str):
        return value
    if base is PAIR and isinstance(value, (list, tuple)) and len(value) == 2 and all(map(is_number, value)):
        return tuple(float(v) for v in value)
    if base is dict and isinstance(value, dict):
        return dict(value)
    example = f" (e.g. {what}.key=value)" if base is dict else ""
    raise ConfigError(f"{what} must be {describe(hint, mention_none)}{example}, got {value!r}")


def positive_int(value: Any, what: str, zero: bool = False) -> int:
    """`value` as an int >= 1 (>= 0 with `zero`); an integral float counts, a bool does not.
    ConfigError "<what> must be a positive integer, got ..." ("0 or a positive integer" with `zero`)."""
    number = as_int(value)
    if number is None or number < (0 if zero else 1):
        words = "0 or a positive integer" if zero else "a positive integer"
        raise ConfigError(f"{what} must be {words}, got {value!r}")
    return number


def parse_number(text: Any, kind: type, what: str) -> Any:
    """A number typed as text (a command-line option, an item of a comma list) as `kind` (int or
    float); an int or float given as such is checked like `coerce` does.

    ASCII only: Python's int() and float() also read the digits of other scripts and fullwidth
    ones ('١٢' is 12), and str.isdigit() says True for '²', which int() then refuses; none of them
    is a number a user meant here. ConfigError ``<what> must be an integer, got '²'``."""
    if not isinstance(text, str):
        return coerce(text, kind, what)
    value = text.strip()
    try:
        if not value.isascii():
            raise ValueError(value)
        return kind(value)
    except ValueError:
        raise ConfigError(f"{what} must be {describe(kind)}, got {text!r}") from None


def in_range(value: Any, low: int, high: int, what: str) -> int:
    """`value` as an int from `low` to `high` (both included), e.g. a seed that numpy takes as 32
    bits; ConfigError ``<what> must be an integer from <low> to <high>, got ...`` otherwise."""
    number = as_int(value)
    if number is None or not low <= number <= high:
        raise ConfigError(f"{what} must be an integer from {low} to {_power(high)}, got {value!r}")
    return number


def _power(n: int) -> str:
    """2**32 - 1 written so: the bounds of a seed are read more easily as powers of two."""
    return f"2**{(n + 1).bit_length() - 1} - 1" if n > 1024 and (n + 1) & n == 0 else str(n)


def nest(dotted: str, value: Any) -> dict[str, Any]:
    """``nest("a.b.c", 1)`` -> ``{"a": {"b": {"c": 1}}}``: a dotted override as the table it sets."""
    parts = dotted.split(".")
    out: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        out = {part: out}
    return out


def deep_merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Merge `new` into `base` in place (and return `base`): tables present in both merge key by key,
    any other value of `new` replaces base's."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``, ``X`` -> ``(X, False)``, with X one of the keys of _WORDS
    (``dict[str, Any]`` read as ``dict``, ``tuple[float, float]`` as PAIR); TypeError for other hints."""
    nullable = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if len(args) != 2 or type(None) not in args:
            raise TypeError(f"unsupported type hint {hint!r}: the only union coerced is X | None")
        (hint,) = [a for a in args if a is not type(None)]
        nullable = True
    if typing.get_origin(hint) is dict:
        hint = dict
    elif hint == PAIR:
        hint = PAIR
    if not any(hint is known for known in _WORDS):
        raise TypeError(f"unsupported type hint {hint!r}; supported: float, int, bool, str, {PAIR}, dict, X | None")
    return hint, nullable
