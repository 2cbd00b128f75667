"""Update size from optimizer state: the optimizer's own zero-gradient step equals an independent
computation here from the same m, v, w (MERIT, AdamW, LAMB); MERIT's ratio shares follow a planted row
(a `merit train` checkpoint read back with the run's optimizer and schedule: test_instability_inspect.py)."""

import math

import pytest
import torch

from merit_core.diagnostics.update_size import update_sizes
from merit_core.optim import build_optimizer

LR, WD, T = 0.01, 0.1, 3


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 5, bias=False)
        self.down = torch.nn.Linear(5, 4, bias=False)


def _prepared(name: str, weight_decay: float = WD):
    """A model and its optimizer after T real steps, then moments set to known random values."""
    torch.manual_seed(0)
    model = Tiny().double()  # as checkpoint_update_sizes measures
    opt = build_optimizer(name, model, lr=LR, weight_decay=weight_decay)
    for _ in range(T):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        st = opt.state[p]
        st["exp_avg"].copy_(torch.randn(p.shape, generator=gen) * 0.1)
        st["exp_avg_sq"].copy_(torch.rand(p.shape, generator=gen) * 0.01 + 1e-4)
    saved = {
        n: (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
        for n, p in model.named_parameters()
    }
    return model, opt, saved


def _rms(x):
    return float(x.double().pow(2).mean().sqrt())


def _merit_delta(w, m, v, b1=0.9, b2=0.95, eps=1e-6, clip=1.0):
    """MERIT defaults (no bias correction, max-norm, element-wise, weight bound, clip 1), g = 0."""
    m, v = b1 * m, b2 * v
    u = m / (v.sqrt() + eps) + WD * w
    row = w.abs().amax(1, keepdim=True) / u.abs().amax(1, keepdim=True)
    col = w.abs().amax(0, keepdim=True) / u.abs().amax(0, keepdim=True)
    b = w.abs().max() / u.abs().max()
    s = torch.maximum(torch.maximum(row, col), b)
    return LR * (s * u).clamp(-clip, clip), s, u, (row, col, b)


def _adamw_delta(w, m, v, b1=0.9, b2=0.95, eps=1e-8):
    t = T + 1
    m, v = b1 * m, b2 * v
    decayed = w * (1 - LR * WD)
    new = decayed - LR / (1 - b1**t) * m / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
    return w - new


def _lamb_delta(w, m, v, b1=0.9, b2=0.95, eps=1e-6):
    t = T + 1
    m, v = b1 * m, b2 * v
    u = m / (v.sqrt() + eps) + WD * w  # coupled decay (weight_decouple=False), no second-moment correction
    trust = min(float(w.norm()), 10.0) / (float(u.norm()) + eps)
    return LR / (1 - b1**t) * trust * u


@pytest.mark.parametrize("name", ["merit", "adamw", "lamb"])
def test_update_ratio_equals_independent_computation(name):
    model, opt, saved = _prepared(name)
    report = update_sizes(model, opt, step=T, name=name)
    assert [w.name for w in report.weights] == ["up.weight", "down.weight"]
    for size in report.weights:
        w, m, v = saved[size.name]
        if name == "merit":
            delta = _merit_delta(w, m, v)[0]
        else:
            delta = (_adamw_delta if name == "adamw" else _lamb_delta)(w, m, v)
        want = _rms(delta) / _rms(w)
        assert size.ratio == pytest.approx(want, rel=1e-6), size.name
        assert size.weight_rms == pytest.approx(_rms(w), rel=1e-12)
    assert report.max_ratio == max(s.ratio for s in report.weights)


def test_merit_ratio_shares_and_clip_equal_independent_computation():
    model, opt, saved = _prepared("merit")
    size = update_sizes(model, opt).weights[0]
    w, m, v = saved["up.weight"]
    _, s, u, (row, col, b) = _merit_delta(w, m, v)
    row, col = row.expand_as(w), col.expand_as(w)
    row_wins = (row >= col) & (row >= b)
    col_wins = ~row_wins & (col >= b)
    assert size.merit.share_row == pytest.approx(float(row_wins.float().mean()))
    assert size.merit.share_col == pytest.approx(float(col_wins.float().mean()))
    assert size.merit.share_weight == pytest.approx(float((~row_wins & ~col_wins).float().mean()))
    assert size.merit.clipped == pytest.approx(float(((s * u).abs() > 1.0).float().mean()))
    assert size.merit.percentiles[100] == pytest.approx(float(s.max()), rel=1e-6)
    assert size.merit.percentiles[0] == pytest.approx(float(s.min()), rel=1e-6)


def test_merit_large_row_shows_its_row_ratio_winning():
    """A row of large weights with a small update (no weight decay, which would make its update
    large too): MERIT's row ratio governs every element of that row and sets the largest s."""
    plain = update_sizes(*_prepared("merit", weight_decay=0.0)[:2]).weights[0].merit
    model, opt, _ = _prepared("merit", weight_decay=0.0)
    with torch.no_grad():
        model.up.weight[2].mul_(100)
        opt.state[model.up.weight]["exp_avg"][2].mul_(0.01)
        w, m, v = (
            model.up.weight.clone(),
            0.9 * opt.state[model.up.weight]["exp_avg"],
            0.95 * opt.state[model.up.weight]["exp_avg_sq"],
        )
    planted = update_sizes(model, opt).weights[0].merit
    u = m / (v.sqrt() + 1e-6)
    row2 = float(w[2].abs().max() / u[2].abs().max())
    assert planted.share_row >= 1 / 5  # the 6 elements of row 2 (of 5 x 6) at least
    assert planted.percentiles[100] == pytest.approx(row2, rel=1e-9)
    assert planted.percentiles[100] > 1000 * plain.percentiles[100]
