"""Sophia-G: hand-computed steps, the Hessian EMA, clipping, convergence, state round trip, sampled labels."""

import copy
import math

import pytest
import torch
from torch import nn

from merit_core.optim.sophia import SophiaG, sampled_label_loss

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare


def _set_grad(p, values):
    p.grad = torch.tensor(values, dtype=p.dtype)


def test_hand_computed_steps_with_and_without_hessian():
    lr, b1, b2, rho, wd, eps = 0.1, 0.9, 0.99, 0.5, 0.1, 1e-12
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64))
    opt = SophiaG([p], lr=lr, betas=(b1, b2), rho=rho, weight_decay=wd, eps=eps)

    # step 1: h = 0, so every coordinate is clipped: w <- w(1 - lr wd) - lr sign(m)
    g1 = [0.1, -0.2, 0.3, 0.0]
    _set_grad(p, g1)
    opt.step()
    w = [1.0, -2.0, 0.5, 3.0]
    m = [(1 - b1) * g for g in g1]
    w = [wi * (1 - lr * wd) - lr * math.copysign(1.0, mi) * (mi != 0) for wi, mi in zip(w, m)]
    assert p.tolist() == pytest.approx(w, abs=1e-15)

    # Hessian refresh on a sampled-label gradient g_h with n = 4 labels
    gh, n = [2.0, 0.1, 2.0, 1.0], 4
    _set_grad(p, gh)
    opt.update_hessian(n)
    h = [(1 - b2) * n * g * g for g in gh]
    assert opt.state[p]["hessian"].tolist() == pytest.approx(h, rel=1e-12)
    assert p.tolist() == pytest.approx(w, abs=1e-15)  # update_hessian never moves the weights

    # step 2: ratio = min(|m| / max(rho h, eps), 1); coordinates 0 and 2 unclipped, 1 clipped
    g2 = [0.01, -0.3, 0.02, 0.0]
    _set_grad(p, g2)
    opt.step()
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g2)]
    ratio = [min(abs(mi) / max(rho * hi, eps), 1.0) for mi, hi in zip(m, h)]
    assert ratio[0] < 1 and ratio[1] == 1.0 and ratio[2] < 1
    w = [wi * (1 - lr * wd) - lr * math.copysign(r, mi) * (mi != 0) for wi, mi, r in zip(w, m, ratio)]
    assert p.tolist() == pytest.approx(w, abs=1e-14)
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx(m, abs=1e-15)
    assert opt.state[p]["step"].item() == 2


def test_hessian_ema_over_two_refreshes():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = SophiaG([p], betas=(0.9, 0.8))
    g1, g2 = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64), torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)
    p.grad = g1.clone()
    opt.update_hessian(10)
    p.grad = g2.clone()
    opt.update_hessian(3)
    expected = 0.8 * (0.2 * 10 * g1**2) + 0.2 * 3 * g2**2
    torch.testing.assert_close(opt.state[p]["hessian"], expected)
    assert opt.state[p]["step"].item() == 0  # refreshing the Hessian is not a step


def test_every_element_moves_at_most_lr():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(16, 8))
    opt = SophiaG([p], lr=0.01, weight_decay=0.0, rho=1e-3)
    p.grad = torch.randn(16, 8) * 1e-3
    opt.update_hessian(1)  # tiny curvature: almost everything is clipped
    for _ in range(5):
        before = p.detach().clone()
        p.grad = torch.randn(16, 8) * 100
        opt.step()
        moved = (p.detach() - before).abs()
        assert moved.max().item() <= 0.01 + 1e-7
        assert (moved > 0.01 - 1e-7).float().mean().item() > 0.9  # the clipped ones move exactly lr


