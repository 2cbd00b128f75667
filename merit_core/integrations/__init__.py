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

from merit_core.metric_names import ACTIVATION_RATIO, LOG_Z_MEAN, MAX_ATTENTION_LOGIT, NORMALIZED_ENTROPY_MIN

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
    per_layer = probed.max_logits.amax(dim=1).tolist()  # [layers, heads] -> per layer
    metrics = {prefix: float(max(per_layer))}
    metrics.update({f"{prefix}/layer_{i}": float(v) for i, v in enumerate(per_layer)})
    if precursors:
        entropy, activations, output = probed.instability()
        metrics[NORMALIZED_ENTROPY_MIN] = float(entropy["normalized_min"].min())
        metrics[ACTIVATION_RATIO] = max(a.ratio for a in activations)
        metrics[LOG_Z_MEAN] = output.log_z_mean
    return metrics


def check_every(every_n_steps: int) -> int:
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
    return every_n_steps
