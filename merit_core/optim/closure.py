"""The closure convention of torch optimizers, in one place for merit's own optimizers."""

from __future__ import annotations

from collections.abc import Callable

import torch


def closure_loss(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """Evaluate `closure` with gradients enabled (an optimizer's `step` runs under no_grad), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
