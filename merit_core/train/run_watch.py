"""`merit train --watch` inside the training loop: probe, detect, and decide: warn, stop or rewind.

Every `watch_every` steps `RunWatch.after_step` measures the precursors on the first
`PROBE_SEQUENCES` sequences of the first validation batch (`measure`: one forward pass, autocast
off, no gradient), reads the step's loss and grad norm, feeds them to the detector
(merit_core.train.watch_detector.Watcher) and returns a `WatchDecision`: the record to write to
metrics.jsonl and give the trackers (`TrainCallbacks.on_watch`), the warnings (one line each,
`on_note`), and what `on_instability` makes of them:

- record (the default): training goes on; the warnings are kept in the record and not printed.
  On the results/watch-train grid's held-out runs the detector did not meet the goal a printed
  warning needs (in time ahead of 90% of divergences with false alarms on at most 5% of healthy
  runs), so by default it says nothing and leaves the evidence in metrics.jsonl.
- warn: training goes on; each warning is one printed line.
- stop: the run stops (InstabilityStop) without saving the warned weights; the message names the
  last checkpoint from before the warning, which `--resume-from` continues from.
- rewind: the run goes back to that checkpoint and continues with the lr (peak and floor)
  multiplied by `REWIND_LR_FACTOR`; config.toml records the new lr; at most `MAX_REWINDS` times,
  then it stops as `stop` does. Without a checkpoint from before the warning it stops too.

The watcher decides and writes nothing; the training run (merit_core.train.training_run) acts: it
writes the record, and rewinds through the same verified restore that `--resume` uses
(merit_core.train.run_folder), so a rewind is exactly a resume with the lower lr.

Why 1/2. MERIT moves every weight by at most lr times the tensor's max |w| per step (the step
bound of docs/MERIT.md); an attention logit is bilinear in W_Q and W_K, so its log can grow by at
most about 2 lr per step: halving the lr halves the fastest growth of every log-logit over the
same steps. The lrs of the results/watch-cpu grid are a factor 2 apart, and the grid's table
(results/watch-cpu/README.md) gives, for each diverged run, whether the run at half its lr (same
model, optimizer and seed) stayed healthy: that is the measured case for one halving per rewind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from merit_core.metric_names import WATCH_GRAD_NORM, WATCH_LOSS, WATCH_WARNINGS
from merit_core.models.attention_probe import probe_attention
from merit_core.precursors import watch_record
from merit_core.train.compiling import eager
from merit_core.train.distributed import Parallel
from merit_core.train.trainer import Trainer
from merit_core.train.watch_detector import Watcher, WatchWarning

PROBE_SEQUENCES = 2  # sequences of the first validation batch the watcher probes
# The detector judges nothing in the first SKIP_WARMUPS x warmup steps: early training's attention
# collapse sets new highs there in healthy runs. Chosen on the results/watch-train grid's tuning part
# (README there: today's settings judging from the first step vs after 2x the warmup).
SKIP_WARMUPS = 2
REWIND_LR_FACTOR = 0.5
MAX_REWINDS = 3
RECORD, WARN, STOP, REWIND = "record", "warn", "stop", "rewind"


@torch.no_grad()
def measure(trainer: Any, input_ids: torch.Tensor) -> dict[str, Any]:
    """The precursors of `trainer`'s model on `input_ids`, as a run's eval record holds them (per
    layer the max attention logit, the min normalised entropy and the activation ratio; the mean
    output log Z) under the watch keys, with the update / weight ratio where the optimizer exposes it."""
    with eager(), trainer.autocast():  # the probe itself runs in float32
        probed = probe_attention(trainer.model, input_ids, instability=True)
    return watch_record(probed.eval_metrics(), trainer.update_ratio())


@dataclass(frozen=True)
class WatchDecision:
    """What one probe step decided. `record`: the watch record (metrics.jsonl and the trackers; the
    run adds step and tokens); `warnings`: what the detector raised; `action`: RECORD (go on, print
    nothing), WARN (go on, print the warnings), STOP or REWIND; for STOP and REWIND `checkpoint` is
    the newest complete checkpoint from before the first warning as (step, path), None when there is
    none (then STOP); for REWIND `lr_factor` multiplies the lr and `rewinds` counts this one."""

    record: dict[str, Any]
    warnings: list[WatchWarning] = field(default_factory=list)
    action: str = WARN
    checkpoint: tuple[int, Path] | None = None
    lr_factor: float = 1.0
    rewinds: int = 0
    rewinds_spent: bool = False  # STOP because MAX_REWINDS were used up

    def stop_line(self, run_dir: Path, lr: float) -> str:
        """InstabilityStop's message: the warning, and how to continue at the lower lr (`lr`: the run's)."""
        why = f"after {MAX_REWINDS} rewinds " if self.rewinds_spent else ""
        if self.checkpoint is None:
            where = "no checkpoint from before it exists (save more often with --save-every)"
        else:
            where = (
                f"the last checkpoint before it is {self.checkpoint[1]}; continue with: merit train --out {run_dir} "
                f"--resume-from {self.checkpoint[1].name} --lr {lr * REWIND_LR_FACTOR:g}"
            )
        return f"training stopped {why}on an instability warning ({self.warnings[0].line()}): {where}"

    def rewind_record(self, lr_before: float, lr_after: float) -> dict[str, Any]:
        """The `watch_rewind` value metrics.jsonl keeps: from where to where, the lrs and the warning."""
        assert self.checkpoint is not None
        step, path = self.checkpoint
        return {
            "from_step": self.warnings[0].step,
            "to_step": step,
            "checkpoint": str(path),
            "lr_before": lr_before,
            "lr_after": lr_after,
            "warning": self.warnings[0].to_dict(),
        }

    def rewind_line(self, lr_before: float, lr_after: float) -> str:
        """The note a rewind prints."""
        assert self.checkpoint is not None
        step, path = self.checkpoint
        return (
            f"rewound to {path} (step {step}) after the warning at step {self.warnings[0].step}: lr lowered "
            f"{lr_before:g} -> {lr_after:g} (x{self.lr_factor:g}, rewind {self.rewinds} of at most {MAX_REWINDS})"
        )


class RunWatch:
    """The watcher of one training run: `after_step(out, checkpoints)` after every update returns a
    decision on its cadence (None between). `trainer` is the run's Trainer (its model, first
    validation batch, step and update ratio are read, nothing is changed), `parallel` its processes;
    `every` and `on_instability` are the run's watch_every and on_instability settings."""

    def __init__(self, trainer: Trainer, parallel: Parallel, every: int, on_instability: str):
        self.trainer = trainer
        self.parallel = parallel
        self.every = every
        self.on_instability = on_instability
        self.watcher = Watcher(SKIP_WARMUPS * trainer.config.warmup_steps)
        self.rewinds = 0
        self.input_ids = trainer.val[0][0][:PROBE_SEQUENCES].to(parallel.device)

    def after_step(self, out: Any, checkpoints: Callable[[], list[tuple[int, Path]]]) -> WatchDecision | None:
        """Probe and judge on the cadence (None off it). `checkpoints()` lists the run's complete
        checkpoints (step, path), oldest first; it is asked only when a warning must be acted on.
        Every process returns the main process's decision."""
        step = self.trainer.step
        if step % self.every:
            return None
        record = {
            WATCH_LOSS: float(self.parallel.all_reduce(out.loss.detach(), op="mean").item()),
            WATCH_GRAD_NORM: float(out.grad_norm.item()),
            **measure(self.trainer, self.input_ids),
        }
        warnings = self.watcher.observe({"step": step, **record})
        if self.parallel.world_size > 1:  # every process acts on the main process's decision
            warnings = self.parallel.broadcast_object(warnings)
        if warnings:
            record[WATCH_WARNINGS] = [w.to_dict() for w in warnings]
        if not warnings or self.on_instability in (RECORD, WARN):
            return WatchDecision(record, warnings, RECORD if self.on_instability == RECORD else WARN)
        decision = self._decide(record, warnings, checkpoints())
        if self.parallel.world_size > 1:
            decision = self.parallel.broadcast_object(decision)
        if decision.action == REWIND and decision.checkpoint is not None:
            self.rewinds = decision.rewinds
            self.watcher.forget_after(decision.checkpoint[0])
        return decision

    def _decide(
        self, record: dict[str, Any], warnings: list[WatchWarning], saved: list[tuple[int, Path]]
    ) -> WatchDecision:
        """Rewind to the newest checkpoint from before the first warning while rewinds are left; else stop."""
        before = [(n, p) for n, p in saved if n < warnings[0].step]
        good = before[-1] if before else None
        rewinding = self.on_instability == REWIND and good is not None
        if rewinding and self.rewinds < MAX_REWINDS:
            return WatchDecision(record, warnings, REWIND, good, REWIND_LR_FACTOR, self.rewinds + 1)
        return WatchDecision(record, warnings, STOP, good, rewinds_spent=rewinding)
