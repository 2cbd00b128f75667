"""When a run that finished with a finite loss still counts as failed: 'unstable'.

A finite loss is not a healthy run. Two rules, each stated with its reason:

- **The attention logit saturated** (one run): its max attention logit at the end is at least
  LOGIT_LIMIT = 88. exp(-88) = 6e-39 is below float32's (and bfloat16's) smallest normal number,
  1.2e-38, so in a row where that logit leads the others by 88 (they sit near zero in a healthy
  model, as at initialisation) the softmax gives every other key a weight that underflows: the
  attention is exactly one-hot in the arithmetic the run computes in and passes no gradient to
  the other keys. That is the saturation the paper's max-logit claim is about, so it is a
  threshold on the value itself, not on its growth.
- **The loss collapsed** (one cell, against its grid): its lr is above the grid's best lr and its
  mean final validation loss is more than LOSS_EXCESS = 5% above the best's. Above the best lr a
  loss rises because the steps are too large, and a collapsed run sits near the loss of predicting
  token frequencies alone; 5% is 2.5 times the report's band of good lrs (report.GOOD_LR_TOLERANCE,
  2%). A cell below the best lr is slow, not unstable: it is not marked.

An unstable run or cell keeps its numbers (they are shown, marked), ranks below every finished
cell, is never a best lr, and is left out of the lrs the optimizer registry's caps are built from
(merit_core.optim.lr_table.STABLE_LRS).
"""

from __future__ import annotations

from merit_core.diagnostics.verdict import LOGIT_LIMIT  # one constant: inspect's verdict judges by it too

__all__ = ["LOGIT_LIMIT", "LOSS_EXCESS", "loss_unstable", "run_unstable"]

LOSS_EXCESS = 0.05


def run_unstable(max_logit: float | None) -> str | None:
    """Why a finished run is unstable by its max attention logit at the end, or None."""
    if max_logit is None or max_logit < LOGIT_LIMIT:
        return None
    return f"max attention logit {max_logit:.4g} >= {LOGIT_LIMIT:g} (softmax saturated in float32)"


def loss_unstable(lr: float, loss: float | None, best_lr: float, best_loss: float | None) -> str | None:
    """Why a finished cell at `lr` is unstable against its grid's best cell, or None."""
    if loss is None or best_loss is None or lr <= best_lr or best_loss <= 0:
        return None
    excess = loss / best_loss - 1
    if excess <= LOSS_EXCESS:
        return None
    return (
        f"final validation loss {100 * excess:.1f}% above the best lr's ({best_lr:.3g}), "
        f"more than {100 * LOSS_EXCESS:g}% at a larger lr"
    )
