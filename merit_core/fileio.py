"""Durable file I/O: atomic writes, fsync, the umask modes, file locks and the disk-full guard.

What merit writes is written so that a crash or a full disk never leaves half a file:
`atomic_write` writes a temp file in the same folder, fsyncs it, renames it over the target and
fsyncs the folder; `atomic_path` does the same for writers that want a path (matplotlib,
tokenizers). New files and folders get the user's umask (not the 0600 of temp-file helpers).
`FileLock` is the fcntl lock behind one writer per run folder and one builder per cached
folder. This module knows no file names: the run folder's layout is merit_core.checkpoint.runs's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from merit_core.errors import CheckpointError, ConfigError, DataError, DiskFull, MeritError, UnsafePath, printable

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


def pid_alive(pid: int) -> bool:
    """True when a process with this PID exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    _check_creatable(out.parent, path, what)
    if out.parent.is_dir():  # the file is written as a temp file beside it, then renamed: try that now
        probe = out.parent / f"{TMP_PREFIX}check.{os.getpid()}"
        try:
            os.close(create_new(probe))
            os.unlink(probe)
        except (OSError, UnsafePath) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"{what} {path}: cannot make a file in {out.parent} ({why})") from None
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


def short(path: str | os.PathLike, limit: int = 80) -> str:
    """A path for a one-line message: printable (see `display`) and cut to `limit` characters."""
    text = display(path)
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-17:]}"


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
    """ConfigError unless the nearest existing ancestor of `folder` (or itself) is a writable folder."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{what} {given}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {given}: cannot write into {probe}")


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


# -- locks -------------------------------------------------------------------------------------
class FileLock:
    """An exclusive fcntl lock on `path` holding the owner's PID; the file is removed on release.

    Written here rather than taken from the filelock package, which does not promise to leave a
    symbolic link at `path` alone: this one refuses it (O_NOFOLLOW), so a planted link cannot make
    the lock truncate another file.

    A process that dies releases its lock with it (the kernel drops fcntl locks), so a lock
    file left by a dead process is simply taken over. Acquiring checks that the locked file is
    still the one at `path` (a releaser may have unlinked it meanwhile) and retries if not.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self, wait: bool = False) -> bool:
        import fcntl

        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def _open(self) -> int:
        """The lock file opened for writing, created if absent; never through a link, never a non-file.

        A symbolic link planted at the lock's name would otherwise have merit truncate its target
        and write a PID into it; a FIFO would block; a folder would fail with a traceback."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, file_mode())
        except OSError as exc:
            refuse_link(self.path)
            if exc.errno == errno.EISDIR or self.path.is_dir():
                raise UnsafePath(f"{self.path} is a folder, not merit's lock file; remove it") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePath(
                f"{self.path} is {special_file(self.path) or 'not a regular file'}, not merit's lock file; remove it"
            )
        os.set_blocking(fd, True)
        return fd

    def holder(self) -> int | None:
        """The PID written in the lock file (the holder, when it is held)."""
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags)
            try:
                return int(os.read(fd, 64).split()[0]) if stat.S_ISREG(os.fstat(fd).st_mode) else None
            finally:
                os.close(fd)
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino:  # only the file this lock made or took
                self.path.unlink()  # while still locked: a waiter then sees a new inode and retries
        os.close(self.fd)
        self.fd = None


@contextlib.contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold `FileLock(path)`, waiting for it (e.g. one builder of a cached folder at a time)."""
    lock = FileLock(path)
    lock.acquire(wait=True)
    try:
        yield
    finally:
        lock.release()


def remove_stale_lock(path: str | Path) -> bool:
    """Delete a lock file nobody holds (what a process killed before releasing left behind)."""
    lock = FileLock(path)
    if not Path(path).exists():
        return False
    if lock.acquire(wait=False):
        lock.release()
        return True
    return False


# -- reading files someone else wrote --------------------------------------------------------------
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
