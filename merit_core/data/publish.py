"""Writing a folder atomically (build beside it, then rename) and a lock for one builder at a time."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from merit_core.data.meta import is_prepared
from merit_core.errors import ConfigError, DataError
from merit_core.fileio import check_writable_folder, exclusive_lock, folder_mode

TMP_PREFIX = ".merit-tmp-"


@contextlib.contextmanager
def staging_dir(target: Path):
    """Yield an empty temp folder next to `target`; it is removed if still there on exit."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    except OSError as exc:  # read-only file system, no permission, a file where a folder should be
        raise DataError(
            f"cannot write the output {target}: {exc.strerror or exc} ({exc.filename or target.parent})"
        ) from None

    os.chmod(tmp, folder_mode())  # mkdtemp makes it private; the published folder gets the user's umask
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_target(target: Path) -> None:
    """DataError unless `target` is absent, an empty folder, or a prepared-data folder we may replace,
    in a folder this user can write (a FIFO or file on the way, a read-only folder: refused here)."""
    try:
        check_writable_folder(target, "output")
    except ConfigError as exc:
        raise DataError(str(exc)) from None
    if not target.exists():
        return
    if not os.access(target.parent, os.W_OK | os.X_OK):  # the new copy is built beside it
        raise DataError(f"output {target}: cannot write into {target.parent}")
    if not target.is_dir():
        raise DataError(f"output {target} exists and is not a folder")
    if any(target.iterdir()) and not is_prepared(target):
        raise DataError(f"refusing to overwrite {target}: it is not empty and not a prepared data folder")


def publish(tmp: Path, target: Path) -> None:
    """Move the finished folder `tmp` to `target`, replacing an earlier prepared folder there."""
    check_target(target)
    if target.exists():
        old = target.with_name(f"{TMP_PREFIX}{target.name}-old-{os.getpid()}")
        os.replace(target, old)  # a directory rename cannot overwrite a non-empty directory
        try:
            os.replace(tmp, target)
        except OSError:
            os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


@contextlib.contextmanager
def build_lock(target: Path):
    """Hold an exclusive file lock beside `target` (POSIX; a no-op elsewhere), e.g. across DDP ranks.

    The lock file is removed when released (merit_core.fileio.FileLock), so none is left behind.
    """
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - Windows
        yield
        return

    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(lock_path(target)):
        yield


def lock_path(target: Path) -> Path:
    """The lock file `build_lock` uses for `target`."""
    return target.with_name(f".{target.name}.lock")
