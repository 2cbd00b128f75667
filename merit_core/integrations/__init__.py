"""Callbacks that watch the max attention logit inside other trainers.

- :mod:`merit_core.integrations.transformers`: ``MaxAttentionLogitCallback`` for Hugging Face ``Trainer``.
- :mod:`merit_core.integrations.lightning`: ``MaxAttentionLogitCallback`` for Lightning ``Trainer``.

Both measure, every N optimizer steps, the max attention logit (max over heads and positions of
q.k / sqrt(d_head)) per layer and overall on one fixed probe batch, with the probe of
:mod:`merit_core.models.attention_probe`, and hand the numbers to the trainer's own logging, so
that whatever trackers it reports to receive them. Importing this package imports neither
transformers nor lightning.
"""

from __future__ import annotations

from typing import Any

from merit_core.metric_names import MAX_ATTENTION_LOGIT

METRIC = MAX_ATTENTION_LOGIT


def logit_metrics(model: Any, input_ids: Any, attention_mask: Any = None, prefix: str = METRIC) -> dict[str, float]:
    """``{prefix: overall max, f"{prefix}/layer_{i}": max of layer i}`` on one probe batch.

    The batch is moved to the model's device; the model's train/eval mode is restored afterwards.
    """
    import torch

    from merit_core.models.attention_probe import max_attention_logits  # transformers: see the docstring

    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, device=device)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=device).reshape(ids.shape)
    per_head = max_attention_logits(model, ids, attention_mask=mask)  # [layers, heads]
    per_layer = per_head.amax(dim=1).tolist()
    metrics = {prefix: float(max(per_layer))}
    metrics.update({f"{prefix}/layer_{i}": float(v) for i, v in enumerate(per_layer)})
    return metrics


def check_every(every_n_steps: int) -> int:
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
    return every_n_steps
