"""Checks of where merit will write, made before any work starts.

An output file or folder (`--out`, `--output_path`, a prepared corpus) is checked up front so that a
run never fails at its first write after the work is done: a folder where a file is due, a parent
that cannot be written, a name longer than the file system allows, bytes that are not UTF-8, a
dangling link on the way, or an `--out` folder holding files merit did not make.
"""

from __future__ import annotations

import os
from pathlib import Path

from merit_core.durable_writes import TMP_PREFIX, create_new
from merit_core.errors import ConfigError, UnsafePath
from merit_core.file_reading import short


def check_writable(path: str | Path, what: str) -> Path:
    """ConfigError unless a file can be written at `path` (checked before any work starts).

    The path must not be a folder, and its nearest existing parent must be a writable folder.
    """
    out = Path(path).expanduser()
    if out.is_dir():
        raise ConfigError(f"{what} {path}: is a folder; give a file name")
    check_path_names(out, what)
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{what} {path}: the file is not writable")
    _check_creatable(out.parent, path, what)  # the file is written as a temp file beside it, then renamed
    return out


def check_writable_folder(path: str | Path, what: str) -> Path:
    """ConfigError unless `path` is a writable folder or can be created as one."""
    folder = Path(path).expanduser()
    check_path_names(folder, what)
    check_utf8_path(folder, what)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} {path}: exists and is not a folder")
    _check_creatable(folder, path, what)
    return folder


def refuse_foreign_entries(folder: Path, foreign: list[str], what: str) -> None:
    """ConfigError when `folder` (given as --out) holds entries merit did not make: `foreign`, the
    names of those entries, sorted; `what` is what merit writes there ("a merit run", ...)."""
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"--out {folder} holds files that are not {what} ({shown}); give an empty or new folder "
            "(merit never writes into folders it did not make)"
        )


NAME_MAX = 255  # bytes in one file or folder name (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path, the final NUL included (Linux)


def check_path_names(path: str | os.PathLike, what: str) -> None:
    """ConfigError when `path` has a name longer than NAME_MAX bytes or is PATH_MAX bytes or longer:
    checked before any work, where the OS would otherwise fail at the first write (ENAMETOOLONG)."""
    raw = os.fsencode(path)
    if len(raw) >= PATH_MAX:
        raise ConfigError(f"{what} {short(path)}: the path is {len(raw)} bytes long; the limit is {PATH_MAX - 1}")
    for part in Path(os.fsdecode(raw)).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise ConfigError(
                f"{what} {short(path)}: the name {short(part, 40)} is {len(os.fsencode(part))} bytes long; "
                f"file systems allow {NAME_MAX}"
            )


def check_utf8_path(path: str | os.PathLike, what: str) -> None:
    """ConfigError when `path` holds bytes that are not UTF-8 (Python keeps them as surrogates): a
    folder merit makes is recorded in UTF-8 files (a run's config.toml, a tokenizer's JSON), which
    cannot hold such a name. Checked before any work; reading such a path is fine elsewhere."""
    text = os.fsdecode(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{what} {short(text)}: the path holds bytes that are not UTF-8; merit records the folders it "
            "writes in UTF-8 files (config.toml, the tokenizer): give a UTF-8 name"
        ) from None


def refuse_dangling_parents(path: str | os.PathLike, what: str) -> None:
    """ConfigError when a folder merit would create for `path` is a symbolic link to nothing: making
    it would fail after the work is done (or, once its target appears, write where the link points)."""
    for parent in [Path(path), *Path(path).parents]:
        if parent.exists():
            return
        if os.path.islink(parent):
            raise ConfigError(f"{what} {short(path)}: {short(parent)} is a symbolic link to a missing target")


def _check_creatable(folder: Path, given: str | Path, what: str) -> None:
    """ConfigError unless the nearest existing ancestor of `folder` (or itself) is a writable folder:
    a file is made there and removed, since a folder can look writable and refuse (/proc, a read-only
    mount, root's view of os.access)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{what} {given}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {given}: cannot write into {probe}")
    test = probe / f"{TMP_PREFIX}check.{os.getpid()}"
    try:
        os.close(create_new(test))
        os.unlink(test)
    except (OSError, UnsafePath) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{what} {given}: cannot write into {probe} ({why})") from None
