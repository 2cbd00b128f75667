"""`RunFolder`: the one writer of a training run's folder, and its one verified restore.

A run folder (its layout is merit_core.checkpoint.runs') is written during training by this
module alone: it takes the folder (the marker, the writer's lock, what a failure before the first
write undoes), recovers or removes what a crash left staged, writes config.toml, appends to and
cuts back metrics.jsonl, saves a checkpoint (staged, published, old ones pruned; the files of one
checkpoint are merit_core.checkpoint.writer's), draws curves.png, and restores a checkpoint into
a running trainer. `TrainingRun` (training_run.py) keeps the cadence loop and asks this object
for every write; the watcher (run_watch.py) writes nothing.

`restore` is the one way back to a checkpoint: `merit train --resume` and the watcher's rewind
both go through it, so a rewind is exactly a resume with another lr. It reads trainer_state.json
and trainer_state.pt and checks them whole, verifies the files against their recorded checksums
(unless --no-verify), loads the weights into the wrapped model (under fsdp each process keeps its
shard) and the optimizer, RNG and data position into the trainer (under fsdp the sharded
optimizer state through torch.distributed.checkpoint). `continue_from` then starts the new
timeline: later checkpoints set aside, config.toml rewritten, metrics.jsonl cut back to the
checkpoint's step.

Under several processes every process calls every method (some are collective); only the main
process writes files.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.checkpoint.runs import CONFIG_FILE, CURVES_FILE
from merit_core.checkpoint.state import TrainerState
from merit_core.checkpoint.writer import prune_checkpoints, save_checkpoint
from merit_core.durable_writes import atomic_write, disk_full_guard
from merit_core.errors import CheckpointError, MeritError
from merit_core.file_locks import FileLock
from merit_core.metrics import MetricsLog
from merit_core.train.config import TrainConfig, config_toml
from merit_core.train.distributed import Parallel, shared
from merit_core.train.plots import plot_curves
from merit_core.train.resume import ResumePlan, load_resumable, plan_resume, to_device
from merit_core.train.trainer import Trainer


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write `config` as config.toml's text (merit_core.train.config.config_toml) to `path`, atomically."""
    atomic_write(path, config_toml(config))


