"""The max attention logit: max over positions of q.k / sqrt(d_head), per layer and head.

This is the quantity the MERIT paper tracks: under AdamW it grows sharply in large-batch
training. It is measured inside the model's own attention (through transformers'
AttentionInterface), so queries and keys are exactly what the model uses: after the
projections, after rotary embeddings for Llama, with grouped-query heads expanded. Logits are
computed in query chunks (chunk x T, never T x T) in float32, with the causal mask (and any
padding mask) applied, then the model's normal SDPA attention runs unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

PROBE_NAME = "merit_logit_probe"
_registered = False
_register_lock = threading.Lock()
_active: LogitRecorder | None = None


class LogitRecorder:
    """Running max attention logit per (layer, head), filled during forward passes."""

    def __init__(self, query_chunk: int = 128):
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
        self.query_chunk = query_chunk
        self.per_layer: dict[int, torch.Tensor] = {}

    def update(self, layer_idx: int, head_max: torch.Tensor) -> None:
        prev = self.per_layer.get(layer_idx)
        self.per_layer[layer_idx] = head_max if prev is None else torch.maximum(prev, head_max)

    def result(self) -> torch.Tensor:
        """[n_layers, n_heads] float32 tensor on CPU, layers in index order."""
        if not self.per_layer:
            raise RuntimeError("no attention layer was seen; is the model a transformers causal LM?")
        return torch.stack([self.per_layer[i].float().cpu() for i in sorted(self.per_layer)])


def chunked_max_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    query_chunk: int = 128,
) -> torch.Tensor:
    """Per-head max of scaled q.k over batch and allowed (query, key) pairs.

    query: [B, H, Tq, D]; key: [B, Hkv, Tk, D] (Hkv divides H); attention_mask: None (causal),
    bool [B or 1, 1 or H, Tq, Tk] (True = attend) or additive float of that shape.
    Returns a float32 tensor [H]; heads with no allowed pair get -inf.
    """
    b, h, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if hkv != h:
        key = key.repeat_interleave(h // hkv, dim=1)
    k_t = key.float().transpose(-1, -2)
    out = torch.full((h,), float("-inf"), device=query.device, dtype=torch.float32)
    offset = tk - tq  # absolute position of query row 0 among the keys
    key_pos = torch.arange(tk, device=query.device)
    for start in range(0, tq, query_chunk):
        stop = min(start + query_chunk, tq)
        logits = (query[:, :, start:stop].float() @ k_t) * scaling  # [B, H, C, Tk]
        if attention_mask is None:
            q_pos = torch.arange(start, stop, device=query.device) + offset
            allowed = key_pos[None, :] <= q_pos[:, None]  # [C, Tk]
            logits = logits.masked_fill(~allowed, float("-inf"))
        else:
            mask = attention_mask[..., start:stop, :]
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask, float("-inf"))
            else:
                logits = logits.masked_fill(mask.float() <= torch.finfo(torch.float32).min / 2, float("-inf"))
        out = torch.maximum(out, logits.amax(dim=(0, 2, 3)))
    return out


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorder = _active
    if recorder is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        with torch.no_grad():
            head_max = chunked_max_logits(query.detach(), key.detach(), attention_mask, scale, recorder.query_chunk)
        recorder.update(int(module.layer_idx), head_max)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _register() -> None:
    global _registered
    with _register_lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(PROBE_NAME, _probe_attention)
        AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
        _registered = True


@contextlib.contextmanager
def record_attention_logits(model, query_chunk: int = 128) -> Iterator[LogitRecorder]:
    """Within the block, forward passes of `model` record max attention logits per layer and head.

    The model's attention implementation is switched to the probe and restored on exit.
    """
    global _active
    _register()
    previous = model.config._attn_implementation
    recorder = LogitRecorder(query_chunk)
    model.set_attn_implementation(PROBE_NAME)
    _active = recorder
    try:
        yield recorder
    finally:
        _active = None
        model.set_attn_implementation(previous)


@torch.no_grad()
def max_attention_logits(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, query_chunk: int = 128
) -> torch.Tensor:
    """Max attention logit per layer and head, [n_layers, n_heads], on one batch of token ids."""
    was_training = model.training
    model.eval()
    try:
        with record_attention_logits(model, query_chunk) as rec:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return rec.result()
    finally:
        model.train(was_training)
