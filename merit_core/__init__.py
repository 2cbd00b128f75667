"""merit: the MERIT large-batch optimizer and tools to pretrain, inspect and evaluate language models."""

from merit_core.errors import CheckpointError, ConfigError, DataError, MeritError
from merit_core.version import __version__

__all__ = [
    "MERIT",
    "build_optimizer",
    "MeritError",
    "ConfigError",
    "CheckpointError",
    "DataError",
    "__version__",
]


def __getattr__(name):
    if name in ("MERIT", "build_optimizer"):
        # here, not at the top: the optimizers import torch, and `merit --help` imports this package
        from merit_core import optim

        return getattr(optim, name)
    raise AttributeError(f"module 'merit_core' has no attribute {name!r}")
