"""MERIT as a torch.optim.Optimizer: validation, param groups, state, dtypes, skipped and sparse
gradients, and that it actually trains."""

import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from merit_core.optim.merit import MERIT
from tests.optim.kernel_cache import kernel_cache, private_kernel_cache  # noqa: F401  (autouse: the kernel builds into a temporary cache)

PATHS = ["reference", "foreach", "cpu"]


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in [(8, 6), (6,), (5, 9)]]


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr="0.1"), "lr"),
        (dict(betas=(1.0, 0.9)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(betas=0.9), "betas"),
        (dict(eps=0.0), "eps"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(weight_decay=float("inf")), "weight_decay"),
        (dict(norm="l1"), "norm"),
        (dict(elementwise=1), "elementwise"),
        (dict(weight_bound="yes"), "weight_bound"),
        (dict(clip=0.0), "clip"),
        (dict(clip=-1.0), "clip"),
        (dict(clip=True), "clip"),
        (dict(bias_correction=None), "bias_correction"),
        (dict(maximize=0), "maximize"),
        (dict(implementation="cuda-fast"), "implementation"),
    ],
)
def test_constructor_rejects_bad_hyperparameters_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"MERIT: {name} must be .*, got"):
        MERIT(_params(), **kwargs)


def test_param_group_overrides_are_validated_and_used():
    with pytest.raises(ValueError, match=r"clip must be .*\(param group 1\)"):
        MERIT([{"params": _params()[:1]}, {"params": _params()[1:], "clip": -2.0}])
    with pytest.raises(TypeError, match="complex64"):
        MERIT([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    opt = MERIT(_params()[:1])
    with pytest.raises(ValueError, match=r"lr must be .*\(param group 1\)"):
        opt.add_param_group({"params": _params()[1:], "lr": -1.0})
    assert len(opt.param_groups) == 1  # a rejected group is not half-added

    frozen, l2 = _params(1)[:2], _params(2)
    opt = MERIT([{"params": frozen, "lr": 0.0}, {"params": l2, "norm": "l2", "clip": None}], lr=0.1)
    alone = [torch.nn.Parameter(p.detach().clone()) for p in l2]
    ref = MERIT(alone, lr=0.1, norm="l2", clip=None)
    before = [p.detach().clone() for p in frozen]
    for step in range(3):
        _set_grads(frozen, step)
        _set_grads(l2, step)
        _set_grads(alone, step)
        opt.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(frozen, before))
    assert all(torch.equal(p, q) for p, q in zip(l2, alone))
    assert opt.param_groups[1]["norm"] == "l2" and opt.param_groups[0]["norm"] == "max"


@pytest.mark.float_compare
@pytest.mark.parametrize("impl", PATHS)
def test_state_dict_round_trip_gives_an_identical_next_step(impl):
    params = _params(3) + [torch.nn.Parameter(torch.randn(4, 3).bfloat16())]
    opt = MERIT(params, lr=0.01, weight_decay=0.1, bias_correction=True, implementation=impl)
    for step in range(3):
        _set_grads(params, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = MERIT(clones, lr=0.5, implementation=impl)  # hyperparameters come from the state dict
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["bias_correction"] is True

    _set_grads(params, 7)
    _set_grads(clones, 7)
    opt.step()
    opt2.step()
    for p, q in zip(params, clones):
        assert torch.equal(p, q)
        assert set(opt2.state[q]) == {"step", "exp_avg", "exp_avg_sq"}  # exactly AdamW's state
        assert opt2.state[q]["exp_avg"].dtype == (torch.float32 if p.dtype == torch.bfloat16 else p.dtype)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
        assert opt2.state[q]["step"].item() == 4 and opt2.state[q]["step"].device.type == "cpu"


@pytest.mark.float_compare
@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_use_fp32_state_and_round_once(impl, dtype):
    params = _params(4, dtype)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = MERIT(params, lr=0.05, weight_decay=0.1, implementation=impl)
    ref = MERIT(masters, lr=0.05, weight_decay=0.1, implementation="reference")
    for step in range(4):
        _set_grads(params, step)
        for p, q in zip(params, masters):
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        for p, q in zip(params, masters):
            # One step from the same weights equals the fp32 step rounded once to `dtype`
            # (up to one ulp where the fp32 results differ in their last bits).
            torch.testing.assert_close(p.detach(), q.detach().to(dtype), rtol=2**-7, atol=0)
            assert opt.state[p]["exp_avg"].dtype == torch.float32
            q.data.copy_(p.detach().float())  # restart the master from the rounded weights
    assert all(p.dtype == dtype for p in params)


@pytest.mark.float_compare
def test_reference_low_precision_step_is_exactly_the_fp32_step_rounded_once():
    p = _params(5, torch.bfloat16)[0]
    q = torch.nn.Parameter(p.detach().float())
    p.grad = torch.randn(p.shape).bfloat16()
    q.grad = p.grad.float()
    MERIT([p], lr=0.05, implementation="reference").step()
    MERIT([q], lr=0.05, implementation="reference").step()
    assert torch.equal(p.detach(), q.detach().bfloat16())


@pytest.mark.parametrize("impl", PATHS)
def test_params_without_grad_are_skipped(impl):
    a, b = _params(6)[:2]
    b_before = b.detach().clone()
    opt = MERIT([a, b], implementation=impl)
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.equal(b.detach(), b_before) and b not in opt.state
    assert opt.state[a]["step"].item() == 1


def test_sparse_gradients_raise_a_clear_error():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        MERIT(emb.parameters()).step()


def test_closure_is_called_with_grad_enabled_and_its_loss_returned():
    p = torch.nn.Parameter(torch.ones(3))
    opt = MERIT([p])

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert opt.state[p]["step"].item() == 1


@pytest.mark.float_compare
@pytest.mark.parametrize("impl", PATHS)
def test_a_tiny_mlp_regression_converges(impl):
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = torch.sin(x @ torch.randn(8, 1)) + 0.1 * x[:, :1]
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = MERIT(model.parameters(), lr=0.02, betas=(0.9, 0.99), implementation=impl)
    losses = []
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_load_state_dict_keeps_step_on_the_cpu(monkeypatch):
    # Loading a state dict with map_location="cuda" puts every tensor on the GPU; without a GPU here, a state
    # dict whose step tensors report another device stands in for it (the GPU test does it for real).
    params = _params(8)
    opt = MERIT(params, lr=0.01)
    _set_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    moved = []

    class Elsewhere(torch.Tensor):
        @property
        def device(self):
            return torch.device("meta")

        def to(self, *args, **kwargs):
            moved.append(args)
            return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)

    for st in sd["state"].values():
        st["step"] = st["step"].as_subclass(Elsewhere)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = MERIT(clones)
    opt2.load_state_dict(sd)
    assert len(moved) == len(params) and all(a == ("cpu",) for a in moved)
    for q in clones:
        step = opt2.state[q]["step"]
        assert type(step) is torch.Tensor and step.device.type == "cpu" and step.item() == 1


def _stepped_state(shapes, seed=0):
    """The state dict of a MERIT that took one step on parameters of these shapes."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = MERIT(params, lr=0.01)
    _set_grads(params, seed)
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_a_loaded_state_of_other_shapes_is_refused_naming_both_shapes_and_nothing_changes(moment):
    """torch's AdamW loads such a state and fails at its step with a size error; MERIT refuses it at
    load time, naming the parameter, its shape and the state's, and keeps the state it had."""
    params = [torch.nn.Parameter(torch.ones(6)), torch.nn.Parameter(torch.ones(5, 6))]
    opt = MERIT([{"params": params[:1]}, {"params": params[1:]}], lr=0.01)
    _set_grads(params, 1)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    loaded = _stepped_state([(6,), (5, 6)], seed=2)
    loaded["param_groups"] = before["param_groups"]  # the same layout: only the moments' shapes differ
    loaded["state"][1][moment] = torch.zeros(3, 6)
    with pytest.raises(
        ValueError,
        match=rf"^MERIT\.load_state_dict: the loaded state of parameter 1 \(param group 1\) does not fit it: "
        rf"its {moment} has shape \(3, 6\), the parameter has shape \(5, 6\)$",
    ):
        opt.load_state_dict(loaded)
    after = opt.state_dict()
    for index, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][index][key], value), (index, key)


