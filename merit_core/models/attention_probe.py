"""The max attention logit: max over positions of scaled q.k, per layer and head.

This is the quantity the MERIT paper tracks: under AdamW it grows sharply in large-batch
training. It is measured inside the model's own attention (through transformers'
AttentionInterface), so queries and keys are exactly what the model uses, for every family
merit supports: after the projections (fused QKV split), after QK-norm (Qwen3, OLMo 2, Gemma 3),
after rotary embeddings (partial for GPT-NeoX), with grouped-query heads expanded, scaled by the
module's own factor (1/sqrt(head_dim), or query_pre_attn_scalar^-1/2 for Gemma), and with the
mask the model itself builds (causal, padding, sliding window). Gemma 2's tanh soft-capping is
not applied: the probe reports the logit before the cap (the model's softmax sees
cap * tanh(logit / cap), which is monotone, so the capped maximum follows from it).

Logits are computed in float32 whatever autocast is active, in query chunks (chunk x T, never
T x T); `max_attention_logits` also runs its forward pass with autocast off, so the projections
are float32 too and the number does not depend on the device's mixed precision. The model's own
attention then runs unchanged (SDPA, or the family's eager attention where it needs one).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from merit_core.models import family_spec

PROBE_NAME = "merit_logit_probe"  # delegates to SDPA
EAGER_PROBE_NAME = "merit_logit_probe_eager"  # delegates to the family's eager attention
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
        self.scaling: dict[int, float] = {}

    def update(self, layer_idx: int, head_max: torch.Tensor) -> None:
        prev = self.per_layer.get(layer_idx)
        self.per_layer[layer_idx] = head_max if prev is None else torch.maximum(prev, head_max)

    def result(self) -> torch.Tensor:
        """[n_layers, n_heads] float32 tensor on CPU, layers in index order."""
        if not self.per_layer:
            raise RuntimeError("no attention layer was seen; is the model a transformers causal LM?")
        return torch.stack([self.per_layer[i].float().cpu() for i in sorted(self.per_layer)])


@contextlib.contextmanager
def full_fp32(*device_types: str) -> Iterator[None]:
    """Autocast off on `device_types` and TF32 off for CUDA matrix products, restored on exit.

    A training run leaves TF32 on by default on CUDA (10-bit mantissa products), which would put
    the probe ~1e-3 relative off the float32 logits; the probe measures full float32 on every device.
    """
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with contextlib.ExitStack() as stack:
            for device in sorted(set(device_types)):
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


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
    with full_fp32(query.device.type):
        return _chunked_max_logits(query, key, attention_mask, scaling, query_chunk)


def _chunked_max_logits(query, key, attention_mask, scaling, query_chunk):
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


def _record(module, query, key, attention_mask, scaling) -> None:
    recorder = _active
    if recorder is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        with torch.no_grad():
            head_max = chunked_max_logits(query.detach(), key.detach(), attention_mask, scale, recorder.query_chunk)
        recorder.update(int(module.layer_idx), head_max)
        recorder.scaling[int(module.layer_idx)] = float(scale)


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _record(module, query, key, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _probe_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _record(module, query, key, attention_mask, scaling)
    eager = sys.modules[type(module).__module__].eager_attention_forward  # the family's own (soft-capping)
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _register() -> None:
    global _registered
    with _register_lock:
        if _registered:
            return

        AttentionInterface.register(PROBE_NAME, _probe_attention)
        AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
        AttentionInterface.register(EAGER_PROBE_NAME, _probe_eager_attention)
        AttentionMaskInterface.register(EAGER_PROBE_NAME, eager_mask)
        _registered = True


@contextlib.contextmanager
def record_attention_logits(model, query_chunk: int = 128) -> Iterator[LogitRecorder]:
    """Within the block, forward passes of `model` record max attention logits per layer and head.

    The model's attention implementation is switched to the probe and restored on exit; models
    running eager attention (Gemma 2's soft-capping) keep eager attention behind the probe.
    """
    global _active
    _register()
    previous = model.config._attn_implementation
    recorder = LogitRecorder(query_chunk)
    model.set_attn_implementation(EAGER_PROBE_NAME if previous == "eager" else PROBE_NAME)
    _active = recorder
    try:
        yield recorder
    finally:
        _active = None
        model.set_attn_implementation(previous)


@dataclass
class ProbeResult:
    """What one probe forward pass measured, per layer in index order."""

    max_logits: torch.Tensor  # [n_layers, n_heads] float32 on CPU
    scaling: list[float]  # the factor each layer's attention multiplies q.k by
    input_max_l1: list[float] | None  # largest l1 norm of a token's attention input (with inputs=True)


@torch.no_grad()
def probe_attention(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    query_chunk: int = 128,
    inputs: bool = False,
) -> ProbeResult:
    """One forward pass with autocast off: max attention logits per layer and head, the scaling
    each layer used and, with `inputs`, the largest l1 norm of a token of each attention module's
    input (what W_Q and W_K multiply; located through the model family's spec)."""
    was_training = model.training
    model.eval()
    found: dict[int, float] = {}
    hooks = []
    try:
        if inputs:
            spec = family_spec(model.config)
            base = getattr(model, model.base_model_prefix)
            for i in range(spec.n_layers(model.config)):

                def hook(module, args, kwargs, i=i):
                    x = args[0] if args else kwargs["hidden_states"]
                    found[i] = float(x.detach().float().abs().sum(dim=-1).max())

                module = base.get_submodule(spec.attention.block.format(i=i))
                hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        with contextlib.ExitStack() as stack:
            stack.enter_context(full_fp32("cpu", input_ids.device.type))
            rec = stack.enter_context(record_attention_logits(model, query_chunk))
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    scaling = [rec.scaling[i] for i in sorted(rec.scaling)]
    return ProbeResult(rec.result(), scaling, [found[i] for i in sorted(found)] if inputs else None)


def max_attention_logits(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, query_chunk: int = 128
) -> torch.Tensor:
    """Max attention logit per layer and head, [n_layers, n_heads], on one batch of token ids.

    The forward pass runs with autocast and TF32 off (on the model's device and the CPU), so a call
    from inside a mixed-precision training step measures the same float32 logits as one outside it.
    """
    return probe_attention(model, input_ids, attention_mask, query_chunk).max_logits
