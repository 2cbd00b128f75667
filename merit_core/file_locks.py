"""File locks: one writer per run folder, one builder per cached folder.

`FileLock` is an fcntl lock on a file holding the owner's PID; a process that dies releases it
with it, so a lock file left behind is taken over (`remove_stale_lock` deletes one nobody holds).
`pid_alive` tells whether the PID a lock or a staging marker names still runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from merit_core.durable_writes import file_mode, refuse_link
from merit_core.errors import UnsafePath
from merit_core.file_reading import special_file


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