@pytest.mark.parametrize("impl", PATHS)
def test_moments_of_other_shapes_set_by_hand_are_refused_before_the_step_changes_anything(impl):
    params = _params(3)
    opt = MERIT(params, lr=0.01, implementation=impl)
    _set_grads(params, 0)
    opt.step()
    opt.state[params[2]]["exp_avg_sq"] = torch.zeros(9, 5)
    weights = [p.detach().clone() for p in params]
    states = copy.deepcopy([{k: v.clone() for k, v in opt.state[p].items()} for p in params])
    with pytest.raises(
        ValueError,
        match=r"^MERIT: the state of parameter 2 of the group does not fit it: "
        r"its exp_avg_sq has shape \(9, 5\), the parameter has shape \(5, 9\)$",
    ):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    for p, saved in zip(params, states):
        assert all(torch.equal(opt.state[p][k], v) for k, v in saved.items())


@pytest.mark.parametrize(
    "impl, params, match",
    [
        (
            "cpu",
            [torch.nn.Parameter(torch.zeros(2, 3, device="meta"))],
            "runs on CPU tensors only, got tensors on meta",
        ),
        ("cpp", [torch.nn.Parameter(torch.zeros(2, 3, device="meta"))], "implementation='cpp'.*CPU tensors only"),
        ("triton", [torch.nn.Parameter(torch.zeros(2, 3))], "TRITON_INTERPRET=1|triton is not installed"),
        ("mps-fast", [torch.nn.Parameter(torch.zeros(2, 3))], "implementation must be"),
    ],
)
def test_an_explicit_implementation_that_cannot_be_honoured_raises_why(impl, params, match):
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=match):
        opt = MERIT(params, implementation=impl)
        opt.step()
    if impl != "mps-fast":
        assert not opt.state[params[0]] or opt.state[params[0]]["step"].item() == 0  # nothing advanced


