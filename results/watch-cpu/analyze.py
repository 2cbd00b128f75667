"""Labels and the lead-time table of the watch-cpu grid (see grid.py)."""

from __future__ import annotations

import math

DIVERGENCE_NATS = 1.0  # the divergence rule's margin over the lowest loss so far


def divergence_step(losses: list[tuple[int, float]]) -> int | None:
    """The first step whose training loss is non-finite or more than DIVERGENCE_NATS above the
    lowest loss of the steps before it; None when no step is (a healthy run)."""
    low = math.inf
    for step, loss in losses:
        if not math.isfinite(loss) or loss > low + DIVERGENCE_NATS:
            return step
        low = min(low, loss)
    return None
