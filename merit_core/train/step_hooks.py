"""What the training loop hands an optimizer spec's step hook (:class:`StepContext`).

The hook itself (its cadence and its work) is part of the optimizer's registry spec
(:class:`merit_core.optim.registry.StepHook`; Sophia-G's Hessian refresh is the example); the
Trainer keeps the cadence and builds the context after the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer


@dataclass(frozen=True)
class StepContext:
    """What a per-step hook may use, right after an optimizer update.

    logits: calls the training forward on this process's first micro-batch of the update (with
        gradients, under the run's autocast) and returns the logits.
    generator: a generator the loop seeded from (run seed, update index, process rank), for any
        sampling the hook does (a resumed run draws the same).
    world_size: the number of processes (gradients are averaged over them).
    """

    optimizer: Optimizer
    step: int  # 0-based index of the update just taken
    logits: Callable[[], torch.Tensor]
    generator: torch.Generator
    world_size: int
