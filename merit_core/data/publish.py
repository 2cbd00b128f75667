"""Writing a prepared folder durably (build beside it, fsync, swap in) and a lock for one builder at a time."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from merit_core.data.meta import PREPARED_ENTRIES, PREPARED_MARKER, is_merit_prepared
from merit_core.errors import ConfigError, DataError
from merit_core.fileio import (
    STAGING_MARKER,
    check_writable_folder,
    exchange_paths,
    exclusive_lock,
    folder_mode,
    fsync_dir,
    fsync_tree,
    pid_alive,
)

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
    """DataError unless `target` is absent, an empty folder, or a folder merit prepared (it carries
    merit's mark, PREPARED_MARKER), in a folder this user can write (a FIFO or file on the way, a
    read-only folder: refused here). A folder without the mark is the user's, whatever it holds
    (a meta.json included): refused before any work, and never touched."""
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
    entries = sorted(os.listdir(target))
    if entries and not is_merit_prepared(target):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise DataError(
            f"refusing to overwrite {target}: it holds {shown} and not the {PREPARED_MARKER} mark of a folder "
            "`merit prepare` made; give an empty or new folder"
        )


def user_entries(folder: Path, ours: frozenset[str] = PREPARED_ENTRIES) -> list[str]:
    """Names in `folder` that merit did not write there (kept across a re-prepare)."""
    try:
        return sorted(name for name in os.listdir(folder) if name not in ours)
    except OSError:
        return []


# What a staging folder holds besides the prepared entries while it is being built.
_STAGING_ENTRIES = PREPARED_ENTRIES | {STAGING_MARKER, "all.bin"}


def side_path(target: Path, kind: str, pid: int | None = None) -> Path:
    """`.merit-tmp-<name>-<kind>-<pid>` beside `target`: the finished new copy ("new") or the
    replaced one ("old") while a publish is under way; the PID lets a later prepare finish or undo
    what a killed one left (`recover`)."""
    return target.with_name(f"{TMP_PREFIX}{target.name}-{kind}-{os.getpid() if pid is None else pid}")


def publish(tmp: Path, target: Path) -> None:
    """Move the finished folder `tmp` to `target`, replacing merit's entries of an earlier prepared
    folder there and keeping everything else in it.

    Every file and folder of the new copy is fsynced before any rename. The new copy is first
    renamed to `side_path(target, "new")`; the user's entries of `target` are moved into it; then
    the two folders are swapped in one atomic step (`exchange_paths`), so `target` always holds
    complete data, the old or the new; only then is the old copy removed. Where the file system
    cannot swap, two renames are used and a kill between them is undone by the next prepare
    (`recover`), as is a kill while the user's entries are being moved.
    """
    check_target(target)
    fsync_tree(tmp)
    new = side_path(target, "new")
    os.replace(tmp, new)  # from here on, named by PID: `recover` knows what to do with it
    (new / STAGING_MARKER).unlink(missing_ok=True)
    fsync_dir(target.parent)
    if not target.exists():
        os.replace(new, target)
        fsync_dir(target.parent)
        return
    moved: list[str] = []
    try:
        for name in user_entries(target):
            os.replace(target / name, new / name)
            moved.append(name)
        fsync_dir(target)
        fsync_dir(new)
        swapped = exchange_paths(new, target)
    except BaseException:
        for name in reversed(moved):  # the user's entries go back where they were
            os.replace(new / name, target / name)
        shutil.rmtree(new, ignore_errors=True)
        raise
    if swapped:
        fsync_dir(target.parent)
        shutil.rmtree(new)  # the old copy: merit's entries only
        return
    old = side_path(target, "old")
    os.replace(target, old)
    os.replace(new, target)
    fsync_dir(target.parent)
    shutil.rmtree(old)


def recover(target: Path) -> list[Path]:
    """Finish or undo what a killed `publish` of `target` left beside it; returns the folders removed.

    A `-new-<pid>` or `-old-<pid>` folder of a dead process is renamed back to `target` when
    `target` is missing (the new copy first: it is complete once it has that name), or else has
    the user's entries it holds moved back into `target` and is removed. A folder still holding
    an entry it could not move back (the name is taken) is left where it is.
    """
    removed: list[Path] = []
    for kind in ("new", "old"):
        prefix = f"{TMP_PREFIX}{target.name}-{kind}-"
        try:
            children = sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))
        except OSError:
            return removed
        for child in children:
            pid = child.name[len(prefix) :]
            if not pid.isdigit() or pid_alive(int(pid)) or child.is_symlink() or not child.is_dir():
                continue
            if not target.exists() and not target.is_symlink():
                (child / STAGING_MARKER).unlink(missing_ok=True)
                os.replace(child, target)
                fsync_dir(target.parent)
                continue
            for name in user_entries(child, _STAGING_ENTRIES):
                if not os.path.lexists(target / name):
                    os.replace(child / name, target / name)
            if not user_entries(child, _STAGING_ENTRIES):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


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