def test_explicit_cpu_without_a_kernel_raises_and_the_default_falls_back_once(monkeypatch, tmp_path):
    private_kernel_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler to be found
    monkeypatch.delenv("CXX", raising=False)
    params = _params(9)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found.*foreach") as record:
        for step in range(2):
            _set_grads(params, step)
            MERIT(params).step()
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    _set_grads(params, 3)
    with pytest.raises(
        ValueError, match="implementation='cpu'.*C\\+\\+ CPU kernel is unavailable: no C\\+\\+ compiler"
    ):
        MERIT(params, implementation="cpu").step()


def test_triton_rules(monkeypatch):
    """The checks the functional core applies to the triton backend: CPU
    tensors need the interpreter, float64 is refused, an explicit choice raises the reason."""
    from merit_core.optim.merit import functional

    p = [torch.zeros(2, 3)]
    monkeypatch.setitem(functional._TRITON, "installed", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "set TRITON_INTERPRET=1" in functional._triton(p, p)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert functional._triton(p, p) is None
    assert "float64" in functional._triton([torch.zeros(2, dtype=torch.float64)], p)
    monkeypatch.delenv("TRITON_INTERPRET")
    wired = functional.Backend("triton", lambda *a, **k: pytest.fail("ran"), functional._triton)
    monkeypatch.setitem(functional.BACKENDS, "triton", wired)
    params = _params(10)
    _set_grads(params, 0)
    with pytest.raises(ValueError, match="implementation='triton'.*TRITON_INTERPRET=1"):
        MERIT(params, implementation="triton").step()
    MERIT(params).step()  # the default on CPU is the C++ kernel, not triton


def test_importing_merit_never_imports_triton():
    # (Constructing any torch.optim.Optimizer imports torch._dynamo, which imports triton when it is
    # installed: AdamW does too. MERIT's own code imports triton only in the wired triton backend.)
    code = (
        "import sys, merit_core; from merit_core import MERIT; from merit_core.optim.merit import functional; "
        "assert 'triton' not in sys.modules, 'triton was imported'"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
