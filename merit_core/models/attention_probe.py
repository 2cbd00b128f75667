"""One probe forward pass, measured inside the model: the max attention logit and the other known
precursors of large-batch instability (docs/DIAGNOSTICS.md).

Per layer and head:
- the max attention logit, max over positions of scaled q.k: the quantity the MERIT paper tracks
  (under AdamW it grows sharply in large-batch training);
- the entropy of the attention the model computes (Zhai et al. 2023, entropy collapse), in nats,
  mean and min over the query positions that see at least two keys under the model's own mask,
  and the same divided by log(number of keys the position sees), 1 = uniform, 0 = one-hot.
Per layer, the residual stream after the layer (Sun et al. 2024, massive activations): max |h|, the
median |h| over all its entries, their ratio and where the max sits (batch row, position,
dimension). From the output layer (PaLM's z-loss, Wortsman et al. 2023): the largest |logit| and
log Z = logsumexp of the logits per position, its mean, std (population) and max over positions.

Attention is measured inside the model's own attention (through transformers' AttentionInterface),
so queries and keys are exactly what the model uses, for every family merit supports: after the
projections (fused QKV split), after QK-norm (Qwen3, OLMo 2, Gemma 3), after rotary embeddings
(partial for GPT-NeoX), with grouped-query heads expanded, scaled by the module's own factor
(1/sqrt(head_dim), or query_pre_attn_scalar^-1/2 for Gemma), and with the mask the model itself
builds (causal, padding, sliding window). The max logit is the logit before Gemma 2's tanh
soft-capping (the model's softmax sees cap * tanh(logit / cap), which is monotone, so the capped
maximum follows from it); the entropy is that of the softmax the model computes, after the cap.

Logits are computed in float32 whatever autocast is active, in query chunks (chunk x T, never
T x T); `probe_attention` runs its forward pass with autocast off, so the projections are float32
too and the numbers do not depend on the device's mixed precision. The model's own attention then
runs unchanged (SDPA, or the family's eager attention where it needs one). With a padding mask,
padded tokens are left out of every statistic.

The probe keeps no state outside its call: the attention functions it registers with transformers
(once per name, idempotently) hold no results, and each `record_attention_logits` block attaches
its own recorder to the modules of the one model it probes. Probes of different models in
different threads, a probe nested in another, and the layers of one model run one by one (in
other threads too) each record exactly their own model. What a pass measured is reduced over heads
and layers by merit_core.precursors alone.

This module sits below both train/ (which records the cheap statistics at its eval cadence) and
diagnostics/ (`merit inspect`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from merit_core.metric_names import (
    ATTENTION_ENTROPY_MEAN,
    ATTENTION_ENTROPY_MIN,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MEAN,
    NORMALIZED_ENTROPY_MIN,
)
from merit_core.models import family_spec
from merit_core.precursors import (
    ActivationStats,
    OutputLogitStats,
    Precursors,
    eval_record,
    over_heads,
    over_layers,
    peak,
)

PROBE_NAME = "merit_logit_probe"  # delegates to SDPA
EAGER_PROBE_NAME = "merit_logit_probe_eager"  # delegates to the family's eager attention
# The attribute of each module of a model being probed that holds the recorder of that call: the
# attention function, shared by every model of the process, finds its recorder through the module
# it is handed, so each model records into its own call's recorder and no state is shared.
RECORDER_ATTRIBUTE = "_merit_logit_recorder"


class LogitRecorder:
    """Running max attention logit per (layer, head), filled during forward passes; with `entropy`,
    also the running sum, count and min of the attention entropy (plain and normalised) per head.

    One recorder belongs to one `record_attention_logits` block of one model; its lock makes the
    updates of layers that run in other threads (a layer-at-a-time probe) safe."""

    def __init__(self, query_chunk: int = 128, entropy: bool = False):
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
        self.query_chunk = query_chunk
        self.entropy = entropy
        self.query_valid: torch.Tensor | None = None  # [B, T] bool: the tokens that are not padding
        self.per_layer: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}
        self.entropies: dict[int, EntropyAccumulator] = {}
        self.lock = threading.Lock()

    def update(self, layer_idx: int, head_max: torch.Tensor, scaling: float) -> None:
        with self.lock:
            prev = self.per_layer.get(layer_idx)
            self.per_layer[layer_idx] = head_max if prev is None else torch.maximum(prev, head_max)
            self.scaling[layer_idx] = scaling

    def entropy_of(self, layer_idx: int, n_heads: int, device: torch.device) -> EntropyAccumulator:
        """The entropy accumulator of a layer, made on its first pass."""
        with self.lock:
            if layer_idx not in self.entropies:
                self.entropies[layer_idx] = EntropyAccumulator(n_heads, device)
            return self.entropies[layer_idx]

    def result(self) -> torch.Tensor:
        """[n_layers, n_heads] float32 tensor on CPU, layers in index order."""
        if not self.per_layer:
            raise RuntimeError("no attention layer was seen; is the model a transformers causal LM?")
        return torch.stack([self.per_layer[i].float().cpu() for i in sorted(self.per_layer)])

    def entropy_result(self) -> dict[str, torch.Tensor]:
        """{'mean', 'min', 'normalized_mean', 'normalized_min'}: [n_layers, n_heads] float32 on CPU
        (NaN for a head with no position seeing two keys)."""
        accs = [self.entropies[i] for i in sorted(self.entropies)]
        return {
            k: torch.stack([getattr(a, k)() for a in accs])
            for k in ("mean", "min", "normalized_mean", "normalized_min")
        }


class EntropyAccumulator:
    """Per-head sums, counts and minima of the attention entropy over query positions."""

    def __init__(self, n_heads: int, device: torch.device):
        zeros = lambda: torch.zeros(n_heads, device=device, dtype=torch.float64)  # noqa: E731
        self.total, self.norm_total, self.count = zeros(), zeros(), zeros()
        self.low = torch.full((n_heads,), math.inf, device=device, dtype=torch.float64)
        self.norm_low = self.low.clone()

    def add(self, entropy: torch.Tensor, normalized: torch.Tensor, valid: torch.Tensor) -> None:
        """entropy, normalized, valid: [B, H, C] (valid: positions seeing >= 2 keys, not padding)."""
        e, n = entropy.double(), normalized.double()
        self.total += torch.where(valid, e, 0.0).sum(dim=(0, 2))
        self.norm_total += torch.where(valid, n, 0.0).sum(dim=(0, 2))
        self.count += valid.sum(dim=(0, 2))
        self.low = torch.minimum(self.low, torch.where(valid, e, math.inf).amin(dim=(0, 2)))
        self.norm_low = torch.minimum(self.norm_low, torch.where(valid, n, math.inf).amin(dim=(0, 2)))

    def _none_seen(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.count > 0, x, math.nan).float().cpu()

    def mean(self) -> torch.Tensor:
        return self._none_seen(self.total / self.count.clamp(min=1))

    def min(self) -> torch.Tensor:
        return self._none_seen(self.low)

    def normalized_mean(self) -> torch.Tensor:
        return self._none_seen(self.norm_total / self.count.clamp(min=1))

    def normalized_min(self) -> torch.Tensor:
        return self._none_seen(self.norm_low)


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
        out = torch.full((query.shape[1],), float("-inf"), device=query.device, dtype=torch.float32)
        for logits, allowed in _logit_chunks(query, key, attention_mask, scaling, query_chunk):
            out = torch.maximum(out, logits.masked_fill_(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
        return out


def _logit_chunks(query, key, attention_mask, scaling, query_chunk, query_valid=None):
    """Per chunk of queries: (scaled float32 logits [B, H, C, Tk], allowed [.., .., C, Tk] or
    [C, Tk] bool) and, with `query_valid` given, also the chunk's slice of it ([B, C]); padded
    query rows are then left out of the max too. The logits are the chunk's own tensor, for the
    caller to mask in place (no second tensor of their size)."""
    _, h, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if hkv != h:
        key = key.repeat_interleave(h // hkv, dim=1)
    k_t = key.float().transpose(-1, -2)
    offset = tk - tq  # absolute position of query row 0 among the keys
    key_pos = torch.arange(tk, device=query.device)
    for start in range(0, tq, query_chunk):
        stop = min(start + query_chunk, tq)
        logits = (query[:, :, start:stop].float() @ k_t).mul_(scaling)  # [B, H, C, Tk]
        if attention_mask is None:
            q_pos = torch.arange(start, stop, device=query.device) + offset
            allowed = key_pos[None, :] <= q_pos[:, None]  # [C, Tk]
        else:
            mask = attention_mask[..., start:stop, :]
            allowed = mask if mask.dtype == torch.bool else mask.float() > torch.finfo(torch.float32).min / 2
        if query_valid is None:
            yield logits, allowed
        else:
            rows = query_valid[:, start:stop]  # [B, C]
            yield logits, allowed & rows[:, None, :, None], rows


def _entropy_chunk(masked, logits, allowed, rows, softcap, acc: EntropyAccumulator) -> None:
    """Entropy -sum p log p (torch.special.entr: no cancellation when one key takes all) of the
    softmax over allowed keys of the (soft-capped) logits, per (b, h, query). `masked` is `logits`
    with disallowed pairs at -inf (shared with the max; `logits` may be that same tensor: a
    disallowed pair is -inf again after the cap)."""
    z = masked if not softcap else (softcap * torch.tanh(logits / softcap)).masked_fill_(~allowed, float("-inf"))
    p = torch.softmax(z, dim=-1)
    entropy = torch.special.entr(p, out=p).sum(dim=-1)  # [B, H, C]; NaN for a row with no key
    n_keys = allowed.sum(dim=-1)
    b, h, c = entropy.shape
    valid = (n_keys >= 2).expand(b, h, c) & rows[:, None, :].expand(b, h, c)
    normalized = entropy / torch.log(n_keys.clamp(min=2).to(entropy.dtype))
    acc.add(entropy, normalized, valid)


def _record(module, query, key, attention_mask, scaling, softcap=None) -> None:
    recorder = getattr(module, RECORDER_ATTRIBUTE, None)
    if recorder is None:  # the model's attention runs outside a recording block
        return
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = int(module.layer_idx)
    with torch.no_grad(), full_fp32(query.device.type):
        q, k = query.detach(), key.detach()
        valid = recorder.query_valid
        if valid is None or valid.shape[1] != q.shape[2]:
            valid = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
        head_max = torch.full((q.shape[1],), float("-inf"), device=q.device, dtype=torch.float32)
        acc = recorder.entropy_of(layer, q.shape[1], q.device) if recorder.entropy else None
        for logits, allowed, rows in _logit_chunks(q, k, attention_mask, scale, recorder.query_chunk, valid):
            masked = logits.masked_fill_(~allowed, float("-inf"))  # in place: the chunk's own logits
            head_max = torch.maximum(head_max, masked.amax(dim=(0, 2, 3)))
            if acc is not None:
                with recorder.lock:
                    _entropy_chunk(masked, logits, allowed, rows, softcap, acc)
    recorder.update(layer, head_max, float(scale))


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _record(module, query, key, attention_mask, scaling, kwargs.get("softcap"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _probe_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _record(module, query, key, attention_mask, scaling, kwargs.get("softcap"))
    eager = sys.modules[type(module).__module__].eager_attention_forward  # the family's own (soft-capping)
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _register() -> None:
    """Make the probe's attention implementations known to transformers. Idempotent: it maps the
    same names to the same functions on every call, and those functions hold no results."""
    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
    AttentionInterface.register(EAGER_PROBE_NAME, _probe_eager_attention)
    AttentionMaskInterface.register(EAGER_PROBE_NAME, eager_mask)


@contextlib.contextmanager
def record_attention_logits(model, query_chunk: int = 128, entropy: bool = False) -> Iterator[LogitRecorder]:
    """Within the block, forward passes of `model` (of the whole model, or of its layers one by one)
    record max attention logits per layer and head (and, with `entropy`, attention entropies) into
    the recorder it yields.

    The recorder is this block's alone: it is attached to the modules of `model` (the attention
    function finds it through the module it runs for), so blocks on different models, in one
    thread or several, each record their own model, and a block nested in another on the same
    model records into the inner recorder until it ends. One model is probed by one thread at a
    time (its attention implementation is switched for the block). The model's attention
    implementation is switched to the probe and restored on exit; models running eager attention
    (Gemma 2's soft-capping) keep eager attention behind the probe.
    """
    _register()
    previous = model.config._attn_implementation
    recorder = LogitRecorder(query_chunk, entropy)
    modules = list(model.modules())
    held = [vars(m).get(RECORDER_ATTRIBUTE) for m in modules]
    model.set_attn_implementation(EAGER_PROBE_NAME if previous in ("eager", EAGER_PROBE_NAME) else PROBE_NAME)
    for m in modules:
        vars(m)[RECORDER_ATTRIBUTE] = recorder
    try:
        yield recorder
    finally:
        for m, before in zip(modules, held):
            if before is None:
                vars(m).pop(RECORDER_ATTRIBUTE, None)
            else:
                vars(m)[RECORDER_ATTRIBUTE] = before
        model.set_attn_implementation(previous)


def activation_stats(hidden: torch.Tensor, valid: torch.Tensor | None = None) -> ActivationStats:
    """Statistics of a hidden state [B, T, d] over its tokens where `valid` ([B, T] bool) holds."""
    a = hidden.detach().float().abs()
    if valid is not None:
        a = a.masked_fill(~valid[..., None], -1.0)  # below any |h|: never the max
    flat = int(a.argmax())
    b, rest = divmod(flat, a.shape[1] * a.shape[2])
    t, d = divmod(rest, a.shape[2])
    kept = a[valid] if valid is not None else a
    return ActivationStats(float(a.view(-1)[flat]), float(kept.median()), b, t, d)


def output_logit_stats(logits: torch.Tensor, valid: torch.Tensor | None = None) -> OutputLogitStats:
    """Statistics of output logits [B, T, V] over the positions where `valid` ([B, T]) holds."""
    x = logits.detach().float()
    x = x[valid] if valid is not None else x.reshape(-1, x.shape[-1])
    log_z = torch.logsumexp(x, dim=-1)
    max_abs = max(float(x.amax()), -float(x.amin()))  # without an |x| copy of the logits
    return OutputLogitStats(max_abs, float(log_z.mean()), float(log_z.std(unbiased=False)), float(log_z.max()))


@dataclass
class ProbeResult:
    """What one probe forward pass measured, per layer in index order."""

    max_logits: torch.Tensor  # [n_layers, n_heads] float32 on CPU
    scaling: list[float]  # the factor each layer's attention multiplies q.k by
    input_max_l1: list[float] | None  # largest l1 norm of a token's attention input (with inputs=True)
    # with instability=True: attention entropy [n_layers, n_heads] ('mean', 'min', 'normalized_mean',
    # 'normalized_min'), the residual stream after each layer, the output logits
    entropy: dict[str, torch.Tensor] | None = None
    activations: list[ActivationStats] | None = None
    output: OutputLogitStats | None = None
    input_max_l2: list[float] | None = None  # largest l2 norm of a token's attention input (with inputs=True)

    def precursors(self) -> Precursors:
        """This pass as the one precursors record inspect, the verdict and a run's records read: per
        layer and head, and per layer reduced over the heads (merit_core.precursors.over_heads: the
        max logit by max, an entropy's mean by the mean of the heads' means, its min by their min).
        The head named per layer is the first holding the layer's max logit."""
        heads = self.max_logits.tolist()
        per_head = {name: self.entropy[key].tolist() for name, key in ENTROPY_KEYS.items()} if self.entropy else {}
        entropy = {name: [over_heads(name, v) for v in rows] for name, rows in per_head.items()}
        top = [peak(MAX_ATTENTION_LOGIT, values) for values in heads]
        return Precursors(
            max_logit=[over_heads(MAX_ATTENTION_LOGIT, values) for values in heads],
            max_logit_head=[values.index(t[0]) if t else None for values, t in zip(heads, top)],
            entropy_min=entropy.get(NORMALIZED_ENTROPY_MIN, ()),
            activation_ratio=[a.ratio for a in self.activations] if self.activations else (),
            log_z_mean=self.output.log_z_mean if self.output is not None else None,
            heads_max_logit=heads,
            entropy=entropy,
            heads_entropy=per_head,
            activations=self.activations or (),
            output=self.output,
        )

    def eval_metrics(self) -> dict[str, Any]:
        """What a run's eval record holds of this pass (merit_core.precursors.eval_record)."""
        return eval_record(self.precursors())

    def overall_metrics(self) -> dict[str, float]:
        """`eval_metrics` as one number each over the layers (merit_core.precursors.over_layers): the
        largest max logit and activation ratio, the smallest normalised entropy, the mean log Z."""
        found = {k: over_layers(k, v) for k, v in self.eval_metrics().items()}
        return {k: math.nan if v is None else v for k, v in found.items()}  # None: every layer NaN


# Entropy statistics: their names in metrics and reports -> the key of ProbeResult.entropy.
ENTROPY_KEYS: Final[Mapping[str, str]] = MappingProxyType(
    {
        ATTENTION_ENTROPY_MEAN: "mean",
        ATTENTION_ENTROPY_MIN: "min",
        NORMALIZED_ENTROPY_MEAN: "normalized_mean",
        NORMALIZED_ENTROPY_MIN: "normalized_min",
    }
)


@torch.no_grad()
def probe_attention(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    query_chunk: int = 128,
    inputs: bool = False,
    instability: bool = False,
) -> ProbeResult:
    """One forward pass with autocast off: max attention logits per layer and head, the scaling
    each layer used and, with `inputs`, the largest l1 norm of a token of each attention module's
    input (what W_Q and W_K multiply; located through the model family's spec). With
    `instability`, the same pass also measures attention entropy, the residual stream's
    activations after each layer and the output logits' log Z (see the module docstring)."""
    was_training = model.training
    model.eval()
    found: dict[int, float] = {}
    found_l2: dict[int, float] = {}
    acts: dict[int, ActivationStats] = {}
    valid = attention_mask.bool() if attention_mask is not None and attention_mask.ndim == 2 else None
    hooks = []
    try:
        if inputs or instability:
            spec = family_spec(model.config)
            base = getattr(model, model.base_model_prefix)
            for i in range(spec.n_layers(model.config)):
                if inputs:

                    def hook(module, args, kwargs, i=i):
                        x = args[0] if args else kwargs["hidden_states"]
                        x = x.detach().float()
                        found[i] = float(x.abs().sum(dim=-1).max())
                        found_l2[i] = float(x.norm(dim=-1).max())

                    module = base.get_submodule(spec.attention.block.format(i=i))
                    hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
                if instability:

                    def after(module, args, output, i=i):
                        h = output[0] if isinstance(output, tuple) else output
                        acts[i] = activation_stats(h, valid)

                    layer = base.get_submodule(spec.attention.layer_block.format(i=i))
                    hooks.append(layer.register_forward_hook(after))
        with contextlib.ExitStack() as stack:
            stack.enter_context(full_fp32("cpu", input_ids.device.type))
            rec = stack.enter_context(record_attention_logits(model, query_chunk, entropy=instability))
            rec.query_valid = valid
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    scaling = [rec.scaling[i] for i in sorted(rec.scaling)]
    result = ProbeResult(rec.result(), scaling, [found[i] for i in sorted(found)] if inputs else None)
    if inputs:
        result.input_max_l2 = [found_l2[i] for i in sorted(found_l2)]
    if instability:
        result.entropy = rec.entropy_result()
        result.activations = [acts[i] for i in sorted(acts)]
        result.output = output_logit_stats(out.logits, valid)
    return result


def max_attention_logits(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, query_chunk: int = 128
) -> torch.Tensor:
    """Max attention logit per layer and head, [n_layers, n_heads], on one batch of token ids.

    The forward pass runs with autocast and TF32 off (on the model's device and the CPU), so a call
    from inside a mixed-precision training step measures the same float32 logits as one outside it.
    """
    return probe_attention(model, input_ids, attention_mask, query_chunk).max_logits
