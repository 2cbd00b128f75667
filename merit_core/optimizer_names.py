"""The optimizer names this process knows and how a typed name is read, without torch.

merit_core.optim.registry builds each of these names: it checks at import that its built-in specs
are exactly `BUILTIN_OPTIMIZERS`, in this order, and adds here (and takes away) every name registered
later. `merit train` reads a name here before the training package (torch) loads, so that a
misspelt `--optimizer` is one line at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from merit_core.errors import ConfigError

# Registry order: the paper's optimizer, the baselines, then MERIT's ablations.
BUILTIN_OPTIMIZERS: tuple[str, ...] = (
    "merit",
    "adamw",
    "lamb",
    "lion",
    "sophiag",
    "muon",
    "merit-noclip",
    "merit-nobound",
    "max-lamb",
    "l2-merit",
    "lamb-ref",
)


_KNOWN: dict[str, None] = dict.fromkeys(BUILTIN_OPTIMIZERS)  # in order; the registry adds and removes


def known_names() -> tuple[str, ...]:
    """Every name the registry has (the built-in ones first), without importing it."""
    return tuple(_KNOWN)


def add_name(name: str) -> None:
    """Called by the registry when it registers `name`."""
    _KNOWN[name] = None


def remove_name(name: str) -> None:
    """Called by the registry when it unregisters `name`."""
    _KNOWN.pop(name, None)


def optimizer_key(name: str) -> str:
    """A typed name as the registry spells its names: case-insensitive, `_` the same as `-`."""
    return name.strip().lower().replace("_", "-")


def known_optimizer(name: object, names: Sequence[str] | None = None) -> str:
    """The registry name `name` means, one of `names` (default: `known_names()`); a ConfigError line
    naming the closest otherwise."""
    names = known_names() if names is None else names
    if not isinstance(name, str):
        raise ConfigError(f"optimizer name must be a string, got {name!r}; valid: {', '.join(names)}")
    key = optimizer_key(name)
    if key in names:
        return key
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown optimizer '{name}'{hint}; valid names: {', '.join(names)}")
