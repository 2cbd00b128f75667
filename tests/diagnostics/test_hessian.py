"""Hessian estimates against quadratics with a known Hessian, and HVPs of a real model against finite differences."""

import math

import pytest
import torch

from merit_core.diagnostics.hessian import (
    LANCZOS_MIN_STEPS,
    HessianVectorProduct,
    hessian_estimate,
    hutchinson_trace,
    lanczos,
    model_hessian,
    power_iteration,
    top_eigenvalue,
)
from tests.diagnostics.planted_models import diag_gpt2, diag_llama

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare


def _symmetric(eigs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=gen, dtype=torch.float64))
    return q @ torch.diag(torch.tensor(eigs, dtype=torch.float64)) @ q.T


def _quadratic(a):
    x = torch.randn(a.shape[0], dtype=torch.float64, requires_grad=True)
    return (lambda: 0.5 * x @ a @ x), [x]


def test_top_eigenvalue_and_trace_of_a_quadratic():
    eigs = [9.0, 4.0, 2.5, 1.0, 0.5, -0.3, 0.1, 0.0]
    a = _symmetric(eigs)
    loss_fn, params = _quadratic(a)
    est = hessian_estimate(loss_fn, params, iters=200, samples=400, seed=3, tol=1e-10)
    assert est.largest_algebraic_eigenvalue == pytest.approx(9.0, rel=1e-6)
    assert est.eigen_iters < 200 and est.eigen_converged
    true_trace = sum(eigs)
    assert abs(est.trace - true_trace) < 4 * est.trace_stderr
    assert est.trace_stderr < 1.0


def test_hutchinson_is_exact_for_a_diagonal_hessian():
    a = torch.diag(torch.tensor([3.0, -1.0, 0.25, 7.0], dtype=torch.float64))
    hvp = HessianVectorProduct(*_quadratic(a))
    mean, stderr = hutchinson_trace(hvp, samples=3, seed=0)  # vᵀAv = Σ a_ii for every ±1 vector
    assert mean == pytest.approx(9.25) and stderr == pytest.approx(0.0, abs=1e-12)


def test_top_eigenvalue_is_the_largest_even_when_a_negative_one_is_larger_in_magnitude():
    hvp = HessianVectorProduct(*_quadratic(_symmetric([-6.0, 2.0, 1.0])))
    dominant, _, converged = power_iteration(hvp, iters=300, tol=1e-9, seed=1)
    assert converged and dominant == pytest.approx(-6.0, rel=1e-6)  # what plain power iteration finds
    eig, iters, converged = top_eigenvalue(hvp, iters=300, tol=1e-12, seed=1)
    assert converged and eig == pytest.approx(2.0, rel=1e-6) and iters <= 3  # 3 dims: exact after 3 steps


def test_top_eigenvalue_of_a_negative_definite_hessian_is_its_largest():
    hvp = HessianVectorProduct(*_quadratic(_symmetric([-6.0, -2.0, -1.0])))
    eig, _, converged = top_eigenvalue(hvp, iters=500, tol=1e-12, seed=2)
    assert converged and eig == pytest.approx(-1.0, rel=1e-6)


def _diagonal_quadratic(eigs: torch.Tensor):
    """0.5 Σ a_i x_i² in float32 over len(eigs) dimensions, split over two parameter tensors
    (Lanczos does not depend on the eigenbasis, so a diagonal Hessian loses no generality)."""
    half = len(eigs) // 2
    x = torch.randn(half, requires_grad=True)
    y = torch.randn(len(eigs) - half, requires_grad=True)
    a, b = eigs[:half].float(), eigs[half:].float()
    return (lambda: 0.5 * (a * x * x).sum() + 0.5 * (b * y * y).sum()), [x, y]


def _spectrum(n: int, outliers: list[float], seed: int = 0) -> torch.Tensor:
    """`outliers` at random places among n eigenvalues, the rest uniform in [0, 1e-3]."""
    gen = torch.Generator().manual_seed(seed)
    eigs = torch.rand(n, generator=gen, dtype=torch.float64) * 1e-3
    places = torch.randperm(n, generator=gen)[: len(outliers)]
    eigs[places] = torch.tensor(outliers, dtype=torch.float64)
    return eigs


