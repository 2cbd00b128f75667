"""Training and validation batches cut from a flat token stream.

The training sampler is stateless: the global batch of update `step` is a set of random
window offsets drawn from a generator seeded by (seed, step). Each process takes its
contiguous slice of that global batch and cuts it into micro-batches, so a resumed run, a
run with a different micro-batch size, and a DDP run all see exactly the sequences of the
uninterrupted single-process run. Validation batches are evenly spaced fixed windows.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from merit_core.errors import DataError


def check_split_length(n_tokens: int, seq_len: int, split: str) -> None:
    """DataError unless a split holds at least one window of seq_len + 1 tokens."""
    if n_tokens < seq_len + 1:
        raise DataError(
            f"the {split} split has {n_tokens} tokens, fewer than one sequence of seq_len + 1 = {seq_len + 1}; "
            "use more data or a shorter --seq-len"
        )


def _windows(
    tokens: np.ndarray, offsets: np.ndarray, seq_len: int, pin_memory: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels): two contiguous int64 [n, seq_len] tensors, in page-locked memory if
    `pin_memory` (needs CUDA), so that copies to the GPU can be asynchronous."""
    rows = torch.from_numpy(np.stack([np.asarray(tokens[o : o + seq_len + 1]) for o in offsets]).astype(np.int64))
    x = torch.empty((len(offsets), seq_len), dtype=torch.int64, pin_memory=pin_memory)
    y = torch.empty((len(offsets), seq_len), dtype=torch.int64, pin_memory=pin_memory)
    x.copy_(rows[:, :-1])
    y.copy_(rows[:, 1:])
    return x, y


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Copy tensors to `device`; asynchronously only from pinned, contiguous host memory (an
    asynchronous copy from pageable memory is staged synchronously anyway, and one from a
    buffer that is reused before it finishes would read the new contents)."""
    return tuple(t.to(device, non_blocking=t.is_pinned() and t.is_contiguous()) for t in batch)


class TrainBatches:
    """Deterministic (seed, step) -> global batch of windows; sliced per rank and micro-batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, pin_memory: bool = False):
        check_split_length(len(tokens), seq_len, "train")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.pin_memory = pin_memory  # page-locked host tensors, for asynchronous copies to a GPU

    def offsets(self, step: int, batch_size: int) -> np.ndarray:
        """Start offsets of the `batch_size` windows of update `step` (0-based)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=batch_size, dtype=np.int64)

    def micro_batches(
        self, step: int, *, batch_size: int, micro_batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, labels) contiguous int64 CPU tensors [micro, seq_len] for this rank, in order
        (pinned when the sampler was made with `pin_memory`)."""
        per_rank = batch_size // world_size
        mine = self.offsets(step, batch_size)[rank * per_rank : (rank + 1) * per_rank]
        for start in range(0, per_rank, micro_batch_size):
            yield _windows(self.tokens, mine[start : start + micro_batch_size], self.seq_len, self.pin_memory)


def val_batches(
    tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` fixed (input_ids, labels) batches of evenly spaced windows over the val split.

    Independent of the seed, so runs being compared are scored on the same tokens. The first
    batch is the one the max attention logit is measured on.
    """
    check_split_length(len(tokens), seq_len, "validation")
    count = n_batches * batch_size
    offsets = np.linspace(0, len(tokens) - seq_len - 1, num=count).astype(np.int64)
    return [_windows(tokens, offsets[i : i + batch_size], seq_len) for i in range(0, count, batch_size)]
