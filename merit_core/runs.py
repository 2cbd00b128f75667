"""The run folder of `merit train`: the one module that knows its layout and how it is written.

Layout::

    <run>/.merit-run            the marker: this folder is a merit run (JSON: format, created)
    <run>/.merit-run.lock       the writer's lock (fcntl) and its PID while a run holds it
    <run>/config.toml           the resolved configuration
    <run>/metrics.jsonl         log and eval records
    <run>/step_<N>/             a checkpoint: config.json, model.safetensors, tokenizer files,
                                trainer_state.json and trainer_state.pt (see train/checkpoint.py)
    <run>/.tmp-step_<N>/        a checkpoint being written (holds the `.merit-staging` marker)

What counts as a checkpoint, at three levels (one rule for "latest": the highest N among the
`step_<N>` folders at the level asked for):
- `has_weights`: the tensors are there (model.safetensors or its sharded index): what inspect reads;
- `has_model`: config.json and weights: a Hugging Face model folder, what eval loads;
- `is_complete`: a model plus both trainer-state files: what `merit train --resume` continues.
merit renames a checkpoint into place only when it is complete, so its own step folders are
complete or absent; the lower levels are for folders other tools wrote.

Writes are durable: a file is written to a temp file in the same folder, fsynced, renamed, and
the folder fsynced (`atomic_write`); a checkpoint folder is fsynced file by file before its
rename (`publish_folder`). Files get the user's umask (not the 0600 of temp-file helpers).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from merit_core.errors import CheckpointError, ConfigError, MeritError

RUN_MARKER = ".merit-run"
RUN_FORMAT = "merit-run-v1"
LOCK_FILE = ".merit-run.lock"
CONFIG_FILE = "config.toml"
CONFIG_HEADER = "# merit train: resolved run configuration"
STATE_JSON = "trainer_state.json"
STATE_PT = "trainer_state.pt"
STATE_FORMAT = "merit-trainer-v1"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODEL_CONFIG = "config.json"
TMP_PREFIX = ".tmp-"
STAGING_MARKER = ".merit-staging"
# Files that make a folder's tokenizer (what a checkpoint copies from the prepared data, what eval needs).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
_STEP = re.compile(r"^step_(\d+)$")
_STAGING = re.compile(r"^\.tmp-(old-)?step_(\d+)$")


class RunBusy(MeritError):
    """Another process holds the run folder's lock."""


class DiskFull(MeritError):
    """The disk filled up while merit was writing."""


