"""When a run that finished with a finite loss still counts as failed, 'unstable': compare's subset
of the instability rules (merit_core.instability_rules.COMPARE_RULES, where each rule is stated
with its reason).

- **The attention logit saturated** (`run_unstable`, one run): its max attention logit at the end
  is at least LOGIT_LIMIT, where float32 softmax is one-hot.
- **The loss collapsed** (`loss_unstable`, one cell against its grid): its lr is above the grid's
  best lr and its mean final validation loss is more than LOSS_EXCESS above the best's.

An unstable run or cell keeps its numbers (they are shown, marked), ranks below every finished
cell, is never a best lr, and is left out of the lrs the optimizer registry's caps are built from
(merit_core.optim.lr_table.STABLE_LRS).
"""

from __future__ import annotations

from merit_core.instability_rules import LOGIT_LIMIT, LOSS_EXCESS, loss_unstable, run_unstable

__all__ = ["LOGIT_LIMIT", "LOSS_EXCESS", "loss_unstable", "run_unstable"]