@pytest.mark.parametrize("n", [10_000, 1_000_000])
def test_top_eigenvalue_when_a_negative_eigenvalue_dominates_in_high_dimension(n):
    # the case the shifted power iteration got wrong: -10 dominates, +5 is the top eigenvalue, the
    # bulk sits near 0 (it returned ~1e-3, "converged", at n = 1e4 and 1e6)
    hvp = HessianVectorProduct(*_diagonal_quadratic(_spectrum(n, [-10.0, 5.0])))
    result = lanczos(hvp, iters=30, tol=1e-4, seed=0)
    assert result.converged and result.iters <= 30
    assert result.top == pytest.approx(5.0, rel=1e-4)
    assert result.bottom == pytest.approx(-10.0, rel=1e-3)
    eig, iters, converged = top_eigenvalue(hvp, iters=30, tol=1e-4)
    assert (eig, iters, converged) == (result.top, result.iters, True)


def test_top_eigenvalue_with_several_outliers_and_a_close_pair():
    eigs = _spectrum(100_000, [-40.0, -3.0, 12.0, 11.5, 2.0], seed=1)
    hvp = HessianVectorProduct(*_diagonal_quadratic(eigs))
    result = lanczos(hvp, iters=40, tol=1e-5, seed=3)
    assert result.converged
    assert result.top == pytest.approx(12.0, rel=1e-4)  # not 11.5: the close pair is resolved
    assert result.bottom == pytest.approx(-40.0, rel=1e-3)


def test_lanczos_convergence_cannot_pass_before_the_top_eigenvalue_can_have_appeared():
    # after two steps the top Ritz value sits on the bulk (~5e-4) with a residual below tol x the
    # spectral scale (10): a residual test alone would call that converged
    hvp = HessianVectorProduct(*_diagonal_quadratic(_spectrum(1_000_000, [-10.0, 5.0])))
    two = lanczos(hvp, iters=2, tol=1e-3)
    assert abs(two.top) < 1e-2 and two.top_residual <= 1e-3 * 10.0
    assert not two.converged
    full = lanczos(hvp, iters=LANCZOS_MIN_STEPS, tol=1e-3)
    assert full.converged and full.iters == LANCZOS_MIN_STEPS and full.top == pytest.approx(5.0, rel=1e-3)


def test_top_eigenvalue_of_a_positive_spectrum_matches_power_iteration():
    hvp = HessianVectorProduct(*_diagonal_quadratic(_spectrum(10_000, [7.0, 3.0, -1.0])))
    top, _, converged = top_eigenvalue(hvp, iters=30, tol=1e-6)
    dominant, _, power_converged = power_iteration(hvp, iters=300, tol=1e-4)
    assert converged and power_converged
    assert top == pytest.approx(7.0, rel=1e-6) and dominant == pytest.approx(7.0, rel=1e-3)


def test_top_eigenvalue_against_a_small_mlps_exact_hessian():
    # a 2-layer tanh MLP of 216 parameters away from a minimum (indefinite Hessian): the exact
    # Hessian by torch.autograd.functional.hessian, its eigenvalues by eigh
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).double()
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    sizes = [p.numel() for p in net.parameters()]
    assert sum(sizes) == 216
    inputs = torch.randn(32, 4, dtype=torch.float64)
    targets = torch.randint(0, 8, (32,))

    def loss_of(flat):
        tensors = dict(zip(names, (c.view(s) for c, s in zip(flat.split(sizes), shapes))))
        logits = torch.func.functional_call(net, tensors, (inputs,))
        return torch.nn.functional.cross_entropy(logits, targets)

    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    exact = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_of, flat, vectorize=True))
    assert exact[0] < 0 < exact[-1]  # indefinite
    params = list(net.parameters())
    est = hessian_estimate(
        lambda: torch.nn.functional.cross_entropy(net(inputs), targets), params, iters=60, samples=0, tol=1e-8
    )
    assert est.eigen_converged
    assert est.largest_algebraic_eigenvalue == pytest.approx(float(exact[-1]), rel=1e-6)
    assert est.smallest_algebraic_eigenvalue >= float(exact[0]) - 1e-9


