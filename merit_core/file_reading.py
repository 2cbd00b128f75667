"""Reading files someone else wrote, and printing their names.

A checkpoint, a config, a marker or a text file named by the user may be a FIFO (whose read blocks),
a device (whose read never ends), huge, or not UTF-8: `open_regular` opens only regular files,
`read_head` reads at most a limit, `read_toml_file` is the one TOML load of a file and
`read_text_file` the one read of a user's text. `display` and `short` turn any path (bytes that are
not UTF-8, control characters planted in a name) into text a one-line message can print.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from merit_core.errors import CheckpointError, ConfigError, DataError, MeritError, printable


def special_file(path: str | os.PathLike) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder ('a FIFO', 'a socket',
    'a device'); None otherwise (absent, dangling link, file or folder). Reading a FIFO blocks until
    someone writes to it, a device may never end: merit reads neither as a checkpoint, a config or text."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_regular(path: str | os.PathLike):
    """`path` opened for binary reading, refused (CheckpointError) unless it is a regular file.

    Opened without blocking and checked on the open descriptor, so a FIFO swapped in after a
    check cannot hang the read. The shared opener of every file merit reads from a checkpoint
    (merit_core.checkpoint.safe) and of its trainer_state.json (merit_core.checkpoint.state)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = special_file(path) or "not a regular file"
            raise CheckpointError(f"{display(path)} is {what}; merit reads only regular files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


MAX_TOML_BYTES = 1 << 20  # a configuration is a few kB; a larger file is not one


def read_toml_file(path: str | os.PathLike, error: type[MeritError] = ConfigError) -> dict[str, Any]:
    """The table the TOML file `path` holds: the one safe TOML load of a file merit reads (a user's
    train or compare config, a run's config.toml through merit_core.checkpoint.run_config).

    A regular file (`open_regular`) of at most MAX_TOML_BYTES, UTF-8; `error` (one line) when it
    cannot be read, is larger, is not valid TOML or nests a value too deeply to parse."""
    shown = display(path)
    try:
        raw = read_head(path, MAX_TOML_BYTES)
    except OSError as exc:
        raise error(f"cannot read {shown}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOML_BYTES:
        raise error(f"{shown} is larger than {MAX_TOML_BYTES:,} bytes: not a configuration file")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{shown} is not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{shown} is not valid TOML: {exc}") from None
    except RecursionError:
        raise error(f"{shown}: a value is nested too deeply to read") from None


def read_head(path: str | os.PathLike, limit: int) -> bytes:
    """At most `limit` + 1 bytes from the start of the regular file `path` (see `open_regular`):
    a reader of a small file someone else wrote (a marker, a JSON config) checks for more than
    `limit` and refuses, instead of reading a huge or sparse file whole into memory."""
    with open_regular(path) as fh:
        return fh.read(limit + 1)


def special_entries(folder: str | os.PathLike) -> list[tuple[str, str]]:
    """(name, what) of every entry of `folder` that is neither a regular file nor a folder (see
    `special_file`); [] when the folder cannot be listed."""
    try:
        names = sorted(os.listdir(folder))
    except (OSError, ValueError):
        return []
    found = []
    for name in names:
        what = special_file(os.path.join(folder, name))
        if what is not None:
            found.append((name, what))
    return found


def display(path: str | os.PathLike) -> str:
    """A path as text that can always be printed (merit_core.errors.printable): bytes a file system
    name holds that are not UTF-8 (kept by Python as surrogates) as \\xNN escapes instead of failing
    to encode, control characters (an ESC planted in a name) as escapes instead of reaching the terminal."""
    return printable(os.fspath(path))


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of a file the user named (`what` it is, e.g. 'probe text'), or one DataError
    line: a FIFO or device (whose read would block), an unreadable or empty file."""
    kind = special_file(path)
    if kind is not None:  # a FIFO would block the read forever
        raise DataError(f"{what} {display(path)} is {kind}; give a regular text file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise DataError(f"{what} file {path} is empty")
    return text


def short(path: str | os.PathLike, limit: int = 80) -> str:
    """A path for a one-line message: printable (see `display`) and cut to `limit` characters."""
    text = display(path)
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-17:]}"