class RunInterrupted(Exception):
    """Training stopped on a signal after saving; `exit_code` is 143 (SIGTERM/SIGUSR1) or 130 (SIGINT)."""

    def __init__(self, message: str, exit_code: int, checkpoint: Path | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


# -- step folders ------------------------------------------------------------------------------
def step_name(step: int) -> str:
    return f"step_{step}"


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / step_name(step)


def parse_step(name: str) -> int | None:
    """N for a folder name `step_N`, else None."""
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def step_folders(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step_N` subfolder as (N, path), lowest N first, whatever it holds."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def has_weights(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / WEIGHTS_NAME).is_file() or (folder / INDEX_NAME).is_file()


def has_model(folder: str | Path) -> bool:
    return (Path(folder) / MODEL_CONFIG).is_file() and has_weights(folder)


def is_complete(folder: str | Path) -> bool:
    folder = Path(folder)
    return has_model(folder) and (folder / STATE_JSON).is_file() and (folder / STATE_PT).is_file()


LEVELS: dict[str, Callable[[Path], bool]] = {"weights": has_weights, "model": has_model, "complete": is_complete}


def checkpoints(run_dir: str | Path, level: str = "complete") -> list[tuple[int, Path]]:
    """The `step_N` folders that are checkpoints at `level` ('weights', 'model', 'complete'), oldest first."""
    ok = LEVELS[level]
    return [(step, path) for step, path in step_folders(run_dir) if ok(path)]


def latest(run_dir: str | Path, level: str = "complete") -> Path | None:
    """The checkpoint at `level` with the highest step, or None."""
    found = checkpoints(run_dir, level)
    return found[-1][1] if found else None


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer files present in `folder` (see TOKENIZER_FILES)."""
    folder = Path(folder)
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


# -- trainer state -----------------------------------------------------------------------------
def read_trainer_state(folder: str | Path, *, strict: bool = True) -> dict[str, Any]:
    """trainer_state.json of a checkpoint folder as a dict.

    strict: a missing or unreadable file raises CheckpointError (what resume needs); otherwise
    it gives {} (what eval and inspect want: the metadata is optional there).
    """
    path = Path(folder) / STATE_JSON
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        if strict:
            raise CheckpointError(f"{folder} is not a merit checkpoint (no {STATE_JSON})") from None
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if strict:
            raise CheckpointError(f"{path} is unreadable: {exc}") from None
        return {}
    return state


def state_step(folder: str | Path) -> int | None:
    """The step a checkpoint folder says it holds (its trainer_state.json, else its `step_N` name)."""
    step = read_trainer_state(folder, strict=False).get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return parse_step(Path(folder).name)


# -- durable writes ----------------------------------------------------------------------------
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


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    A temp file in the same folder, fsynced, renamed over `path`, then the folder fsynced. The
    file gets the user's umask. ENOSPC becomes DiskFull naming `path`; the temp file is removed.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # 0o666 & ~umask
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DiskFull(f"disk full while writing {path}") from None
        raise
    fsync_dir(path.parent)
    return path


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
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{what} {path}: the file is not writable")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: cannot write into {parent}")
    return out


def check_writable_folder(path: str | Path, what: str) -> Path:
    """ConfigError unless `path` is a writable folder or can be created as one."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} {path}: exists and is not a folder")
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{what} {path}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: cannot write into {probe}")
    return folder


@contextlib.contextmanager
def disk_full_guard(what: str | Path, last_checkpoint: Path | None) -> Iterator[None]:
    """Turn ENOSPC inside the block into one line naming what was written and what is safe."""
    try:
        yield
    except DiskFull as exc:
        raise DiskFull(f"{exc}; {_last_good(last_checkpoint)}") from None
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise DiskFull(f"disk full while writing {what}; {_last_good(last_checkpoint)}") from None
    except RuntimeError as exc:  # torch.save reports a full disk as a RuntimeError from its writer
        if "No space left" not in str(exc) and "file write failed" not in str(exc):
            raise
        raise DiskFull(f"disk full while writing {what}; {_last_good(last_checkpoint)}") from None


def _last_good(checkpoint: Path | None) -> str:
    return f"the last complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"


# -- checkpoint staging --------------------------------------------------------------------------
def begin_staging(run_dir: str | Path, step: int) -> Path:
    """An empty, marked staging folder `<run>/.tmp-step_<step>/` for a checkpoint being written."""
    tmp = Path(run_dir) / f"{TMP_PREFIX}{step_name(step)}"
    _remove_if_ours(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / STAGING_MARKER).write_text(f"{os.getpid()}\n")
    return tmp


def publish_folder(tmp: Path, final: Path) -> Path:
    """Make the staged folder `tmp` durable (fsync every file, then the folder) and rename it to `final`.

    An existing `final` (a rewrite of the same step) is replaced whole. The staging marker is
    removed before the rename, so the published folder holds only the checkpoint's files.
    """
    (tmp / STAGING_MARKER).unlink(missing_ok=True)
    mode = file_mode()
    for item in tmp.rglob("*"):
        if item.is_file() and not item.is_symlink():
            if item.stat().st_mode & 0o777 != mode:
                os.chmod(item, mode)  # some writers (safetensors, torch) leave 0600
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif item.is_dir():
            fsync_dir(item)
    os.chmod(tmp, folder_mode())
    fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        _remove_if_ours(old)
        (final / STAGING_MARKER).write_text(f"{os.getpid()}\n")  # the old copy is ours to delete
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def _remove_if_ours(folder: Path) -> bool:
    """Delete `folder` if it is a staging folder merit made (its name and marker say so), or empty."""
    if not folder.is_dir() or folder.is_symlink() or not _STAGING.match(folder.name):
        return False
    if (folder / STAGING_MARKER).is_file():
        shutil.rmtree(folder, ignore_errors=True)
        return True
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when empty
        return True
    return False


def remove_stale_staging(run_dir: str | Path) -> list[Path]:
    """Delete what a crash left while writing checkpoints: merit's own `.tmp-step_N` folders only.

    Call it while holding the run's lock (no other writer can be staging then).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [child for child in list(run_dir.iterdir()) if _remove_if_ours(child)]


# -- the run marker and --out --------------------------------------------------------------------
def is_run(folder: str | Path) -> bool:
    """True when `folder` is a merit run: its marker, or (runs of merit before the marker) a
    config.toml that merit wrote."""
    folder = Path(folder)
    if (folder / RUN_MARKER).is_file():
        return True
    try:
        with (folder / CONFIG_FILE).open(encoding="utf-8") as fh:
            return fh.readline().rstrip("\n") == CONFIG_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def check_out(folder: str | Path) -> Path:
    """ConfigError unless `folder` may hold a run: absent, empty, or a merit run. Writes nothing."""
    folder = Path(folder).expanduser()
    check_writable_folder(folder, "--out")
    if not folder.exists() or is_run(folder):
        return folder
    entries = sorted(p.name for p in folder.iterdir())
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"--out {folder} holds files that are not a merit run ({shown}); "
            "give an empty or new folder (merit never writes into folders it did not make)"
        )
    return folder


def mark_run(folder: str | Path) -> None:
    """Create the run folder (if needed) and its marker (kept when already there)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / RUN_MARKER).is_file():
        record = {"format": RUN_FORMAT, "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        atomic_write_json(folder / RUN_MARKER, record)


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
            try:  # O_NOFOLLOW: a link planted at the lock's name would have us truncate its target
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, file_mode())
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise ConfigError(f"{self.path} is a symbolic link; merit does not follow it: remove it") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def holder(self) -> int | None:
        """The PID written in the lock file (the holder, when it is held)."""
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still locked: a waiter then sees a new inode and retries
        os.close(self.fd)
        self.fd = None


def lock_run(run_dir: str | Path) -> FileLock:
    """Take the run folder's writer lock at once, or raise RunBusy naming the holder's PID."""
    lock = FileLock(Path(run_dir) / LOCK_FILE)
    if not lock.acquire(wait=False):
        pid = lock.holder()
        who = f"merit process {pid}" if pid else "another merit process"
        raise RunBusy(f"{run_dir} is in use by {who}; wait for it to finish or stop it (one writer per run folder)")
    return lock


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
