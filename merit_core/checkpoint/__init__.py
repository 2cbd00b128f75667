"""Checkpoints and run folders: the one package that knows where `merit train` puts things and what
a checkpoint's files hold, as the only reader and writer of them.

- `runs`: a run folder's layout (`step_<N>/`, the marker, the lock, config.toml, metrics.jsonl),
  staging and durable publishing of a checkpoint folder, the rule of "latest";
- `writer` (torch): one checkpoint's files written into its staged folder and published, old ones
  pruned (merit_core.train.run_folder, the run folder's owner during training, calls it);
- `state`: `TrainerState`, the typed trainer_state.json, and the sha256 of each checkpoint file
  it records (`verify_checkpoint`);
- `resolve`: one resolver of a user's path with an explicit `Selection` (`latest`, `all`, chosen
  steps) that inspect, eval, resume and compare share (`latest_checkpoint`: LATEST's pick, or None),
  and the safetensors `Checkpoint` inspect reads;
- `safe`: the safe readers of untrusted files (safetensors headers, sharded indexes, no pickle);
- `tensors` (torch): trainer_state.pt read and validated whole, the optimizer state checked
  against an optimizer, weights copied into a model;
- `sharded` (torch.distributed): an fsdp checkpoint's optimizer shards, read without running code;
- `run_config`: the one reader of a run's config.toml: its table, and the few settings reading its
  optimizer state needs.

Nothing here imports train/, diagnostics/ or evaluation/: they import it.
"""

from merit_core.checkpoint.resolve import (
    ALL,
    LATEST,
    STEPS_HELP,
    Checkpoint,
    Selection,
    Taken,
    find_checkpoints,
    is_run_folder,
    latest_checkpoint,
    parse_selection,
    select_steps,
    take,
    took,
)
from merit_core.checkpoint.run_config import read_run_config
from merit_core.checkpoint.runs import CONFIG_FILE, missing_step_hint
from merit_core.checkpoint.state import TrainerState, read_trainer_state, verify_checkpoint

__all__ = [
    "ALL",
    "CONFIG_FILE",
    "LATEST",
    "STEPS_HELP",
    "Checkpoint",
    "Selection",
    "Taken",
    "TrainerState",
    "find_checkpoints",
    "is_run_folder",
    "latest_checkpoint",
    "missing_step_hint",
    "parse_selection",
    "read_run_config",
    "read_trainer_state",
    "select_steps",
    "take",
    "took",
    "verify_checkpoint",
]
