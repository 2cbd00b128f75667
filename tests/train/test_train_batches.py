"""The (seed, step) sampler: the same sequences whatever the split over ranks and micro-batches."""

import numpy as np
import pytest
import torch

from merit_core.errors import DataError
from merit_core.train.batches import TrainBatches, val_batches

TOKENS = np.arange(10_000, dtype=np.uint16) % 997


def _global(batches, step, **split):
    parts = []
    for rank in range(split.get("world_size", 1)):
        parts += [x for x, _ in batches.micro_batches(step, batch_size=16, rank=rank, **split)]
    return torch.cat(parts)


def test_split_does_not_change_the_global_batch():
    b = TrainBatches(TOKENS, seq_len=24, seed=3)
    whole = _global(b, 5, micro_batch_size=16)
    assert whole.shape == (16, 24)
    for split in (
        {"micro_batch_size": 2},
        {"micro_batch_size": 4, "world_size": 2},
        {"micro_batch_size": 1, "world_size": 4},
    ):
        assert torch.equal(_global(b, 5, **split), whole)


def test_keyed_by_seed_and_step_and_labels_are_shifted():
    b = TrainBatches(TOKENS, seq_len=24, seed=3)
    assert np.array_equal(b.offsets(7, 8), TrainBatches(TOKENS, 24, 3).offsets(7, 8))  # a fresh sampler agrees
    assert not np.array_equal(b.offsets(7, 8), b.offsets(8, 8))
    assert not np.array_equal(b.offsets(7, 8), TrainBatches(TOKENS, 24, 4).offsets(7, 8))
    ((x, y),) = list(b.micro_batches(2, batch_size=4, micro_batch_size=4))
    offsets = b.offsets(2, 4)
    for row, o in enumerate(offsets):
        assert torch.equal(x[row], torch.from_numpy(TOKENS[o : o + 24].astype(np.int64)))
        assert torch.equal(y[row], torch.from_numpy(TOKENS[o + 1 : o + 25].astype(np.int64)))
    assert offsets.max() <= len(TOKENS) - 25 and x.dtype == torch.int64


def test_val_batches_are_fixed_and_cover_the_split():
    vb = val_batches(TOKENS, n_batches=3, batch_size=4, seq_len=16)
    assert len(vb) == 3 and vb[0][0].shape == (4, 16)
    assert vb[0][0][0, 0] == 0 and vb[-1][1][-1, -1] == TOKENS[-1]  # first and last token of the split
    assert all(torch.equal(a[0], b[0]) for a, b in zip(vb, val_batches(TOKENS, 3, 4, 16)))


def test_too_little_data_is_a_data_error():
    with pytest.raises(DataError, match="fewer than one sequence"):
        TrainBatches(TOKENS[:10], seq_len=24, seed=0)
    with pytest.raises(DataError, match="validation split"):
        val_batches(TOKENS[:0], 1, 1, 8)
