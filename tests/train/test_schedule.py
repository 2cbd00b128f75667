"""lr_at: linear warmup, then cosine decay to exactly min_lr at the last update."""

import pytest

from merit_core.schedule import lr_at


def test_warmup_then_cosine_shape():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=111)
    lrs = [lr_at(s, **kw) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(lrs[:10], lrs[1:10]))  # rising during warmup
    assert lrs[10] == 1.0 and all(b < a for a, b in zip(lrs[10:], lrs[11:]))  # peak, then strictly decaying
    assert lrs[-1] == pytest.approx(0.1)  # min lr at the last update
    assert lrs[60] == pytest.approx(0.55)  # half way through the cosine
    assert lr_at(500, **kw) == pytest.approx(0.1)


def test_no_warmup_and_degenerate_lengths():
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=5) == 2.0
    assert lr_at(4, lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=5) == pytest.approx(0.0)
    assert lr_at(0, lr=2.0, min_lr=0.2, warmup_steps=0, total_steps=1) == 2.0
    assert [lr_at(s, lr=1.0, min_lr=0.0, warmup_steps=4, total_steps=4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize(("warmup", "total", "min_lr"), [(10, 111, 0.1), (0, 50, 0.0), (3, 7, 0.25)])
def test_same_values_as_transformers_min_lr_cosine(warmup, total, min_lr):
    """transformers' get_cosine_with_min_lr_schedule_with_warmup over the updates 0..total-1, with the
    warmup read one update ahead (the first update is not spent at lr 0) and the decay ending at the
    last update (not after it): the same numbers, so only where the ends fall differs."""
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    hf = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup, num_training_steps=total - 1, min_lr=2.0 * min_lr
    ).lr_lambdas[0]
    for step in range(total):
        want = 2.0 * hf(step + 1 if step < warmup else step)
        assert lr_at(step, lr=2.0, min_lr=2.0 * min_lr, warmup_steps=warmup, total_steps=total) == pytest.approx(
            want, rel=1e-12, abs=1e-15
        )
    assert hf(0) == 0.0 or warmup == 0  # transformers' own first update: lr 0 during warmup
