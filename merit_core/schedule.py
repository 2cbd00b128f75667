"""The learning-rate schedule: linear warmup, then cosine decay to a minimum.

Kept here rather than taken from transformers' schedulers, which differ in where the ends fall:
`get_cosine_with_min_lr_schedule_with_warmup` gives the first update lr 0 (a wasted step) and
reaches `min_lr` only after the last update; its `..._lr_rate` variant leaves the peak at once
and, without warmup, never applies the peak lr at all. Here the first update already moves
(lr / warmup_steps), the peak is applied, and the last update uses exactly `min_lr`; the runs
committed in results/ were trained with this schedule.
Between its ends it is transformers' min-lr cosine (tests/train/test_schedule.py checks that
value for value). It is a pure function of the update index, so a resumed run continues it
exactly with no scheduler state to save.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for the update with 0-based index `step` out of `total_steps`.

    Warmup rises linearly from lr/warmup_steps (update 0) to lr (update warmup_steps - 1);
    then a half cosine goes from lr to exactly `min_lr` at the last update. Past the end it
    stays at `min_lr`.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = total_steps - 1 - warmup_steps
    if span <= 0:
        return lr if step < total_steps else min_lr
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
