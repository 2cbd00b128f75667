"""The training loss of a causal LM without its full [batch, seq, vocab] logits in memory.

A plain `F.cross_entropy(model(x).logits.float(), y)` holds the fp32 logits, their bf16 copy
under autocast and the softmax saved for backward: for GPT-2's 50257-token vocabulary that is
~0.6 MB per token, ~40 GB for one 64 x 1024 micro-batch. Here the output layer computes the
summed cross-entropy itself, a chunk of tokens at a time: each chunk's logits are made, reduced
to a loss and dropped, and rebuilt from the chunk's hidden states during backward (activation
checkpointing), so at most one chunk of logits exists at once. The price is the output layer's
matrix product once more in backward.

The loss is computed inside the model's forward (the output layer is the model's own
`lm_head`, whose class is switched in place to `LossHead`, a `torch.nn.Linear` subclass: the
parameters, their names, weight tying and `save_pretrained` are unchanged). So DDP, FSDP2 and
torch.compile see an ordinary forward; a wrapper's hooks and parameter gathering apply as
usual. The targets reach the output layer through `targets_for(model, labels)`, a context
manager; outside it the layer returns logits as before (evaluation, generation, the Sophia-G
Hessian refresh, saving).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Bytes of fp32 logits per chunk: small against any GPU's memory, large enough that the chunk's
# matrix product keeps the tensor cores busy (GPT-2: ~1300 tokens x 50257).
CHUNK_BYTES = 256 * 2**20


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits take about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor):
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), target, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, target), in fp32, chunk by chunk.

    hidden: [..., d]; target: [...] (same leading shape). Equal to the unchunked sum up to the
    order of the fp32 additions; one chunk (no checkpointing) when the tokens fit in one.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    n = h.shape[0]
    if n <= chunk_tokens:
        return _chunk_loss(h, weight, bias, t)
    total = None
    for start in range(0, n, chunk_tokens):
        part = checkpoint(
            _chunk_loss,
            h[start : start + chunk_tokens],
            weight,
            bias,
            t[start : start + chunk_tokens],
            use_reentrant=False,
        )
        total = part if total is None else total + part
    return total


class LossHead(torch.nn.Linear):
    """A causal LM's output layer that returns the summed cross-entropy when targets are set.

    Not constructed directly: `install(model)` switches the class of the model's existing
    `torch.nn.Linear` output layer to this one.
    """

    targets: torch.Tensor | None
    chunk_tokens: int

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        return chunked_cross_entropy(hidden, self.weight, self.bias, self.targets, self.chunk_tokens)


def install(model: torch.nn.Module, chunk_tokens: int | None = None) -> LossHead | None:
    """Make `model`'s output layer a LossHead (idempotent); None when it is not a plain Linear
    (then the caller computes the loss from the logits)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, LossHead):
        if chunk_tokens is not None:
            head.chunk_tokens = chunk_tokens
        return head
    if type(head) is not torch.nn.Linear or _transforms_logits(getattr(model, "config", None)):
        return None
    head.__class__ = LossHead
    head.targets = None
    head.chunk_tokens = chunk_tokens or chunk_tokens_for(head.out_features)
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