def test_converges_on_ill_conditioned_quadratic_with_exact_diagonal():
    # f(w) = 0.5 * sum a_i (w_i - c_i)^2 with curvatures spanning 1e4; feed h = a via update_hessian.
    torch.manual_seed(0)
    a = torch.logspace(-2, 2, 10, dtype=torch.float64)
    c = torch.randn(10, dtype=torch.float64)
    w = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    # the exact diagonal is set once and never refreshed: an interval past the 300 steps says so
    opt = SophiaG([w], lr=0.05, betas=(0.5, 0.0), rho=0.1, weight_decay=0.0, hessian_interval=1000)
    w.grad = a.sqrt()
    opt.update_hessian(1)  # b2 = 0: h = 1 * (sqrt a)^2 = a exactly
    for _ in range(300):
        w.grad = a * (w.detach() - c)
        opt.step()
    assert (w.detach() - c).abs().max().item() < 1e-3
    # the same budget of plain GD (stable step 1/max a) leaves the flat directions far away
    v = torch.zeros(10, dtype=torch.float64)
    for _ in range(300):
        v -= (1 / a.max()) * a * (v - c)
    assert (v - c).abs().max().item() > 0.1


def test_decoupled_weight_decay_and_maximize():
    p = nn.Parameter(torch.tensor([2.0]))
    opt = SophiaG([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.tensor([0.0])
    opt.step()  # m = 0: only the decay acts
    assert p.item() == pytest.approx(2.0 * (1 - 0.1 * 0.5))

    a, b = nn.Parameter(torch.tensor([1.0, -1.0])), nn.Parameter(torch.tensor([1.0, -1.0]))
    opt_a = SophiaG([a], lr=0.1, weight_decay=0.0, maximize=True)
    opt_b = SophiaG([b], lr=0.1, weight_decay=0.0)
    a.grad, b.grad = torch.tensor([0.3, -0.1]), torch.tensor([-0.3, 0.1])
    opt_a.step()
    opt_b.step()
    torch.testing.assert_close(a.detach(), b.detach())


def test_state_dict_round_trip_gives_identical_next_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = SophiaG(model.parameters(), lr=1e-2, hessian_interval=3)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for i in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i % 2 == 1:
            opt.zero_grad()
            loss, n = sampled_label_loss(model(x))
            loss.backward()
            opt.update_hessian(n)
    clone = copy.deepcopy(model)
    opt2 = SophiaG(clone.parameters(), lr=0.5)  # hyperparameters come back from the state dict
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.hessian_interval == 3 and opt2.param_groups[0]["lr"] == 1e-2
    for m, o in ((model, opt), (clone, opt2)):
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["hessian"], opt2.state[q]["hessian"])


def test_sampled_label_loss_samples_from_the_models_distribution():
    gen = torch.Generator().manual_seed(0)
    # uniform logits: the loss is log(V) whatever is drawn; a gradient flows to the logits
    logits = torch.zeros(2, 5, 7, requires_grad=True)
    out = sampled_label_loss(logits, generator=gen)
    assert out.num_samples == 10
    assert out.loss.item() == pytest.approx(math.log(7), rel=1e-6)
    out.loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0

    # two classes with p = (0.25, 0.75): the empirical mean loss matches the entropy
    probs = torch.tensor([0.25, 0.75])
    logits = probs.log().expand(4000, 2).clone()
    loss, n = sampled_label_loss(logits, generator=gen)
    entropy = -(probs * probs.log()).sum().item()
    assert n == 4000 and loss.item() == pytest.approx(entropy, abs=0.03)

    # peaked logits: labels are the argmax, so the loss is ~0; masked positions do not count
    peaked = torch.full((3, 4), -50.0)
    peaked[torch.arange(3), torch.tensor([1, 3, 0])] = 50.0
    loss, n = sampled_label_loss(peaked, mask=torch.tensor([True, False, True]), generator=gen)
    assert n == 2 and loss.item() < 1e-6


def test_validation_errors_name_the_argument():
    p = [nn.Parameter(torch.zeros(2))]
    for kwargs, word in [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(1.0, 0.9)), "betas"),
        (dict(rho=0.0), "rho"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(eps=0.0), "eps"),
        (dict(hessian_interval=0), "hessian_interval"),
    ]:
        with pytest.raises(ValueError, match=word):
            SophiaG(p, **kwargs)
    with pytest.raises(ValueError, match="hessian_interval"):
        SophiaG([{"params": p[:1], "hessian_interval": 5}, {"params": [nn.Parameter(torch.zeros(1))]}])
    assert SophiaG([{"params": p, "hessian_interval": 5}]).hessian_interval == 5
    with pytest.raises(ValueError, match="num_samples"):
        SophiaG(p).update_hessian(0)
