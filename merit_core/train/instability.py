"""`merit train --watch` inside the training loop: probe, detect, and warn / stop / rewind.

Every `watch_every` steps `RunWatch.after_step` measures the precursors on the first
`PROBE_SEQUENCES` sequences of the first validation batch (one forward pass, autocast off, no
gradient), reads the step's loss and grad norm, feeds them to the detector
(merit_core.train.watch_detector.Watcher), writes the record to metrics.jsonl and gives it to the trackers
(`TrainCallbacks.on_watch`). A warning is one line (`on_note`), and then `on_instability` says
what happens:

- warn: training goes on.
- stop: the run stops (InstabilityStop) without saving the warned weights; the message names the
  last checkpoint from before the warning, which `--resume-from` continues from.
- rewind: the model and optimizer go back to that checkpoint and the run continues with the lr
  (peak and floor) multiplied by `REWIND_LR_FACTOR`; config.toml records the new lr; at most
  `MAX_REWINDS` times, then it stops as `stop` does. Without a checkpoint from before the warning
  it stops too.

Why 1/2. MERIT moves every weight by at most lr times the tensor's max |w| per step (the step
bound of docs/MERIT.md); an attention logit is bilinear in W_Q and W_K, so its log can grow by at
most about 2 lr per step: halving the lr halves the fastest growth of every log-logit over the
same steps. The lrs of the results/watch-cpu grid are a factor 2 apart, and the grid's table
(results/watch-cpu/README.md) gives, for each diverged run, whether the run at half its lr (same
model, optimizer and seed) stayed healthy: that is the measured case for one halving per rewind.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from merit_core.checkpoint import runs
from merit_core.checkpoint.runs import CONFIG_FILE
from merit_core.checkpoint.tensors import check_trainer_state, load_model_weights, load_trainer_state
from merit_core.errors import InstabilityStop
from merit_core.metric_names import (
    WATCH_GRAD_NORM,
    WATCH_LOSS,
    WATCH_REWIND,
    WATCH_WARNINGS,
)
from merit_core.models import family_spec
from merit_core.models.attention_probe import probe_attention
from merit_core.precursors import watch_record
from merit_core.train.compiling import eager
from merit_core.train.config import save_config
from merit_core.train.resume import to_device
from merit_core.train.watch_detector import Watcher, WatchWarning

if TYPE_CHECKING:
    from pathlib import Path

    from merit_core.train.training_run import TrainingRun

PROBE_SEQUENCES = 2  # sequences of the first validation batch the watcher probes
REWIND_LR_FACTOR = 0.5
MAX_REWINDS = 3


def for_run(run: TrainingRun) -> RunWatch | None:
    """The watch of `run`, or None when its config turns watching off."""
    return RunWatch(run) if run.config.watch else None


@torch.no_grad()
def measure(trainer: Any, input_ids: torch.Tensor) -> dict[str, Any]:
    """The precursors of `trainer`'s model on `input_ids`, as a run's eval record holds them (per
    layer the max attention logit, the min normalised entropy and the activation ratio; the mean
    output log Z) under the watch keys, with the update / weight ratio where the optimizer exposes it."""
    with eager(), trainer.autocast():  # the probe itself runs in float32
        probed = probe_attention(trainer.model, input_ids, instability=True)
    return watch_record(probed.eval_metrics(), trainer.update_ratio())


class RunWatch:
    """The watcher of one TrainingRun: `after_step(out)` after every update (it acts on its cadence)."""

    def __init__(self, run: TrainingRun):
        self.run = run
        self.trainer: Any = run.trainer  # built before the loop starts
        c = run.config
        self.every = c.watch_every
        self.watcher = Watcher()  # judged from the first records: divergences come inside warmup too
        self.rewinds = 0
        x = self.trainer.val[0][0][:PROBE_SEQUENCES]
        self.input_ids = x.to(run.parallel.device)

    def after_step(self, out: Any) -> bool:
        """Probe and judge on the cadence; True when the run was rewound to a checkpoint."""
        run = self.run
        step = self.trainer.step
        if step % self.every:
            return False
        record = {
            WATCH_LOSS: float(run.parallel.all_reduce(out.loss.detach(), op="mean").item()),
            WATCH_GRAD_NORM: float(out.grad_norm.item()),
            **measure(self.trainer, self.input_ids),
        }
        warnings = self.watcher.observe({"step": step, **record})
        if run.parallel.world_size > 1:  # every process acts on the main process's decision
            warnings = run.parallel.broadcast_object(warnings)
        if warnings:
            record[WATCH_WARNINGS] = [w.to_dict() for w in warnings]
        run.cb.on_watch(run._record(record))
        for warning in warnings:
            run.cb.on_note(warning.line())
        if warnings and run.config.on_instability != "warn":
            self._act(warnings[0])
            return True  # `_act` returns only after a rewind (a stop raises)
        return False

    # -- stop and rewind ------------------------------------------------------------------------
    def _good_checkpoint(self, step: int) -> tuple[int, Path] | None:
        """The newest complete checkpoint of the run from before `step`."""
        found = [(n, p) for n, p in runs.checkpoints(self.run.run_dir, "complete") if n < step]
        return found[-1] if found else None

    def _act(self, warning: WatchWarning) -> None:
        good = self._good_checkpoint(warning.step)
        rewinding = self.run.config.on_instability == "rewind" and good is not None
        if rewinding and good is not None and self.rewinds < MAX_REWINDS:
            self._rewind(warning, *good)
            return
        self._stop(warning, good, rewinds_spent=rewinding)

    def _stop(self, warning: WatchWarning, good: tuple[int, Path] | None, rewinds_spent: bool) -> None:
        run = self.run
        why = f"after {MAX_REWINDS} rewinds " if rewinds_spent else ""
        if good is None:
            where = "no checkpoint from before it exists (save more often with --save-every)"
        else:
            lower = float(run.config.lr or 0.0) * REWIND_LR_FACTOR
            where = (
                f"the last checkpoint before it is {good[1]}; continue with: merit train --out {run.run_dir} "
                f"--resume-from {good[1].name} --lr {lower:g}"
            )
        raise InstabilityStop(
            f"training stopped {why}on an instability warning ({warning.line()}): {where}",
            good[1] if good else None,
        )

    def _rewind(self, warning: WatchWarning, step: int, path: Path) -> None:
        """Load checkpoint `path` (step `step`) into the running trainer, lower the lr, say so."""
        run, trainer = self.run, self.trainer
        state = load_trainer_state(path, map_location="cpu")
        check_trainer_state(state, path, step=step)
        load_model_weights(trainer.model, path, rename=family_spec(trainer.model.config).model_name)
        trainer.load_state_dict(to_device(state, run.parallel.device), path)
        old = run.config
        assert old.lr is not None  # resolved before training
        new = dataclasses.replace(
            old,
            lr=old.lr * REWIND_LR_FACTOR,
            min_lr=None if old.min_lr is None else old.min_lr * REWIND_LR_FACTOR,
        )
        run.config = trainer.config = new
        self.rewinds += 1
        self.watcher.forget_after(step)
        if run.parallel.is_main and run.metrics is not None:
            save_config(new, run.run_dir / CONFIG_FILE)
            run.metrics.truncate_after(step)
        run.last_ckpt, run.last_saved_step = path, step
        rewind = {
            "from_step": warning.step,
            "to_step": step,
            "checkpoint": str(path),
            "lr_before": old.lr,
            "lr_after": new.lr,
            "warning": warning.to_dict(),
        }
        run._record({WATCH_REWIND: rewind})
        run.cb.on_note(
            f"rewound to {path} (step {step}) after the warning at step {warning.step}: lr lowered "
            f"{old.lr:g} -> {new.lr:g} (x{REWIND_LR_FACTOR:g}, rewind {self.rewinds} of at most {MAX_REWINDS})"
        )
