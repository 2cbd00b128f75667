"""The callback protocol of a training run and the records it reports.

`TrainCallbacks` is how a front end (the CLI's progress view, `merit compare`, the trackers in
train/trackers.py, a notebook) follows a run: `run_training` calls its `on_*` hooks on the main
process. `RunInfo` says what a run is about to do, `RunSummary` how it ended. `CallbackList`
sends each event to several callbacks. This module imports only the config, so any module can
implement or receive callbacks without importing the training loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from merit_core.progress import Progress
from merit_core.train.config import TrainConfig

if TYPE_CHECKING:
    from merit_core.optim.lr_table import LrDefault

# Signals that stop training gracefully (finish the step, checkpoint, exit) and the exit code each gives:
# SIGHUP is a terminal or ssh session that went away; SIGPIPE stands for a console output whose reader
# went away (`merit train | head -1`), which a front end reports through TrainCallbacks.stop_requested.
STOP_SIGNALS = {"SIGTERM": 143, "SIGUSR1": 143, "SIGINT": 130, "SIGHUP": 129, "SIGPIPE": 141}
# The ones a handler catches; SIGPIPE stays ignored (a write to a closed pipe then fails with EPIPE).
HANDLED_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")


@dataclass
class RunInfo:
    """What a run is about to do (given to `TrainCallbacks.on_start`)."""

    run_dir: Path
    config: TrainConfig
    n_params: int
    n_layers: int
    start_step: int
    total_steps: int
    tokens_per_step: int
    world_size: int
    device: str
    data_dir: Path
    resumed_from: Path | None = None
    device_name: str = ""  # 'NVIDIA H200', or the CPU model
    compute_dtype: str = "float32"  # what the matrix products run in: 'bfloat16' (autocast) or 'float32'
    tf32: bool = False  # whether float32 matrix products may use TF32 (CUDA only)
    peak_flops: float | None = None  # the device's dense bf16 peak, for MFU (None on CPU)
    device_memory: int | None = None  # bytes of GPU memory (None on CPU)
    lr_default: LrDefault | None = None  # the default lr resolve chose and its source; None: the config gave the lr


@dataclass
class RunSummary:
    """How a run ended (`config` is the resolved config: actual lr, steps, micro-batch, out)."""

    run_dir: Path
    config: TrainConfig
    steps: int
    tokens: int
    n_params: int
    elapsed_s: float
    tokens_per_s: float | None
    final_loss: float | None
    final_val_loss: float | None
    max_attention_logit: list[float] | None
    last_checkpoint: Path | None
    resumed_from: Path | None = None
    checkpoints: list[Path] = field(default_factory=list)
    device: str = ""  # 'cuda:0', 'cpu'
    device_name: str = ""
    compute_dtype: str = "float32"
    peak_memory: int | None = None  # bytes: GPU memory allocated at peak, or the process's peak RSS on CPU
    mfu: float | None = None  # 6 * n_params * tokens_per_s / the device's bf16 peak (None on CPU)
    compile: str = ""  # 'compiled', 'eager', or eager after compile=auto fell back (with the compiler's error)


class TrainCallbacks:
    """Progress hooks; override what you need. Called on the main process only."""

    def on_prepare(self, event: Progress) -> None:
        """Data preparation progress (merit_core.progress.Progress: `done` of `total` units of `stage`)."""

    def on_data(self, meta) -> None:
        """The prepared data is ready (`meta`: merit_core.data.DataMeta)."""

    def on_start(self, info: RunInfo) -> None:
        """Everything is built and checked; training starts at `info.start_step`."""

    def on_step(self, step: int) -> None:
        """An optimizer update finished; `step` updates are done (no values: reading one would wait
        for the device, which log steps alone do)."""

    def on_step_loss(self, step: int, loss: float) -> None:
        """This process's training loss of update `step`, between log lines, where reading it costs no
        wait: every step of a one-process CPU run, and the first step of any one-process run (a
        progress bar's number before the first log line)."""

    def on_log(self, record: dict[str, Any]) -> None:
        """A log line: step, tokens, loss, lr, grad_norm, tokens_per_s."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """An eval line: step, tokens, val_loss and, per layer, max_attention_logit,
        normalized_attention_entropy_min and activation_ratio, and log_z_mean (metric_names.py)."""

    def on_watch(self, record: dict[str, Any]) -> None:
        """A watch record (every watch_every steps): step, tokens, the precursors (metric_names.WATCH_*)
        and, when the watcher warned at this step, `watch_warnings` (each also given as a note)."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """A checkpoint was written."""

    def on_end(self, summary: RunSummary) -> None:
        """The run finished normally."""

    def confirm(self, message: str) -> bool:
        """Go on with a run that `message` (one line) says is long? True (the default: a library caller
        or a run off a terminal goes on); `merit train` asks on a terminal unless given --yes."""
        return True

    def on_note(self, message: str) -> None:
        """Something the user should know that is not an error (one line), e.g. a resume fallback."""

    def stop_requested(self) -> str | None:
        """Polled between steps: the name of a stop signal (STOP_SIGNALS)
        when this front end asks the run to stop as that signal would (checkpoint, exit), e.g.
        'SIGPIPE' when the console it writes to was closed; None to go on."""
        return None


class ClosingCallbacks(TrainCallbacks):
    """Callbacks that hold something open (a tracker's connection): `CallbackList.close` closes them."""

    def close(self, failed: bool = False) -> None:
        """Flush and finish; `failed` says whether the run ended with an error."""


class CallbackList(TrainCallbacks):
    """Several TrainCallbacks as one: each event goes to each, in order; `close()` closes the trackers.

    Every `on_*` event of TrainCallbacks is forwarded (the methods are made below from the base
    class), so an event added there reaches every callback without an edit here.
    """

    def __init__(self, callbacks: Iterable[TrainCallbacks | None]):
        self.callbacks = [cb for cb in callbacks if cb is not None]

    def stop_requested(self) -> str | None:
        """The first stop any callback asks for."""
        return next((name for cb in self.callbacks if (name := cb.stop_requested())), None)

    def confirm(self, message: str) -> bool:
        """Go on only if every callback agrees (the first that declines is the last asked)."""
        return all(cb.confirm(message) for cb in self.callbacks)

    def close(self, failed: bool = False) -> None:
        """Close every ClosingCallbacks (also after an error, so that what was logged is kept)."""
        for cb in self.callbacks:
            if isinstance(cb, ClosingCallbacks):
                cb.close(failed)


def _forward(event: str):
    def forward(self: CallbackList, *args: Any, **kwargs: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = event
    return forward


for _event in [name for name in vars(TrainCallbacks) if name.startswith("on_")]:
    setattr(CallbackList, _event, _forward(_event))
