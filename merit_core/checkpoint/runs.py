"""The run folder of `merit train`: the one module that knows its layout and how it is written.

Layout::

    <run>/.merit-run            the marker: this folder is a merit run (JSON: format, created)
    <run>/.merit-run.lock       the writer's lock (fcntl) and its PID while a run holds it
    <run>/config.toml           the resolved configuration
    <run>/metrics.jsonl         log and eval records
    <run>/step_<N>/             a checkpoint: config.json, model.safetensors, tokenizer files,
                                trainer_state.json and trainer_state.pt (see checkpoint/state.py, tensors.py)
    <run>/.tmp-step_<N>/        a checkpoint being written (holds the `.merit-staging` marker)

What counts as a checkpoint, at three levels (one rule for "latest": the highest N among the
`step_<N>` folders at the level asked for, which merit_core.checkpoint.resolve picks):
- `has_weights`: the tensors are there (model.safetensors or its sharded index): what inspect reads;
- `has_model`: config.json and weights: a Hugging Face model folder, what eval loads;
- `is_complete`: a model plus both trainer-state files: what `merit train --resume` continues.
merit renames a checkpoint into place only when it is complete, so its own step folders are
complete or absent; the lower levels are for folders other tools wrote.

Every other module takes these file names from here (the constants below) rather than
spelling them. Writes are durable (merit_core.durable_writes: a temp file in the same folder, fsynced,
renamed, the folder fsynced); a checkpoint folder is fsynced file by file before its rename
(`publish_folder`). Files get the user's umask (not the 0600 of temp-file helpers).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from merit_core.checkpoint.state import STATE_JSON
from merit_core.durable_writes import (
    STAGING_MARKER,
    TMP_PREFIX,
    atomic_write_json,
    create_new,
    file_mode,
    folder_mode,
    fsync_dir,
    fsync_file,
    refuse_link,
)
from merit_core.errors import ConfigError, RunBusy, UnsafePath
from merit_core.file_locks import FileLock
from merit_core.metrics import METRICS_FILE  # the metrics log is metrics.py's
from merit_core.output_checks import check_writable_folder, refuse_foreign_entries

RUN_MARKER = ".merit-run"
RUN_FORMAT = "merit-run-v1"
LOCK_FILE = ".merit-run.lock"
CONFIG_FILE = "config.toml"
CONFIG_HEADER = "# merit train: resolved run configuration"
STATE_PT = "trainer_state.pt"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODEL_CONFIG = "config.json"
CURVES_FILE = "curves.png"
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


def check_new_run(run_dir: str | Path) -> None:
    """ConfigError when `run_dir` already holds complete checkpoints: a new run there (no --resume)
    would mix its checkpoints with another run's."""
    if checkpoints(run_dir, "complete"):
        raise ConfigError(
            f"{run_dir} already holds checkpoints; pass --resume to continue that run or choose another --out"
        )


def missing_step_hint(path: str | Path) -> str:
    """For a `step_N` path that does not exist inside a run folder: '; RUN has step_5, step_10' (the
    checkpoints with weights it does have), so that a mistyped step is one look away. Else ''."""
    path = Path(path)
    if parse_step(path.name) is None or not path.parent.is_dir():
        return ""
    found = [p.name for _, p in checkpoints(path.parent, "weights")]
    if not found:
        return f"; {path.parent} has no checkpoint yet" if is_run(path.parent) else ""
    shown = found if len(found) <= 8 else [*found[:3], "...", *found[-4:]]
    return f"; {path.parent} has {', '.join(shown)}"


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer files present in `folder` (see TOKENIZER_FILES)."""
    folder = Path(folder)
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


# -- checkpoint staging --------------------------------------------------------------------------
def begin_staging(run_dir: str | Path, step: int) -> Path:
    """An empty, marked staging folder `<run>/.tmp-step_<step>/` for a checkpoint being written.

    Made with mkdir (which never follows a link): a symbolic link planted at the name, or a folder
    merit did not make, is refused (UnsafePath names it) rather than written into.
    """
    tmp = Path(run_dir) / f"{TMP_PREFIX}{step_name(step)}"
    refuse_link(tmp, "in a run folder")
    _remove_if_ours(tmp)
    try:
        os.mkdir(tmp)
    except FileExistsError:
        raise UnsafePath(f"{tmp} exists and merit did not make it (no staging marker); move it away") from None
    _mark(tmp)
    return tmp


def _mark(folder: Path) -> None:
    """Write the staging marker (our PID) into a folder merit made: its contents are merit's to delete."""
    fd = create_new(folder / STAGING_MARKER)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def publish_folder(tmp: Path, final: Path) -> Path:
    """Make the staged folder `tmp` durable (fsync every file, then the folder) and rename it to `final`.

    An existing `final` (a rewrite of the same step) is replaced whole: it is marked and renamed to
    `.tmp-old-step_N`, the new copy renamed into place, then the old one deleted. The staging
    marker stays in `tmp` until after its rename and is removed from `final` last, so at every
    instant a crash leaves either the published step or a marked, complete copy that
    `recover_staging` restores (never two unmarked copies, never none). Only files inside the
    folder merit staged get their mode set; a `final` that is a symbolic link is refused.
    """
    refuse_link(final, "in a run folder")
    mode = file_mode()
    for root, dirs, files in os.walk(tmp):  # os.walk does not follow links into other folders
        for name in files:
            item = Path(root) / name
            if item.is_symlink():
                continue
            if item.stat().st_mode & 0o777 != mode:
                os.chmod(item, mode)  # some writers (safetensors, torch) leave 0600
            fsync_file(item)
        for name in dirs:
            fsync_dir(Path(root) / name)
    os.chmod(tmp, folder_mode())
    fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        refuse_link(old, "in a run folder")
        _remove_if_ours(old)
        if not (final / STAGING_MARKER).exists():
            _mark(final)  # the old copy is ours to delete, and to restore if we die before the next rename
        fsync_dir(final)
        os.replace(final, old)
        fsync_dir(final.parent)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)
    (final / STAGING_MARKER).unlink(missing_ok=True)
    fsync_dir(final)
    return final


