"""Errors a user can act on. The CLI prints their message as one line and exits with code 2."""


class MeritError(Exception):
    """Base class: a problem with the user's input, not a bug in merit."""


class ConfigError(MeritError):
    """A bad run configuration: unknown key, unknown model or optimizer, bad value."""


class CheckpointError(MeritError):
    """A checkpoint that is missing, corrupt, unsafe to load, or does not fit its config."""


class DataError(MeritError):
    """Missing, empty or unreadable training / evaluation data, or an unreachable dataset."""


class MissingDependencyError(MeritError):
    """An optional package that this feature needs is not installed (the message says what to install)."""
