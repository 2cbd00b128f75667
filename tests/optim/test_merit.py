"""MERIT: every backend against the literal transcription (tests/optim/merit_literal.py) in
float64 and against the reference backend in fp32/bf16, on zero rows and columns, 1-D, 3-D,
transposed and non-contiguous tensors; the paper's ablations as formulas; tensor learning rates."""

import pytest
import torch

from merit_core.optim.merit import BACKENDS, IMPLEMENTATIONS, MERIT
from tests.optim.kernel_cache import private_kernel_cache
from tests.optim.merit_literal import literal_step

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare

# The compile backend is exercised (on tiny shapes, to bound its compile time) in
# test_merit_compile.py; the triton backend under Triton's interpreter in test_merit_triton.py.
FAST_PATHS = ["reference", "foreach", "cpu"]


@pytest.fixture(autouse=True, scope="module")
def kernel_cache(tmp_path_factory):
    """Build the C++ kernel into a temporary cache (cold, ~2 s), never into the user's."""
    from merit_core.optim.merit import cpu

    mp = pytest.MonkeyPatch()
    private_kernel_cache(mp, tmp_path_factory.mktemp("merit_kernels"))
    assert cpu.load_kernel() is not None, cpu.kernel_info()
    yield
    mp.undo()


# ---- helpers -------------------------------------------------------------------------------
def _problem(seed=0, dtype=torch.float64):
    """Weights with a zero row, a zero column and a zero (row, grad) pair; 1-D and 3-D params;
    gradients that are zero in one column so that a column of u can vanish."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (5,), (4, 3, 2), (1,), (3, 7)]
    ws = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    ws[0][1] = 0  # zero weight row (its grads are not zero)
    ws[0][:, 3] = 0  # zero weight column
    ws[3].zero_()  # a zero 1-D parameter
    grads = []
    for _ in range(8):
        gs = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
        gs[0][:, 3] = 0  # ... column 3 also never gets a gradient
        gs[4][:, 2] = 0  # a column of u that stays zero when weight_decay == 0
        grads.append(gs)
    return ws, grads


def _run(ws, grads, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = MERIT(params, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


CONFIGS = {
    "merit": dict(),
    "merit-wd": dict(weight_decay=0.1),
    "l2-merit": dict(norm="l2", weight_decay=0.05),
    "max-lamb": dict(elementwise=False, weight_decay=0.05),
    "nobound": dict(weight_bound=False),
    "noclip": dict(clip=None, weight_decay=0.01),
    "clip0.3": dict(clip=0.3),
    "lamb": dict(norm="l2", elementwise=False, clip=None),
    "bias-corr": dict(bias_correction=True, weight_decay=0.01),
    "maximize": dict(maximize=True, betas=(0.8, 0.95)),
}


# ---- parity with the literal transcription --------------------------------------------------
def test_every_backend_is_covered():
    assert set(FAST_PATHS) | {"compile", "triton"} == set(BACKENDS)
    assert set(IMPLEMENTATIONS) == set(BACKENDS) | {"eager", "cpp", "fused"}  # old names, and fused=True's


@pytest.mark.parametrize("impl", FAST_PATHS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_path_matches_literal_transcription(impl, config):
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0) | CONFIGS[config]
    ws, grads = _problem()
    got, opt = _run(ws, grads, implementation=impl, **kw)

    lit_kw = {k: v for k, v in kw.items()}
    cur = [(w.clone(), torch.zeros_like(w), torch.zeros_like(w)) for w in ws]
    for step, gs in enumerate(grads, start=1):
        cur = [literal_step(w, g, m, v, step, **lit_kw) for (w, m, v), g in zip(cur, gs)]
    for p, (w, m, v) in zip(opt.param_groups[0]["params"], cur):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v, rtol=1e-12, atol=1e-14)


def test_literal_transcription_sees_the_zero_rules():
    # Guard on the test problem itself: zero rows / columns occur, so the s=1 rule is exercised.
    ws, grads = _problem()
    w, _, _ = literal_step(
        ws[0],
        grads[0][0],
        torch.zeros_like(ws[0]),
        torch.zeros_like(ws[0]),
        1,
        lr=1.0,
        betas=(0.9, 0.99),
        eps=1e-6,
        weight_decay=0.0,
        clip=None,
    )
    u_zero_row = (w - ws[0])[1]  # zero weight row: s = 1, so the step is u itself
    g = grads[0][0][1]
    torch.testing.assert_close(-u_zero_row, 0.1 * g / (0.1 * g.abs() + 1e-6))
    assert torch.equal(w[:, 3], ws[0][:, 3])  # zero weight and zero gradient column: no move


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_transposed_weight_gets_transposed_update(impl):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 7, generator=gen)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.t().contiguous())
    opt = MERIT([a, b], lr=0.01, weight_decay=0.1, implementation=impl)
    for _ in range(5):
        g = torch.randn(5, 7, generator=gen)
        a.grad, b.grad = g.clone(), g.t().contiguous()
        opt.step()
    torch.testing.assert_close(b.detach(), a.detach().t(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("impl", FAST_PATHS)
@pytest.mark.parametrize("clip", [1.0, 0.25])
def test_no_element_moves_more_than_lr_times_clip(impl, clip):
    gen = torch.Generator().manual_seed(2)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64) * 3) for s in [(32, 16), (16,), (3, 4, 5)]
    ]
    opt = MERIT(params, lr=0.1, weight_decay=0.5, clip=clip, implementation=impl)
    biggest = 0.0
    for _ in range(5):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 100
        opt.step()
        biggest = max(biggest, max((p.detach() - q).abs().max().item() for p, q in zip(params, before)))
    assert biggest <= 0.1 * clip * (1 + 1e-12)
    assert biggest > 0.1 * clip * 0.5  # the bound is reached, not vacuous


# ---- each ablation is its formula (betas=0: u = g / (|g| + eps) on the first step) -----------
def _one_step(w, g, **kw):
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    MERIT([p], lr=1.0, betas=(0.0, 0.0), eps=1e-8, **kw).step()
    return w - p.detach()  # the applied step d


W = torch.tensor([[10.0, 1.0], [1.0, 0.1]], dtype=torch.float64)
G = torch.tensor([[1.0, -1.0], [-2.0, 0.5]], dtype=torch.float64)
U = G / (G.abs() + 1e-8)


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_ablation_formulas(impl):
    kw = dict(implementation=impl)
    rows = W.abs().amax(1, keepdim=True) / U.abs().amax(1, keepdim=True)  # [[10], [1]]
    cols = W.abs().amax(0, keepdim=True) / U.abs().amax(0, keepdim=True)  # [[10, 1]]
    b = W.abs().max() / U.abs().max()  # 10
    s_full = torch.maximum(torch.maximum(rows, cols), b)
    torch.testing.assert_close(_one_step(W, G, clip=None, **kw), s_full * U)
    assert s_full[1, 1] > 9.9 > 1.1 > torch.maximum(rows, cols)[1, 1]  # the floor b matters here
    torch.testing.assert_close(_one_step(W, G, **kw), (s_full * U).clamp(-1, 1))
    torch.testing.assert_close(_one_step(W, G, clip=None, weight_bound=False, **kw), torch.maximum(rows, cols) * U)
    torch.testing.assert_close(_one_step(W, G, clip=None, elementwise=False, **kw), b * U)  # max-LAMB
    l2 = lambda x, d=None: torch.linalg.vector_norm(x, dim=d, keepdim=d is not None)  # noqa: E731
    s_l2 = torch.maximum(torch.maximum(l2(W, 1) / l2(U, 1), l2(W, 0) / l2(U, 0)), l2(W) / l2(U))
    torch.testing.assert_close(_one_step(W, G, clip=None, norm="l2", **kw), s_l2 * U)


def _lamb_step(w, g, m, v, lr, b1, b2, eps, wd):
    """LAMB without bias correction, by hand: trust ratio ||w||_2 / ||u||_2 (1 if either is 0)."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (v.sqrt() + eps) + wd * w
    wn, un = w.norm(), u.norm()
    trust = 1.0 if wn == 0 or un == 0 else wn / un
    return w - lr * trust * u, m, v


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_l2_weightwise_noclip_is_lamb_without_bias_correction(impl):
    ws, grads = _problem(seed=3)
    got, _ = _run(
        ws,
        grads,
        lr=0.02,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        norm="l2",
        elementwise=False,
        clip=None,
        implementation=impl,
    )
    for k, w in enumerate(ws):
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        for gs in grads:
            w, m, v = _lamb_step(w, gs[k], m, v, 0.02, 0.9, 0.999, 1e-6, 0.01)
        torch.testing.assert_close(got[k], w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_bias_correction_makes_first_step_independent_of_betas(impl):
    # With bias correction, step 1 has m_hat = g and v_hat = g^2 whatever the betas are.
    ws, grads = _problem(seed=4)
    # (weight decay breaks MERIT's invariance to the scale of m / sqrt(v), so betas would matter)
    kw = dict(weight_decay=0.5, implementation=impl)
    a, _ = _run(ws, grads[:1], betas=(0.9, 0.999), bias_correction=True, **kw)
    b, _ = _run(ws, grads[:1], betas=(0.0, 0.0), **kw)
    c, _ = _run(ws, grads[:1], betas=(0.9, 0.999), **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert any(not torch.allclose(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_maximize_equals_minimizing_the_negated_gradient(impl):
    ws, grads = _problem(seed=5)
    a, _ = _run(ws, grads, maximize=True, weight_decay=0.1, implementation=impl)
    b, _ = _run(ws, [[-g for g in gs] for gs in grads], weight_decay=0.1, implementation=impl)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_three_dim_tensor_is_a_stack_of_matrices_along_trailing_dims():
    # Without the weight-wise floor, a [4, 3, 2] tensor moves exactly like its two [4, 3] slices.
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4, 3, 2, generator=gen, dtype=torch.float64) for _ in range(3)]
    whole, _ = _run([w], [[g] for g in grads], weight_bound=False)
    for k in range(2):
        part, _ = _run([w[..., k].contiguous()], [[g[..., k].contiguous()] for g in grads], weight_bound=False)
        torch.testing.assert_close(whole[0][..., k], part[0], rtol=1e-12, atol=1e-12)


# ---- low precision, layouts and tensor learning rates against the reference backend --------
def _problem_like(dtype, seed=9):
    """The parity problem in `dtype`, plus a transposed (non-contiguous) parameter."""
    ws, grads = _problem(seed)
    ws = [w.to(dtype) for w in ws] + [torch.randn(7, 4, dtype=torch.float64).to(dtype).t()]
    grads = [[g.to(dtype) for g in gs] + [torch.randn(4, 7, dtype=torch.float64).to(dtype)] for gs in grads]
    return ws, grads


def _run_noncontiguous(ws, grads, **kw):
    """Like _run, with every 2-D+ gradient handed over as a non-contiguous view."""
    params = [torch.nn.Parameter(w.clone()) if w.is_contiguous() else torch.nn.Parameter(w.t().clone().t()) for w in ws]
    opt = MERIT(params, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.t().contiguous().t() if g.dim() == 2 else g.clone()
            assert p.grad.dim() != 2 or p.grad.shape[0] == 1 or p.grad.shape[1] == 1 or not p.grad.is_contiguous()
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("impl", ["foreach", "cpu"])
@pytest.mark.parametrize("config", ["merit-wd", "l2-merit", "max-lamb", "nobound", "bias-corr", "maximize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_and_non_contiguous_match_the_reference(impl, config, dtype):
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6) | CONFIGS[config]
    ws, grads = _problem_like(dtype)
    got, opt = _run_noncontiguous(ws, grads[:3], implementation=impl, **kw)
    want, ref = _run_noncontiguous(ws, grads[:3], implementation="reference", **kw)
    for a, b, p, q in zip(got, want, opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        assert a.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:  # one bf16 ulp: the fp32 results may differ in their last bits before the one rounding
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-30)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("impl", FAST_PATHS + ["eager", "cpp"])
def test_tensor_learning_rate_equals_the_float_one(impl):
    ws, grads = _problem(seed=10)
    lr = torch.tensor(0.05, dtype=torch.float64)
    a, opt = _run(ws, grads[:4], lr=lr, weight_decay=0.1, implementation=impl)
    b, _ = _run(ws, grads[:4], lr=0.05, weight_decay=0.1, implementation=impl)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert opt.param_groups[0]["lr"] is lr  # kept as the caller's tensor, as AdamW does
    lr.fill_(0.0)  # changing the tensor in place changes the next step
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    for p, g in zip(opt.param_groups[0]["params"], grads[5]):
        p.grad = g.clone()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(opt.param_groups[0]["params"], before))


# ---- the clip bound (docs/MERIT.md): |s_ij u_ij| <= max|W| with max-norm ratios -------------------
def _clipped_and_not(scale: float, impl: str, seed: int = 5):
    """Five steps of MERIT with and without the clip from the same weights (max|W| ~ `scale`) and gradients."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(24, 12), (12,), (3, 4, 5)]
    start = []
    for shape in shapes:
        w = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1  # entries in (-1, 1)
        start.append(w * scale / w.abs().max())
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) * 10 for s in shapes] for _ in range(5)]
    out = []
    for clip in (1.0, None):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = MERIT(params, lr=0.05, weight_decay=0.1, clip=clip, implementation=impl)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        out.append([p.detach() for p in params])
    return out


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_the_clip_never_binds_while_every_weight_is_below_one(impl):
    # max|W| = 0.7 at the start; each step moves a weight by at most lr * max|W| (the bound), so after
    # five steps of lr 0.05 every |w| is below 0.7 * 1.05**5 = 0.89: the clip at 1 has nothing to clip
    clipped, free = _clipped_and_not(0.7, impl)
    assert max(w.abs().max().item() for w in free) < 0.7 * 1.05**5
    assert all(torch.equal(a, b) for a, b in zip(clipped, free))


@pytest.mark.parametrize("impl", FAST_PATHS)
def test_the_clip_binds_once_a_weight_exceeds_one(impl):
    clipped, free = _clipped_and_not(3.0, impl)  # max|W| = 3 in every tensor: s*u reaches 3 in its row
    assert all(not torch.equal(a, b) for a, b in zip(clipped, free))