def set_aside_later_checkpoints(run_dir: str | Path, step: int) -> tuple[Path, list[str]] | None:
    """Move the `step_N` folders with N > `step` into `<run>/abandoned-after-step_<step>-<time>/`.

    A resume from `step` starts a new timeline: checkpoints past it belong to the abandoned one.
    Left in place they would outrank the new checkpoints in pruning (which keeps the highest
    steps) and in the next --resume; deleted they would be lost. Returns the folder and the names
    moved, or None when there were none. Call it while holding the run's lock.
    """
    run_dir = Path(run_dir)
    later = [path for n, path in step_folders(run_dir) if n > step]
    if not later:
        return None
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    dest = run_dir / f"abandoned-after-{step_name(step)}-{stamp}"
    suffix = 0
    while os.path.lexists(dest):
        suffix += 1
        dest = run_dir / f"abandoned-after-{step_name(step)}-{stamp}-{suffix}"
    os.mkdir(dest)
    for path in later:
        os.replace(path, dest / path.name)  # a rename moves a link itself, never what it points to
    fsync_dir(dest)
    fsync_dir(run_dir)
    return dest, [p.name for p in later]


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


def recover_staging(run_dir: str | Path) -> list[str]:
    """Undo what a crash in the middle of `publish_folder` left, without deleting any checkpoint.

    - `.tmp-old-step_N` (marked) with no `step_N`: the crash came between the two renames of a
      rewrite; the old copy is complete and is renamed back to `step_N`.
    - a marker inside a published `step_N` (a crash just before or after its rename): removed.
    Returns one note per folder restored. Call it while holding the run's lock, before the
    checkpoints are listed (what a resume continues from depends on it).
    """
    run_dir = Path(run_dir)
    notes: list[str] = []
    if not run_dir.is_dir():
        return notes
    for child in sorted(run_dir.iterdir()):
        match = _STAGING.match(child.name)
        if not (match and match.group(1)) or child.is_symlink() or not (child / STAGING_MARKER).is_file():
            continue
        final = step_path(run_dir, int(match.group(2)))
        if os.path.lexists(final) or not is_complete(child):
            continue  # the rewrite finished (remove_stale_staging deletes the old copy) or never began
        os.replace(child, final)
        fsync_dir(run_dir)
        notes.append(f"restored {final.name} from {child.name}, left by a checkpoint rewrite that was interrupted")
    for _, folder in step_folders(run_dir):
        marker = folder / STAGING_MARKER
        if not folder.is_symlink() and marker.is_file() and not marker.is_symlink():
            marker.unlink()
    return notes


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
    """ConfigError unless `folder` may hold a run: absent, empty, or a merit run. Writes nothing.

    A dangling symbolic link is refused (merit would have to create its target); the user's link
    itself is left alone. In an existing run, links planted at the names merit writes are refused
    (`check_no_planted_links`)."""
    folder = Path(folder).expanduser()
    if folder.is_symlink() and not folder.exists():
        raise ConfigError(
            f"--out {folder} is a symbolic link to {os.readlink(folder)}, which does not exist; "
            "create that folder or give another --out"
        )
    check_writable_folder(folder, "--out")
    if not folder.exists() or is_run(folder):
        return folder
    refuse_foreign_entries(folder, sorted(p.name for p in folder.iterdir()), "a merit run")
    return folder


def _written_by_merit(name: str) -> bool:
    return (
        name in (RUN_MARKER, LOCK_FILE, CONFIG_FILE, METRICS_FILE, CURVES_FILE)
        or parse_step(name) is not None
        or name.startswith(TMP_PREFIX)
    )


def check_no_planted_links(folder: str | Path) -> None:
    """UnsafePath naming the first symbolic link in a run folder at a name merit writes or deletes
    (config.toml, metrics.jsonl, curves.png, the marker and lock, step_N, .tmp-*): merit would
    otherwise write, rename or prune through it, into a place outside the run."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_symlink() and _written_by_merit(entry.name):
            refuse_link(entry.path, "in a run folder")


def mark_run(folder: str | Path) -> None:
    """Create the run folder (if needed) and its marker (kept when already there)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / RUN_MARKER).is_file():
        record = {"format": RUN_FORMAT, "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        atomic_write_json(folder / RUN_MARKER, record)


# -- the writer's lock ----------------------------------------------------------------------------
def lock_run(run_dir: str | Path) -> FileLock:
    """Take the run folder's writer lock at once, or raise RunBusy naming the holder's PID."""
    lock = FileLock(Path(run_dir) / LOCK_FILE)
    if not lock.acquire(wait=False):
        pid = lock.holder()
        who = f"merit process {pid}" if pid else "another merit process"
        raise RunBusy(f"{run_dir} is in use by {who}; wait for it to finish or stop it (one writer per run folder)")
    return lock
