"""The foreach backend's kernel launches per step, counted on meta tensors (no GPU needed), and
the launch counter itself."""

import pytest
import torch

from benchmarks.launches import count_step_launches, multi_tensor_apply_launches
from merit_core.optim.merit import MERIT


def gpt2_small_shapes(n_layer=12, d=768, vocab=50257, ctx=1024) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def test_multi_tensor_apply_model():
    assert multi_tensor_apply_launches([10] * 110, depth=1) == 1
    assert multi_tensor_apply_launches([10] * 111, depth=1) == 2
    assert multi_tensor_apply_launches([10] * 37, depth=4) == 2
    assert multi_tensor_apply_launches([320 * 65536], depth=1) == 1
    assert multi_tensor_apply_launches([320 * 65536 + 1], depth=1) == 2
    assert multi_tensor_apply_launches([0, 0], depth=2) == 0


@pytest.mark.parametrize(
    "kw", [dict(), dict(weight_decay=0.1, bias_correction=True), dict(norm="l2", lr=torch.tensor(1e-3))]
)
def test_foreach_gpt2_small_step_takes_at_most_700_launches(kw):
    shapes = gpt2_small_shapes()
    assert len(shapes) == 148
    merit = count_step_launches(lambda ps: MERIT(ps, implementation="foreach", **kw).step, shapes)
    reference = count_step_launches(lambda ps: MERIT(ps, implementation="reference", **kw).step, shapes)
    adamw = count_step_launches(lambda ps: torch.optim.AdamW(ps, foreach=True).step, shapes)
    assert merit <= 700, merit
    assert reference > 5 * merit and adamw < merit  # the counter sees the per-tensor path's cost
    # Per-tensor launches: about 7 per 2-D tensor (4 norms, scale, NaN->1, multiply) and 1 per 1-D one.
    more = count_step_launches(lambda ps: MERIT(ps, implementation="foreach", **kw).step, shapes + [(64, 32), (32,)])
    assert more - merit <= 10, (merit, more)


def test_foreach_step_has_no_host_sync():
    # On meta tensors any read of a value (.item(), bool(), float()) raises; the count completes.
    shapes = [(8, 4), (4,), (3, 2, 2)]
    for kw in (dict(bias_correction=True), dict(maximize=True, clip=None), dict(elementwise=False)):
        assert count_step_launches(lambda ps, kw=kw: MERIT(ps, implementation="foreach", **kw).step, shapes) > 0
