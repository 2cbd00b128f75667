"""Durable writes: atomic writes, fsync, renames that never replace, the umask modes and the disk-full guard.

What merit writes is written so that a crash or a full disk never leaves half a file:
`atomic_write` writes a temp file in the same folder, fsyncs it, renames it over the target and
fsyncs the folder; `atomic_path` does the same for writers that want a path (matplotlib,
tokenizers). New files and folders get the user's umask (not the 0600 of temp-file helpers).
Nothing is written through a symbolic link or into a FIFO planted at a name. This module knows no
file names: the run folder's layout is merit_core.checkpoint.runs's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from merit_core.errors import ConfigError, DiskFull, UnsafePath
from merit_core.file_reading import display, special_file

# The name prefix of a file or folder still being written (readers and cleaners skip it).
TMP_PREFIX = ".tmp-"
# The marker (holding the writer's PID) inside a folder merit is staging: its contents are merit's to delete.
STAGING_MARKER = ".merit-staging"


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets under the user's umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def folder_mode() -> int:
    """The mode a new folder gets under the user's umask (0755 under the usual 022)."""
    return 0o777 & ~_umask()


def fsync_dir(path: str | Path) -> None:
    """Make a folder's entries (a rename, a new file) durable; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Make a written file's contents durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under `folder` (itself included), e.g. before it is renamed into
    place: a rename is durable only when what it names already is."""
    for dirpath, _dirs, filenames in os.walk(folder):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(dirpath)


_RENAME_NOREPLACE = 1  # linux/fs.h
_RENAME_EXCHANGE = 2


def _renameat2(a: str | Path, b: str | Path, flag: int) -> bool:
    """renameat2(a, b, flag); False when this system or file system has no such call or flag."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def exchange_paths(a: str | Path, b: str | Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE): a reader of
    either name sees the old entry or the new one, never none. False when this system or file
    system cannot (the caller then falls back to two renames)."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_new(src: str | Path, dst: str | Path) -> None:
    """Rename `src` to `dst`, a name that must be free: a file, folder or symbolic link at `dst`
    (another process's copy, or one planted by someone who guessed the name) is never replaced;
    UnsafePath names it. Atomic (renameat2 RENAME_NOREPLACE) where the system has it; elsewhere
    a check just before os.rename, which cannot replace a non-empty folder either."""
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        pass
    else:
        if not os.path.lexists(dst):
            os.rename(src, dst)
            return
    refuse_link(dst)
    raise UnsafePath(f"{display(dst)} already exists and merit did not just make it; remove it")


def _temp_name(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")


def _disk_full(exc: BaseException, path: Path) -> None:
    if is_disk_full(exc):
        raise DiskFull(f"disk full while writing {path}") from None


# What the libraries that write merit's files say when the disk (or the quota) is full: the OS error
# numbers, torch.save's zip writer ("file write failed", "unexpected pos" after a short write), and
# safetensors' Rust I/O error ("No space left on device", StorageFull, os error 28).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = (
    "No space left",
    "Disk quota exceeded",
    "StorageFull",
    "os error 28",
    "file write failed",
    "unexpected pos",
)


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` reports a full disk or quota, whichever library raised it."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        return False
    return isinstance(exc, Exception) and any(text in str(exc) for text in _DISK_FULL_TEXT)


def refuse_link(path: str | Path, where: str = "where merit writes") -> None:
    """UnsafePath when `path` is a symbolic link (dangling or not): merit never writes through one."""
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise UnsafePath(f"{path} is a symbolic link (to {target}); merit never follows links {where}: remove it")


def create_new(path: str | Path, mode: int = 0o666) -> int:
    """Create `path` as a new, empty file and return a descriptor open for writing.

    O_EXCL | O_NOFOLLOW: a file, folder or symbolic link already at `path` (planted by someone who
    guessed the name) is never written through, truncated or replaced; UnsafePath names it.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        refuse_link(path)
        raise UnsafePath(f"{path} already exists and merit did not just make it; remove it") from None


def refuse_special(path: str | Path) -> None:
    """UnsafePath when `path` is a FIFO, socket or device (see `special_file`): opening one to
    write could block or write elsewhere."""
    what = special_file(path)
    if what is not None:
        raise UnsafePath(f"{path} is {what}; merit writes only regular files there: remove it")


def open_truncated(path: str | Path, mode: int = 0o666) -> int:
    """A descriptor open for writing on `path`, created or emptied: for a file merit owns and
    rewrites whole, such as a log. O_NOFOLLOW: a symbolic link planted at `path` is never
    written through (UnsafePath names it), nor is a FIFO, socket or device."""
    refuse_link(path)
    refuse_special(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link planted between the check and the open
            refuse_link(path)
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temp path beside `path` for a writer that wants a file name (a plot, a tokenizer file).

    When the block ends normally the temp file gets the user's umask, is fsynced and renamed over
    `path`, and the folder is fsynced; on an error it is removed. ENOSPC becomes DiskFull.
    """
    path = Path(path)
    tmp = _temp_name(path)
    try:  # claimed as a new regular file: a link planted at the name is refused (and left alone)
        os.close(create_new(tmp))
    except OSError as exc:
        _disk_full(exc, path)
        raise
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _disk_full(exc, path)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    A temp file in the same folder, fsynced, renamed over `path`, then the folder fsynced (see
    `atomic_path`). The file gets the user's umask. ENOSPC becomes DiskFull naming `path`; the
    temp file is removed.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))  # the file atomic_path made
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    return Path(path)


def write_new_file(folder: str | Path, names: Iterator[str], data: str | bytes) -> Path:
    """Write `data` durably under the first of `names` that is free in `folder` and return its path.

    The file is written whole as a temp file of a name no other writer can pick, fsynced, then
    renamed to a name with `rename_new`, which never replaces anything: two processes choosing a
    name at the same moment get one name each, never one file between them (a name taken by then,
    or a link planted there, is skipped). ENOSPC becomes DiskFull. ConfigError when `names` runs out."""
    folder = Path(folder)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = folder / f"{TMP_PREFIX}new.{os.getpid()}.{os.urandom(6).hex()}"
    try:
        fd = create_new(tmp, file_mode())
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        for name in names:
            try:
                rename_new(tmp, folder / name)
            except UnsafePath:
                continue
            fsync_dir(folder)
            return folder / name
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _disk_full(exc, folder)
        raise
    with contextlib.suppress(OSError):
        tmp.unlink()
    raise ConfigError(f"no free file name left in {display(folder)}")


def atomic_write_json(path: str | Path, value: Any, **dumps: Any) -> Path:
    """`atomic_write` of `json.dumps(value, **dumps)` plus a final newline."""
    return atomic_write(path, json.dumps(value, **dumps) + "\n")


@contextlib.contextmanager
def disk_full_guard(what: str | Path, last_checkpoint: Path | None) -> Iterator[None]:
    """Turn ENOSPC inside the block into one line naming what was written and what is safe."""
    try:
        yield
    except DiskFull as exc:
        raise DiskFull(f"{exc}; {_last_good(last_checkpoint)}") from None
    except Exception as exc:  # OSError, torch.save's RuntimeError, safetensors' SafetensorError, ...
        if not is_disk_full(exc):
            raise
        raise DiskFull(f"disk full while writing {what}; {_last_good(last_checkpoint)}") from None


def _last_good(checkpoint: Path | None) -> str:
    return f"the last complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
