"""The training loop, its configuration, checkpoints and metrics.

    from merit_core.config_catalog import find_config
    from merit_core.train import load_config, run_training
    config = load_config(find_config("debug", "train"), ["steps=20"])  # the shipped debug config
    summary = run_training(config)

Importing this package imports torch (the training loop); `merit train --help` does not import it.
"""

from merit_core.train.callbacks import RunInfo, RunSummary, TrainCallbacks
from merit_core.train.config import TrainConfig, load_config, resolve
from merit_core.train.training_run import run_training

__all__ = ["TrainConfig", "load_config", "resolve", "run_training", "RunInfo", "RunSummary", "TrainCallbacks"]
