"""The training loss of a causal LM without its full [batch, seq, vocab] logits in memory.

A plain `F.cross_entropy(model(x).logits.float(), y)` holds the fp32 logits, their bf16 copy
under autocast and the softmax saved for backward: for GPT-2's 50257-token vocabulary that is
~0.6 MB per token, ~40 GB for one 64 x 1024 micro-batch. Here the output layer computes the
summed cross-entropy itself, a chunk of tokens at a time, and computes each chunk's gradients
(with respect to the hidden states, the weight and the bias) right away, in the forward pass:
softmax(logits) - onehot(target) is the gradient of the summed loss with respect to the chunk's
logits, so the logits are made, turned into the loss and the two gradient products, and dropped.
At most one chunk of logits exists at once, and the output layer costs the same three matrix
products as the plain loss (forward, grad-input, grad-weight); the backward pass only scales the
stored gradients by the incoming one. Under no_grad (evaluation) only the loss is computed.

The chunk step (logits, log-sum-exp, softmax - onehot, the two products) is one function,
compiled with torch.compile on CUDA so that the element-wise work between the matrix products is
fused into a kernel or two (`fused=True`, see `LossHead.compiled`); on CPU it runs eagerly.

The loss is computed inside the model's forward (the output layer is the model's own
`lm_head`, whose class is switched in place to `LossHead`, a `torch.nn.Linear` subclass: the
parameters, their names, weight tying and `save_pretrained` are unchanged). So DDP, FSDP2 and
torch.compile see an ordinary forward; a wrapper's hooks and parameter gathering apply as
usual. The targets reach the output layer through `targets_for(model, labels)`, a context
manager; outside it the layer returns logits as before (evaluation, generation, the Sophia-G
Hessian refresh, saving). For the families where Liger Kernel is used (merit_core.train.liger_kernels)
the head calls Liger's fused linear cross-entropy instead of the chunk step here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F

# Bytes of fp32 logits per chunk: small against any GPU's memory, large enough that the chunk's
# matrix product keeps the tensor cores busy (GPT-2: ~1300 tokens x 50257).
CHUNK_BYTES = 256 * 2**20


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits take about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), target, reduction="sum")


def _chunk_step(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor):
    """One chunk's summed loss and its gradients: (loss, d loss / d hidden, d loss / d weight,
    d loss / d bias or None). hidden and weight are in the compute dtype; the softmax, the loss
    and the bias gradient are fp32, the gradient products run in the compute dtype."""
    logits = F.linear(hidden, weight, bias).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, target[:, None]).squeeze(1)).sum()
    grad = torch.exp(logits - lse[:, None])  # softmax
    grad.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], -1.0))  # - onehot(target)
    grad_bias = grad.sum(0) if bias is not None else None
    grad = grad.to(hidden.dtype)
    return loss, grad @ weight, grad.t() @ hidden, grad_bias


_compiled_chunk_step = None


def _step_fn(fused: bool):
    """The chunk step, compiled once per process when `fused` (inductor fuses the element-wise work)."""
    global _compiled_chunk_step
    if not fused:
        return _chunk_step
    if _compiled_chunk_step is None:
        _compiled_chunk_step = torch.compile(_chunk_step, dynamic=False)
    return _compiled_chunk_step


class _LinearCrossEntropy(torch.autograd.Function):
    """sum(cross_entropy(hidden @ weight.T + bias, target)) with its gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk_tokens, compute_dtype, fused):
        step = _step_fn(fused)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            part = slice(start, start + chunk_tokens)
            loss, g_h, g_w, g_b = step(hidden[part].to(compute_dtype), w, b, target[part])
            total += loss
            grad_hidden[part] = g_h
            grad_weight += g_w
            if grad_bias is not None:
                grad_bias += g_b
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        grad_bias = grad_bias * grad_out if grad_bias is not None else None
        return grad_hidden * grad_out, (grad_weight * grad_out).to(ctx.weight_dtype), grad_bias, None, None, None, None


def _compute_dtype(tensor: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What F.linear would multiply in here: the autocast dtype when autocast is on, else the weight's."""
    kind = tensor.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    chunk_tokens: int,
    fused: bool = False,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, target), in fp32, chunk by chunk.

    hidden: [..., d]; target: [...] (same leading shape). Equal to the unchunked sum up to the
    order of the fp32 additions. With gradients enabled, the gradients are made chunk by chunk in
    this call (see the module docstring); without, only the loss. `fused`: compile the chunk step.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    needs_grad = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in (hidden, weight, bias))
    if needs_grad:
        dtype = _compute_dtype(h, weight)
        with torch.autocast(h.device.type, enabled=False):
            return _LinearCrossEntropy.apply(h, weight, bias, t, chunk_tokens, dtype, fused)
    total: torch.Tensor | None = None
    for start in range(0, h.shape[0], chunk_tokens):
        part = _chunk_loss(h[start : start + chunk_tokens], weight, bias, t[start : start + chunk_tokens])
        total = part if total is None else total + part
    if total is None:  # no tokens: the empty sum, as cross_entropy(reduction="sum") gives it
        return h.new_zeros((), dtype=torch.float32)
    return total


class LossHead(torch.nn.Linear):
    """A causal LM's output layer that returns the summed cross-entropy when targets are set.

    Not constructed directly: `install(model)` switches the class of the model's existing
    `torch.nn.Linear` output layer to this one.
    """

    targets: torch.Tensor | None
    chunk_tokens: int
    fused: bool  # compile the chunk step (CUDA)
    loss_fn: Callable | None  # (hidden, weight, bias, target) -> summed loss in place of the chunk loop

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        if self.loss_fn is not None:
            h = hidden.reshape(-1, hidden.shape[-1])
            dtype = _compute_dtype(h, self.weight)
            bias = self.bias.to(dtype) if self.bias is not None else None
            with torch.autocast(h.device.type, enabled=False):
                return self.loss_fn(h.to(dtype), self.weight.to(dtype), bias, self.targets.reshape(-1))
        return chunked_cross_entropy(hidden, self.weight, self.bias, self.targets, self.chunk_tokens, self.fused)


def install(
    model: torch.nn.Module, chunk_tokens: int | None = None, fused: bool = False, loss_fn: Callable | None = None
) -> LossHead | None:
    """Make `model`'s output layer a LossHead (idempotent; the arguments given replace the head's
    settings); None when it is not a plain Linear (then the caller computes the loss from the
    logits). `fused`: compile the chunk step; `loss_fn`: a fused linear cross-entropy to call
    instead of the chunk loop (Liger's, see merit_core.train.liger_kernels)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, LossHead):
        if type(head) is not torch.nn.Linear or _transforms_logits(getattr(model, "config", None)):
            return None
        head.__class__ = LossHead
        head = cast(LossHead, head)  # the same module, its class switched above
        head.targets = None
        head.chunk_tokens = chunk_tokens_for(head.out_features)
    if chunk_tokens is not None:
        head.chunk_tokens = chunk_tokens
    head.fused = fused
    head.loss_fn = loss_fn
    return head


def _transforms_logits(config) -> bool:
    """True for models whose forward changes the logits after the output layer (soft-capping,
    scaling): their loss must be computed from the logits they return."""
    return any(getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


@contextlib.contextmanager
def targets_for(head: LossHead | None, targets: torch.Tensor) -> Iterator[bool]:
    """While active, `head` returns the summed loss against `targets`; yields whether it does
    (False for None, a model whose output layer could not be installed)."""
    if head is None:
        yield False
        return
    head.targets = targets
    try:
        yield True
    finally:
        head.targets = None
