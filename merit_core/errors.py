"""Errors a user can act on. The CLI prints their message as one line and exits with code 2.

Every user-facing error class lives here, so that any module (and the CLI) can name one without
importing the torch-heavy module that raises it. `first_line` is how a library's exception is
quoted inside one of these one-line messages.
"""

from __future__ import annotations

from pathlib import Path


class MeritError(Exception):
    """Base class: a problem with the user's input, not a bug in merit."""


class ConfigError(MeritError):
    """A bad run configuration: unknown key, unknown model or optimizer, bad value."""


class CheckpointError(MeritError):
    """A checkpoint that is missing, corrupt, unsafe to load, or does not fit its config."""


class ResumeMismatch(CheckpointError):
    """The checkpoint was trained with other settings than this run has (not a corrupt checkpoint)."""


class DataError(MeritError):
    """Missing, empty or unreadable training / evaluation data, or an unreachable dataset."""


class MissingDependencyError(MeritError):
    """An optional package that this feature needs is not installed (the message says what to install)."""


class TrainingDiverged(MeritError):
    """The loss or the gradient norm became nan or inf."""


class CompileFailed(ConfigError):
    """torch.compile could not compile the model on this machine (the message names compile=false)."""


class RunFailed(MeritError):
    """A run of a comparison crashed (not a divergence); its log names the cause."""


class RunBusy(MeritError):
    """Another process holds the run folder's lock."""


class DiskFull(MeritError):
    """The disk filled up while merit was writing."""


class UnsafePath(MeritError):
    """A symbolic link, folder or special file planted where merit writes: refused (and named), never followed."""


class RunInterrupted(Exception):
    """Training stopped on a signal after saving; `exit_code` is 143 (SIGTERM/SIGUSR1) or 130 (SIGINT).

    Not a MeritError: the run did what it was asked (it stopped cleanly), and the CLI exits with
    the signal's conventional code rather than 2.
    """

    def __init__(self, message: str, exit_code: int, checkpoint: Path | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
