"""The training loop, its configuration, checkpoints and metrics.

    from merit_core.configs import find_config
    from merit_core.train import load_config, run_training
    config = load_config(find_config("debug", "train"), ["steps=20"])  # the shipped debug config
    summary = run_training(config)

Importing this package does not import torch: `merit train --help` reads the config and callback
classes through it. `run_training` (training_run.py, which imports torch) loads when first asked for.
"""

from merit_core.train.callbacks import RunInfo, RunSummary, TrainCallbacks
from merit_core.train.config import TrainConfig, load_config, resolve

__all__ = ["TrainConfig", "load_config", "resolve", "run_training", "RunInfo", "RunSummary", "TrainCallbacks"]


def __getattr__(name):
    if name == "run_training":
        # here, not at the top: training_run imports torch, and this package is on light paths
        from merit_core.train.training_run import run_training

        return run_training
    raise AttributeError(f"module 'merit_core.train' has no attribute {name!r}")
