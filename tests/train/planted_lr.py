"""A planted divergence for the watcher's tests, in one process (tests/train/test_watch_runs.py) or
under torchrun (tests/dist_scripts/watch_decisions.py)."""

from collections.abc import Callable
from typing import Any


def raised_lr_for(original: Callable[[Any, int], float], lr: float, plant_at: int, growth: float):
    """`Trainer.lr_for` with a planted divergence: from update `plant_at` on, the lr of a run configured
    with `lr` grows by `growth` a step (a run at another lr, one lowered by a rewind, is left alone)."""

    def raised(self, index: int) -> float:
        value = original(self, index)
        if self.config.lr == lr and index >= plant_at:
            value *= growth ** (index - plant_at + 1)
        return value

    return raised
