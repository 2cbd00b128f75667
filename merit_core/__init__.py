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
    # torch is imported only when the optimizer is asked for, so `merit --help` stays fast.
    if name == "MERIT":
        from merit_core.optim.merit import MERIT

        return MERIT
    if name == "build_optimizer":
        from merit_core.optim.registry import build_optimizer

        return build_optimizer
    raise AttributeError(f"module 'merit_core' has no attribute {name!r}")
