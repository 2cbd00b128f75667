"""Callbacks that watch the max attention logit inside other trainers.

- :mod:`merit_core.integrations.transformers`: ``MaxAttentionLogitCallback`` for Hugging Face ``Trainer``.
- :mod:`merit_core.integrations.lightning`: ``MaxAttentionLogitCallback`` for Lightning ``Trainer``.

Both measure, every N optimizer steps, the max attention logit (max over heads and positions of
q.k / sqrt(d_head)) per layer and overall on one fixed probe batch, with the probe of
:mod:`merit_core.models.attention_probe`, and hand the numbers to the trainer's own logging, so
that whatever trackers it reports to receive them. With ``precursors`` (the default) the same
forward pass also gives the other instability precursors `merit train` records at each eval
(docs/DIAGNOSTICS.md), each as one number over the layers: the smallest normalised attention
entropy, the largest residual-stream max/median |h| ratio, and the output layer's mean log Z.
Importing this package imports neither transformers nor lightning.
"""

from __future__ import annotations

from typing import Any

from merit_core.metric_names import MAX_ATTENTION_LOGIT

METRIC = MAX_ATTENTION_LOGIT


def logit_metrics(
    model: Any, input_ids: Any, attention_mask: Any = None, prefix: str = METRIC, precursors: bool = True
) -> dict[str, float]:
    """``{prefix: overall max, f"{prefix}/layer_{i}": max of layer i}`` on one probe batch and, with
    `precursors`, ``normalized_attention_entropy_min`` (min over layers and heads),
    ``activation_ratio`` (max over layers) and ``log_z_mean``, named as in merit's metrics.jsonl.

    The batch is moved to the model's device; the model's train/eval mode is restored afterwards.
    """
    import torch

    from merit_core.models.attention_probe import probe_attention  # transformers: see the docstring

    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, device=device)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=device).reshape(ids.shape)
    probed = probe_attention(model, ids, attention_mask=mask, instability=precursors)
    overall = probed.overall_metrics()
    metrics = {prefix: overall.pop(MAX_ATTENTION_LOGIT)}
    metrics.update({f"{prefix}/layer_{i}": float(v) for i, v in enumerate(probed.eval_metrics()[MAX_ATTENTION_LOGIT])})
    return {**metrics, **overall}  # with precursors: normalized entropy min, activation ratio, log Z mean


def check_every(every_n_steps: int) -> int:
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
    return every_n_steps


class ProbeSchedule:
    """What the callbacks of every trainer share: the probe batch, how often it is measured
    (`every_n_steps`, and at step 0 with `at_start`), the metrics' names, the last numbers and the
    last step measured, so that a step is measured once however many batches it has."""

    def __init__(
        self,
        probe_input_ids: Any,
        every_n_steps: int,
        attention_mask: Any,
        at_start: bool,
        prefix: str,
        precursors: bool,
    ):
        self.probe_input_ids = probe_input_ids
        self.attention_mask = attention_mask
        self.every_n_steps = check_every(every_n_steps)
        self.at_start = at_start
        self.prefix = prefix
        self.precursors = precursors
        self.last_step: int | None = None
        self.last: dict[str, float] = {}

    def measure_model(self, model: Any) -> dict[str, float]:
        """`logit_metrics` of `model` on the probe batch, kept as `last`."""
        self.last = logit_metrics(model, self.probe_input_ids, self.attention_mask, self.prefix, self.precursors)
        return self.last

    def first_at(self, step: int) -> bool:
        """Whether `step` was not measured yet (it is taken as measured from now on)."""
        if self.last_step == step:
            return False
        self.last_step = step
        return True