def test_several_parameter_tensors_with_coupling():
    # loss = 0.5 zᵀAz with z = [x (3 entries), y (a 2x2 matrix)]: the Hessian is A across both tensors
    a = _symmetric([5.0, 3.0, 1.0, 1.0, 0.5, 0.25, 2.0, -1.0, 4.0], seed=4)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, dtype=torch.float64)  # a non-parameter input

    def loss_fn():
        v = torch.cat([x, y.flatten(), z])
        return 0.5 * v @ a @ v

    hvp = HessianVectorProduct(loss_fn, [x, y])
    vx, vy = torch.randn(3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    hx, hy = hvp([vx, vy])
    expected = a @ torch.cat([vx, vy.flatten(), torch.zeros(2, dtype=torch.float64)])
    torch.testing.assert_close(torch.cat([hx, hy.flatten()]), expected[:7])
    exact = torch.linalg.eigvalsh(a[:7, :7])
    eig, _, _ = top_eigenvalue(hvp, iters=500, tol=1e-12)
    assert eig == pytest.approx(exact.max().item(), rel=1e-5)
    mean, stderr = hutchinson_trace(hvp, samples=300)
    assert abs(mean - a[:7, :7].trace().item()) < 4 * stderr


def test_estimates_are_seeded():
    loss_fn, params = _quadratic(_symmetric([3.0, 2.0, 1.0, 0.5]))
    a = hessian_estimate(loss_fn, params, iters=3, samples=4, seed=7)
    b = hessian_estimate(loss_fn, params, iters=3, samples=4, seed=7)
    assert a == b


def test_model_hvp_matches_finite_differences_of_gradients():

    model = diag_gpt2(seed=1).double()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters()]

    def loss_fn():
        return model(input_ids=ids, labels=ids).loss

    model.set_attn_implementation("eager")
    hvp = HessianVectorProduct(loss_fn, params)
    gen = torch.Generator().manual_seed(1)
    v = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    hv = hvp(v)
    eps = 1e-5

    def grads_at(sign):
        with torch.no_grad():
            for p, d in zip(params, v):
                p.add_(sign * eps * d)
        g = torch.autograd.grad(loss_fn(), params)
        with torch.no_grad():
            for p, d in zip(params, v):
                p.sub_(sign * eps * d)
        return g

    fd = [(gp - gm) / (2 * eps) for gp, gm in zip(grads_at(1.0), grads_at(-1.0))]
    num = math.sqrt(sum(((a - b) ** 2).sum().item() for a, b in zip(hv, fd)))
    den = math.sqrt(sum((b**2).sum().item() for b in fd))
    assert num / den < 1e-4


def test_model_hessian_restores_the_model():

    model = diag_llama(seed=2)
    model.set_attn_implementation("sdpa")
    model.train()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    est = model_hessian(model, ids, iters=4, samples=2, seed=0)
    assert math.isfinite(est.largest_algebraic_eigenvalue) and math.isfinite(est.trace) and est.trace_samples == 2
    assert model.config._attn_implementation == "sdpa" and model.training
    assert all(p.grad is None for p in model.parameters())


def test_the_three_eigenvalue_conventions_are_named_apart():
    """Largest algebraic 2, smallest algebraic -6, largest magnitude -6 (sign kept), each under its name."""
    loss_fn, params = _quadratic(_symmetric([-6.0, 2.0, 1.0]))
    est = hessian_estimate(loss_fn, params, iters=3, samples=0, tol=1e-12)
    d = est.to_dict()
    assert d["largest_algebraic_eigenvalue"] == pytest.approx(2.0, rel=1e-6)
    assert d["smallest_algebraic_eigenvalue"] == pytest.approx(-6.0, rel=1e-6)
    assert d["largest_magnitude_eigenvalue"] == pytest.approx(-6.0, rel=1e-6)
