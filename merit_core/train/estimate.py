"""How long a run will take, from one timed forward + backward before step 1, and what fits an hour.

On a CPU a GPU-sized config (gpt2-small's 124M parameters at 16 x 1024 tokens a step) takes hours a
step; without a number up front the first sign is a bar that does not move. The estimate times one
sequence of the run's first micro-batch on the plain model (no warm-up pass: a slight over-estimate)
and scales it to the steps left. Only on a CPU: a GPU's first pass is dominated by kernel loading
and autotuning, and its runs are sized by their users.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from merit_core.models import NAMED_MODELS
from merit_core.train.trainer import Trainer

LONG_SECONDS = 3600.0  # above about an hour on a CPU the run says so (and asks, on a terminal)


@dataclasses.dataclass(frozen=True)
class Estimate:
    seconds_per_step: float
    steps: int

    @property
    def seconds(self) -> float:
        return self.seconds_per_step * self.steps


def time_first_micro_batch(trainer: Trainer) -> Estimate:
    """Seconds a step of `trainer`'s run takes, from one timed forward + backward of one sequence of
    its first micro-batch scaled by the sequences of a step; the model's gradients and the RNG are
    left as they were (the run trains exactly as without it)."""
    x, y = trainer._first_micro_batch(1)
    with torch.random.fork_rng(devices=[]):
        try:
            start = time.perf_counter()
            trainer._loss(trainer.model, x.to(trainer.device), y.to(trainer.device), 1.0).backward()
            seconds = time.perf_counter() - start
        finally:
            trainer.model.zero_grad(set_to_none=True)
    steps = max(0, (trainer.config.steps or 0) - trainer.step)
    return Estimate(seconds * trainer.per_rank, steps)


def duration(seconds: float) -> str:
    """3.2 h, 14 min, 40 s."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def tiny_of(model: str) -> str:
    """The shipped -tiny model of `model`'s family (gpt2-small -> gpt2-tiny), else gpt2-tiny."""
    spec = NAMED_MODELS.get(model)
    family = spec.family if spec is not None else None
    return next((n for n, s in NAMED_MODELS.items() if n.endswith("-tiny") and s.family == family), "gpt2-tiny")


def long_run_line(estimate: Estimate, model: str, tiny: str) -> str | None:
    """One line when the run would take more than about an hour, with a config that fits one; else None."""
    if estimate.seconds <= LONG_SECONDS:
        return None
    fits = int(LONG_SECONDS // max(estimate.seconds_per_step, 1e-9))
    steps = f", or --steps {fits}" if fits >= 1 else ""
    smaller = f"--model {tiny}" if tiny != model else "a smaller --batch-size or --seq-len"
    return (
        f"estimate: about {duration(estimate.seconds)} for {estimate.steps:,} steps of {model} on this CPU "
        f"({duration(estimate.seconds_per_step)} a step, from a timed first micro-batch); within an hour: "
        f"{smaller}{steps}"
    )
