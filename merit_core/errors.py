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


class InstabilityStop(TrainingDiverged):
    """`--on-instability stop` (or rewinds used up): stopped on a watcher warning; `checkpoint` is the
    last one from before the warning (None when there is none)."""

    def __init__(self, message: str, checkpoint: Path | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint


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


# What an OS error means to someone who gave merit a path, by errno (the rest use the OS's own words).
_OS_ERROR_WORDS = {
    "ENAMETOOLONG": "a name in the path is longer than the file system allows (255 bytes a name)",
    "EROFS": "the file system is read-only",
    "ENOTDIR": "a part of the path is a file, not a folder",
    "EISDIR": "it is a folder, not a file",
    "EACCES": "permission denied",
    "EPERM": "operation not permitted",
    "ENOSPC": "no space left on the device",
    "EDQUOT": "disk quota exceeded",
    "ELOOP": "too many levels of symbolic links",
    "ENOENT": "no such file or folder",
    "EEXIST": "it already exists",
}


def os_error_line(exc: OSError) -> str:
    """One line for an OS error no earlier check caught: what failed and on which path (shortened)."""
    import errno
    import os

    name = errno.errorcode.get(exc.errno or 0, "")
    why = _OS_ERROR_WORDS.get(name) or exc.strerror or first_line(exc)
    paths = [p for p in (exc.filename, exc.filename2) if p is not None]
    shown = " -> ".join(_short(os.fsdecode(p) if isinstance(p, bytes) else str(p)) for p in paths)
    return f"cannot use {shown}: {why}" if shown else f"{why} ({first_line(exc)})"


def _short(text: str, limit: int = 120) -> str:
    text = printable(text)
    return text if len(text) <= limit else f"{text[: limit - 30]}...{text[-27:]}"


# Characters that move the cursor, change colours or reorder text on a terminal, beyond the C0/C1
# controls: the bidirectional overrides and isolates, and the line and paragraph separators.
_INVISIBLE = frozenset({*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029, 0x200E, 0x200F, 0x061C})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """`text` (a name, a path, anything a user or a file gave) safe to print on a terminal: control
    characters (ESC, newlines, C1 codes, bidirectional overrides) shown as escapes such as \\x1b,
    and the bytes of a file name that are not UTF-8 (kept by Python as surrogates) as \\xNN.

    Plain text, for every message merit builds; the CLI also escapes rich markup on top of this
    (merit_cli.render.shown) where a string is printed as markup."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    elif not isinstance(text, str):
        text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _NAMED:
            out.append(_NAMED[ch])
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as os.fsdecode keeps it
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF or code in _INVISIBLE:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def one_line(message: str, limit: int = 1000) -> str:
    """`message` as one line of at most about `limit` characters: a huge value a message echoes (a
    100 MB TOML string) is cut in the middle."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    return f"{text[: limit - 200]} ... ({len(text) - limit + 50:,} characters left out) ... {text[-150:]}"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
