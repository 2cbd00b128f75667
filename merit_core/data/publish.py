"""Writing a prepared folder durably (build beside it, fsync, swap in) and a lock for one builder at a time."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from merit_core.data.meta import PREPARED_ENTRIES, PREPARED_MARKER, is_merit_prepared
from merit_core.durable_writes import (
    STAGING_MARKER,
    exchange_paths,
    folder_mode,
    fsync_dir,
    fsync_tree,
    refuse_link,
    rename_new,
)
from merit_core.errors import ConfigError, DataError, RunBusy, UnsafePath
from merit_core.file_locks import FileLock, exclusive_lock, pid_alive
from merit_core.output_checks import check_writable_folder

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


def _move_aside(folder: Path, target: Path, kind: str) -> Path:
    """Rename `folder` to a free `side_path(target, kind)` name (`-<kind>-<pid>`, else
    `-<kind>-<pid>.<n>`), reserved by the rename itself: a name that exists is never reused."""
    base = side_path(target, kind)
    for n in range(1, 1000):
        aside = base if n == 1 else base.with_name(f"{base.name}.{n}")
        try:
            rename_new(folder, aside)
            return aside
        except UnsafePath:
            continue
    raise DataError(f"cannot move {folder} aside: 999 names beside {target} are taken; remove the {TMP_PREFIX}* there")


def pause(stage: str) -> None:
    """Called by `publish` at each of its steps, by name ("moved-in", "user-entries-moved",
    "swapped", "before-discard"); a no-op. A test replaces it to stop one publish at a chosen step
    while another runs, forcing an interleaving that timing would give only by luck."""


def publish(tmp: Path, target: Path) -> None:
    """Move the finished folder `tmp` to `target`, replacing merit's entries of an earlier prepared
    folder there and keeping everything else in it.

    Every file and folder of the new copy is fsynced before any rename. The new copy is first
    renamed to `side_path(target, "new")` (a name reserved: never one that exists); the user's
    entries of `target` are moved into it; then the two folders are swapped in one atomic step
    (`exchange_paths`), so `target` always holds complete data, the old or the new; only then is
    the old copy discarded (`discard_copy`: merit's entries only; a user's entry found there goes
    back, never away). Where the file system cannot swap, two renames are used and a kill between
    them is undone by the next prepare (`recover`), as is a kill while the user's entries are being
    moved. No rename goes through a symbolic link planted at `target` or beside it. Callers hold
    `writer_lock(target)`; even without it, a second publish running at the same time never
    deletes a user's file.
    """
    check_target(target)
    fsync_tree(tmp)
    refuse_link(tmp)
    new = _move_aside(tmp, target, "new")  # from here on, named by PID: `recover` knows what to do with it
    (new / STAGING_MARKER).unlink(missing_ok=True)
    fsync_dir(target.parent)
    pause("moved-in")
    if not os.path.lexists(target):
        rename_new(new, target)
        fsync_dir(target.parent)
        return
    moved: list[str] = []
    try:
        refuse_link(target, "where merit prepares data")
        for name in user_entries(target):
            rename_new(target / name, new / name)
            moved.append(name)
        fsync_dir(target)
        fsync_dir(new)
        pause("user-entries-moved")
        refuse_link(target, "where merit prepares data")
        refuse_link(new, "where merit prepares data")
        swapped = exchange_paths(new, target)
    except BaseException:
        for name in reversed(moved):  # the user's entries go back where they were
            if not os.path.lexists(target / name):
                os.rename(new / name, target / name)
        discard_copy(new, target)
        raise
    if swapped:
        fsync_dir(target.parent)
        pause("swapped")
        discard_copy(new, target)  # the old copy
        return
    refuse_link(target, "where merit prepares data")
    old = _move_aside(target, target, "old")
    try:
        rename_new(new, target)
    except BaseException:  # another process's copy took the name meanwhile: the user's entries go there
        if not os.path.lexists(target):
            os.rename(old, target)
        else:
            discard_copy(old, target)
        discard_copy(new, target)
        raise
    fsync_dir(target.parent)
    pause("swapped")
    discard_copy(old, target)


def discard_copy(copy: Path, target: Path) -> list[str]:
    """Remove a copy of prepared data that `target` no longer is: merit's entries are deleted; any
    other entry (a user's file, moved there by a publish of another process running at the same
    time) is moved back into `target` when its name is free there, else kept where it is, with the
    folder. Returns the names kept. Nothing but merit's own entries is ever deleted."""
    pause("before-discard")
    kept: list[str] = []
    try:
        names = sorted(os.listdir(copy))
    except FileNotFoundError:
        return kept
    for name in names:
        path = copy / name
        if name in _STAGING_ENTRIES:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            continue
        try:
            rename_new(path, target / name)
        except (OSError, UnsafePath):
            kept.append(name)
    if not kept:
        with contextlib.suppress(OSError):
            os.rmdir(copy)
    if kept:
        fsync_dir(copy)
    fsync_dir(target)
    return kept


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
            pid = child.name[len(prefix) :].split(".")[0]
            if not (pid.isascii() and pid.isdigit()) or pid_alive(int(pid)) or child.is_symlink() or not child.is_dir():
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


# The lock files this process holds, by thread: `build_lock` and `writer_lock` taken again inside
# a block that holds one (a cache builder calling prepare) do not wait for themselves.
_held = threading.local()


def _holding() -> set[str]:
    if not hasattr(_held, "paths"):
        _held.paths = set()
    return _held.paths


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive file lock beside `target` (POSIX; a no-op elsewhere), waiting for it, e.g.
    across DDP ranks or two processes filling one cache entry.

    The lock file is removed when released (merit_core.file_locks.FileLock), so none is left behind.
    """
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - Windows
        yield
        return

    target.parent.mkdir(parents=True, exist_ok=True)
    key = str(lock_path(target))
    if key in _holding():
        yield
        return
    with exclusive_lock(lock_path(target)):
        _holding().add(key)
        try:
            yield
        finally:
            _holding().discard(key)


@contextlib.contextmanager
def writer_lock(target: Path) -> Iterator[None]:
    """The one writer of the prepared folder `target`: the lock `build_lock` takes, taken at once
    or refused (RunBusy naming the holder's PID), as `merit train` refuses a second writer of a
    run folder. Held already by this thread (a cache builder waited for it), it is simply kept."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - Windows
        yield
        return

    key = str(lock_path(target))
    if key in _holding():
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path(target))
    if not lock.acquire(wait=False):
        pid = lock.holder()
        who = f"merit process {pid}" if pid else "another merit process"
        raise RunBusy(f"{target} is being prepared by {who}; wait for it to finish (one writer per folder)")
    _holding().add(key)
    try:
        yield
    finally:
        _holding().discard(key)
        lock.release()


def lock_path(target: Path) -> Path:
    """The lock file `build_lock` uses for `target`."""
    return target.with_name(f".{target.name}.lock")