class RunFolder:
    """The folder `path` of one training run on the processes of `parallel`; `note` says one line
    to the user (a restored staging folder, a checkpoint set aside, a fallback on resume)."""

    def __init__(self, path: Path, parallel: Parallel, note: Callable[[str], None]):
        self.path = path
        self.parallel = parallel
        self.note = note
        self.lock: FileLock | None = None
        self.created: list[Path] = []  # what taking the folder made (undone on a failure before the first write)
        self.metrics = MetricsLog(path)
        self.tokenizer_dir: Path | None = None  # the prepared data's tokenizer, copied into each checkpoint
        self.last_ckpt: Path | None = None  # the newest checkpoint of this run (what a failure leaves)
        self.last_saved_step: int | None = None
        self.saved_at = time.monotonic()

    # -- taking the folder, before anything is written -----------------------------------------
    def take(self, config: TrainConfig) -> ResumePlan:
        """Check the folder, take it (RunBusy if another writer holds it) and return what a resume
        continues from. Main process only (`shared` gives the plan to the others)."""
        runs.check_out(self.path)
        runs.check_no_planted_links(self.path)  # never write, rename or prune through a link in the run
        self._take()  # a second writer stops here; what it made is undone if a check below fails
        for line in runs.recover_staging(self.path):  # a rewrite killed between its renames
            self.note(line)
        if not config.resume:
            runs.check_new_run(self.path)
        return plan_resume(config, self.path)

    def _take(self) -> None:
        """Create the run folder and its marker if needed, and take its writer lock (RunBusy if held)."""
        missing, folder = [], self.path
        while not os.path.lexists(folder) and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        self.created.extend(reversed(missing))  # outermost first
        if not missing and not (self.path / runs.RUN_MARKER).exists():
            self.created.append(self.path / runs.RUN_MARKER)
        runs.mark_run(self.path)
        self.lock = runs.lock_run(self.path)

    def release(self, failed_before_writing: bool) -> None:
        """Drop the lock; after a failure before the first write, also remove what `take` made."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if failed_before_writing:
            for path in reversed(self.created):
                with contextlib.suppress(OSError):
                    if path == self.path:
                        (path / runs.RUN_MARKER).unlink(missing_ok=True)
                    path.rmdir() if path.is_dir() else path.unlink()  # a folder only when nothing else is in it
        self.created = []

    # -- the first write and a new timeline ----------------------------------------------------
    def begin(self, config: TrainConfig, ckpt: Path | None, step: int) -> None:
        """Everything is checked and built: a new run starts its metrics.jsonl, a resumed one continues
        from `ckpt` (step `step`, see `continue_from`); config.toml is written either way."""
        if self.parallel.is_main:
            with disk_full_guard(self.path / CONFIG_FILE, ckpt):
                runs.remove_stale_staging(self.path)
                if ckpt is None:
                    save_config(config, self.path / CONFIG_FILE)
                    self.metrics.reset()
                else:
                    self._new_timeline(config, step)
        self.created = []
        self.parallel.barrier()

    def continue_from(self, config: TrainConfig, ckpt: Path, step: int) -> None:
        """After `restore(ckpt)` in a running trainer (a rewind): the timeline from step `step` on is
        new, as after a resume; `config` (its lr lowered) is what config.toml records from now on."""
        if self.parallel.is_main:
            with disk_full_guard(self.path / CONFIG_FILE, ckpt):
                self._new_timeline(config, step)
        self.parallel.barrier()

    def _new_timeline(self, config: TrainConfig, step: int) -> None:
        """Continuing from step `step` starts a new timeline: checkpoints past it are moved aside (and
        named), so that pruning and the next --resume never prefer them to the new ones; config.toml
        says how the run goes on; metrics.jsonl keeps the records up to `step`."""
        moved = runs.set_aside_later_checkpoints(self.path, step)
        if moved is not None:
            folder, names = moved
            self.note(
                f"resuming from step {step}: the checkpoints after it ({', '.join(names)}) belong to "
                f"the abandoned timeline and were moved to {folder}"
            )
        save_config(config, self.path / CONFIG_FILE)
        self.metrics.truncate_after(step)

    # -- records -------------------------------------------------------------------------------
    def record(self, record: dict[str, Any]) -> None:
        """Append `record` to metrics.jsonl (main process; the others write nothing)."""
        if self.parallel.is_main:
            with disk_full_guard(self.metrics.path, self.last_ckpt):
                self.metrics.write(record)

    def plot(self, title: str) -> None:
        """Draw curves.png from metrics.jsonl (main process), when there is something to draw."""
        if not self.parallel.is_main:
            return
        image = plot_curves(self.path, title=title)
        if image is not None:
            atomic_write(self.path / CURVES_FILE, image)

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """The run's complete checkpoints as (step, path), oldest first."""
        return runs.checkpoints(self.path, "complete")

    def save(self, trainer: Trainer, info: Callable[[], TrainerState]) -> Path:
        """Checkpoint `trainer` as `step_<N>/` (collective): under sharded state every process writes
        its optimizer shards into the staged folder first; the main process writes the rest
        (trainer_state.json from `info()`), publishes it and prunes to config.keep_checkpoints."""
        parallel, step = self.parallel, trainer.step
        staging = None
        if parallel.sharded_state:  # every process writes its optimizer shards into the staged folder
            staging = shared(parallel, lambda: runs.begin_staging(self.path, step))
        state = trainer.state_dict(staging)
        full = parallel.full_model_state_dict(trainer.model)
        if staging is not None:
            parallel.barrier()  # all shards are on disk before rank 0 renames the folder
        if parallel.is_main:
            with disk_full_guard(self.path / runs.step_name(step), self.last_ckpt):
                try:
                    path = save_checkpoint(
                        self.path,
                        step,
                        model=trainer.model,
                        state_dict=full,
                        tokenizer_dir=self.tokenizer_dir,
                        info=info(),
                        state=state,
                        staging=staging,
                    )
                except BaseException:
                    runs.remove_stale_staging(self.path)  # we hold the lock: the staged folder is ours
                    raise
            prune_checkpoints(self.path, trainer.config.keep_checkpoints)
            self.last_ckpt = path
        self.last_ckpt = parallel.broadcast_object(self.last_ckpt)
        self.last_saved_step = step
        self.saved_at = time.monotonic()
        assert self.last_ckpt is not None
        return self.last_ckpt

    def restore(self, plan: ResumePlan, trainer: Trainer) -> Path:
        """Load the newest loadable checkpoint of `plan` into the running `trainer` (every process),
        checked and verified as the module docstring says; return its path. A checkpoint that does
        not load is named in one line and the next older one tried; a trainer state that does not
        fit the trainer is a CheckpointError (nothing of the folder moved yet)."""
        load = self.parallel.weights_loader(trainer.model)
        ckpt, state = load_resumable(plan, trainer.model, self.path, self.note, load)
        try:
            trainer.load_state_dict(to_device(state, self.parallel.device), ckpt)
        except MeritError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a crafted state raises: one line, nothing moved yet
            raise CheckpointError(f"{ckpt} cannot be resumed: its trainer state does not fit ({exc!r:.200})") from None
        self.last_ckpt, self.last_saved_step = ckpt, trainer.step
        return ckpt
