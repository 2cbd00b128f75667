"""torch's optimizer contract, one table for every optimizer merit implements, AdamW as the control.

The rows are the generic properties torch's own optimizer tests (TestOptimRenewed) check of
every optimizer: state dicts through ``torch.load(weights_only=True)``, a state dict that comes
back unchanged, deepcopy and pickle, a ``step`` saved as a number, load hooks, param groups,
zero_grad, closures, tensor lrs, lr schedulers, step hooks, dtypes and shapes (0-d, zero-size,
non-contiguous), and torch's ``foreach=``/``fused=``/``capturable=``/``differentiable=``.
Each row runs on ``torch.optim.AdamW`` too: where AdamW fails a row, the row is wrong, not
merit. torch's own ``OptimizerInfo`` machinery (torch/testing/_internal/common_optimizers.py)
needs the ``expecttest`` package, which a merit install does not have, so the rows are written
out here.

Every MERIT backend is a column: reference, foreach, cpu, compile, and triton, whose rows run
in a child pytest under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported; see tests/interpreted.py); the ablations, SophiaG and MuonWithAdamW run on their
default backends.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections.abc import Callable

import pytest
import torch

from merit_core.optim.merit import MERIT
from merit_core.optim.muon import MuonWithAdamW
from merit_core.optim.sophia import SophiaG
from tests.optim.kernel_cache import kernel_cache  # noqa: F401  (autouse: the kernel builds into a temporary cache)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(5, 4), (4,), (3, 2, 2)]

Factory = Callable[..., torch.optim.Optimizer]


def _merit(implementation: str | None, **fixed) -> Factory:
    return lambda params, **kw: MERIT(params, **{"implementation": implementation, **fixed, **kw})


if INTERPRETED:  # the child: the triton column
    OPTIMIZERS: dict[str, Factory] = {"merit-triton": _merit("triton")}
else:
    OPTIMIZERS = {
        "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
        **{f"merit-{b}": _merit(b) for b in ("reference", "foreach", "cpu", "compile")},
        "merit-default": _merit(None),
        "lamb-ablation": _merit(None, norm="l2", elementwise=False, clip=None),
        "max-lamb-ablation": _merit(None, elementwise=False, clip=None),
        "no-weight-bound": _merit(None, weight_bound=False),
        "sophiag": lambda params, **kw: SophiaG(params, **kw),
        "muon": lambda params, **kw: MuonWithAdamW(params, **kw),
    }
# The compile column compiles each distinct shape and dtype anew: minutes on a 2-core CPU, so it is marked slow.
_SLOW = {"merit-compile"}


def _marked(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in names]


NAMES = _marked(list(OPTIMIZERS))
MERIT_NAMES = _marked([n for n in OPTIMIZERS if n.startswith("merit-")])
TORCH_FLAGS_NAMES = _marked([n for n in OPTIMIZERS if n == "adamw" or n.startswith("merit-")])


def _params(seed: int = 0, dtype: torch.dtype = torch.float32, shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((0.3 * torch.randn(s, generator=gen)).to(dtype)) for s in shapes]


def _grads(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _steps(opt, params, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        _grads(params, i)
        opt.step()


def _clone(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _same(a, b) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b))


def _through_torch_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _group_keys(opt) -> list[set]:
    return [set(g) for g in opt.param_groups]


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_through_weights_only_load_gives_a_bit_exact_next_step(name):
    make = OPTIMIZERS[name]
    params = _params()
    opt = make(params, lr=0.01)
    _steps(opt, params, 2)
    clones = _clone(params)
    opt2 = make(clones, lr=0.5)  # the saved lr wins
    opt2.load_state_dict(_through_torch_load(opt.state_dict()))
    assert opt2.param_groups[0]["lr"] == 0.01
    _steps(opt, params, 1, start=5)
    _steps(opt2, clones, 1, start=5)
    assert _same(params, clones)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_is_deterministic_and_loading_it_adds_no_group_keys(name):
    """torch's test_state_dict_deterministic: a loaded optimizer's state dict equals the original,
    and neither load_state_dict, deepcopy nor pickle adds a key (e.g. ``differentiable``) to a group."""
    make = OPTIMIZERS[name]
    params = _params()
    opt = make(params, lr=0.01)
    _steps(opt, params, 1)
    keys = _group_keys(opt)
    opt2 = make(_clone(params), lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    assert _group_keys(opt2) == keys
    assert _group_keys(copy.deepcopy(opt)) == keys
    assert _group_keys(pickle.loads(pickle.dumps(opt))) == keys
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd["param_groups"] == sd2["param_groups"]
    for k, st in sd["state"].items():
        assert set(st) == set(sd2["state"][k]) and all(torch.equal(st[x], sd2["state"][k][x]) for x in st)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_like_the_original(name, how):
    make = OPTIMIZERS[name]
    model = torch.nn.ParameterList(_params())
    opt = make(list(model), lr=0.01)
    _steps(opt, list(model), 2)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    _steps(opt, list(model), 1, start=7)
    _steps(opt2, list(model2), 1, start=7)
    assert _same(model, model2)


@pytest.mark.parametrize("name", NAMES)
def test_a_state_dict_whose_step_is_a_number_loads_and_steps(name):
    """torch's test_load_nontensor_step: an old (or hand-made) state dict saved ``step`` as a float."""
    make = OPTIMIZERS[name]
    params = _params()
    opt = make(params, lr=0.01)
    _steps(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())  # (a state dict shares its per-parameter dicts with the optimizer)
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = float(st["step"])
    clones = _clone(params)
    opt2 = make(clones, lr=0.01)
    opt2.load_state_dict(sd)
    _steps(opt, params, 1, start=3)
    _steps(opt2, clones, 1, start=3)
    assert _same(params, clones)
    for st in opt2.state.values():
        if "step" in st:
            assert isinstance(st["step"], torch.Tensor)


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_hooks_run_in_torchs_order_and_may_mark_the_state(name):
    """torch's hook tests: a pre-hook may replace the state dict, a post-hook may store a non-dict
    in ``optimizer.state``; the next step still runs. A post-hook sees the state the step will use."""
    make = OPTIMIZERS[name]
    params = _params(dtype=torch.bfloat16) if name.startswith("merit") else _params()
    opt = make(params, lr=0.01)
    _steps(opt, params, 1)
    opt2 = make(_clone(params), lr=0.01)
    seen = []

    def pre(optimizer, state_dict):
        seen.append("pre")
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [dict(g, lr=0.02) for g in state_dict["param_groups"]]
        return state_dict

    def post(optimizer):
        seen.append("post")
        seen.extend(st["exp_avg"].dtype for st in optimizer.state.values() if isinstance(st, dict) and "exp_avg" in st)
        optimizer.state["ran_load_state_dict_post_hook"] = True

    opt2.register_load_state_dict_pre_hook(pre)
    opt2.register_load_state_dict_post_hook(post)
    opt2.load_state_dict(opt.state_dict())
    assert seen[:2] == ["pre", "post"] and opt2.param_groups[0]["lr"] == 0.02
    if name.startswith("merit"):
        assert set(seen[2:]) == {torch.float32}  # bf16 parameters, fp32 moments: already fixed when the hook ran
    assert opt2.state["ran_load_state_dict_post_hook"] is True
    _steps(opt2, [p for g in opt2.param_groups for p in g["params"]], 1)
    opt2.load_state_dict(opt.state_dict())  # a state holding the hook's mark loads again


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_add_param_group_and_zero_grad(name):
    make = OPTIMIZERS[name]
    a, b = _params(1)[:2]
    opt = make([a], lr=0.01)
    opt.add_param_group({"params": [b], "lr": 0.0})
    assert len(opt.param_groups) == 2
    before = b.detach().clone()
    _steps(opt, [a, b], 2)
    assert torch.equal(b.detach(), before) and not torch.equal(a.detach(), _params(1)[0].detach())
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    _grads([a, b], 0)
    opt.zero_grad(set_to_none=False)
    assert a.grad is not None and not a.grad.any()


@pytest.mark.parametrize("name", NAMES)
def test_closure_is_called_once_with_grad_enabled_and_its_loss_returned(name):
    make = OPTIMIZERS[name]
    params = _params()
    opt = make(params, lr=0.01)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == [True] and isinstance(loss, torch.Tensor)


@pytest.mark.parametrize("name", NAMES)
def test_a_tensor_lr_steps_as_the_float_lr_and_a_two_element_one_is_refused_like_adamw(name):
    make = OPTIMIZERS[name]
    if name in ("sophiag", "muon"):
        pytest.skip(f"{name} takes a float lr (torch's Muon and merit's SophiaG do not document tensor lrs)")
    p1, p2 = _params(), _params()
    o1, o2 = make(p1, lr=0.01), make(p2, lr=torch.tensor(0.01))
    _steps(o1, p1, 2)
    _steps(o2, p2, 2)
    for x, y in zip(p1, p2):
        torch.testing.assert_close(x, y, rtol=0, atol=4 * torch.finfo(torch.float32).eps)  # a few ulps: lr*d vs lr*d
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        make(_params(), lr=torch.tensor([0.01, 0.01]))


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=3),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1 / (1 + i)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.02, total_steps=6),
}


@pytest.mark.parametrize("name", NAMES)
def test_lr_schedulers_drive_the_lr(name):
    """Each scheduler sets the group's lr each step as it does AdamW's (OneCycleLR also cycles the
    first beta, or Muon's momentum, and needs the optimizer to have one)."""
    make = OPTIMIZERS[name]
    for sched_name, make_sched in SCHEDULERS.items():
        params = _params()
        opt = make(params, lr=0.01)
        if sched_name == "OneCycleLR" and not ("betas" in opt.defaults or "momentum" in opt.defaults):
            assert name == "muon"  # its parts differ (Muon's momentum, AdamW's betas): OneCycleLR cannot cycle both
            continue
        sched = make_sched(opt)
        lrs = []
        for i in range(3):
            _grads(params, i)
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            assert lrs[-1] == sched.get_last_lr()[0], sched_name
        assert any(lr != lrs[0] for lr in lrs) or lrs[0] != 0.01, sched_name  # it moved the lr
        assert all(bool(torch.isfinite(p).all()) for p in params), sched_name


@pytest.mark.parametrize("name", NAMES)
def test_step_pre_and_post_hooks_run_around_each_step(name):
    make = OPTIMIZERS[name]
    params = _params()
    opt = make(params, lr=0.01)
    order = []
    opt.register_step_pre_hook(lambda o, args, kwargs: order.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: order.append("post"))
    _steps(opt, params, 2)
    assert order == ["pre", "post"] * 2


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes_step_and_keep_the_parameter_dtype(name, dtype):
    make = OPTIMIZERS[name]
    params = _params(dtype=dtype)
    opt = make(params, lr=0.01)
    if name == "merit-triton" and dtype == torch.float64:
        _grads(params, 0)
        with pytest.raises(ValueError, match="float64"):
            opt.step()
        assert all(not opt.state[p] or float(opt.state[p]["step"]) == 0 for p in params)  # nothing advanced
        return
    _steps(opt, params, 2)
    assert all(p.dtype == dtype and bool(torch.isfinite(p).all()) for p in params)


@pytest.mark.parametrize("name", NAMES)
def test_zero_d_zero_size_and_5d_shapes(name):
    make = OPTIMIZERS[name]
    shapes = [(), (0,), (3, 0), (2, 3, 1, 2, 2), (4, 3)]
    if name == "muon":
        shapes = [(4, 3), (0, 3), (), (2, 3, 1, 2, 2)]  # Muon takes the 2-D ones, AdamW the rest
    params = _params(shapes=shapes)
    opt = make(params, lr=0.01)
    _steps(opt, params, 2)
    assert [tuple(p.shape) for p in params] == shapes
    assert all(bool(torch.isfinite(p).all()) for p in params)


@pytest.mark.parametrize("name", NAMES)
def test_a_non_contiguous_parameter_steps_as_its_contiguous_copy(name):
    """A transposed parameter: the step equals that of a contiguous copy; a backend that cannot take
    it must refuse before any state changes (the triton backend)."""
    make = OPTIMIZERS[name]
    base = _params(shapes=[(4, 6)])[0]
    strided = torch.nn.Parameter(base.detach().clone().t())
    dense = torch.nn.Parameter(base.detach().clone().t().contiguous())
    assert not strided.is_contiguous()
    o1, o2 = make([strided], lr=0.01), make([dense], lr=0.01)
    if name == "merit-triton":
        _grads([strided], 0)
        with pytest.raises(ValueError, match="non-contiguous"):
            o1.step()
        assert not o1.state[strided] or float(o1.state[strided]["step"]) == 0  # the step did not advance
        return
    for i in range(2):
        gen = torch.Generator().manual_seed(i)
        g = torch.randn(6, 4, generator=gen)
        strided.grad, dense.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(strided.detach(), dense.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("name", MERIT_NAMES)
def test_meta_device_parameters_take_a_step(name):
    if name in ("merit-cpu", "merit-triton"):
        pytest.skip(f"{name} computes on CPU tensors (meta tensors refuse with a reason; see test_merit_contract)")
    p = torch.nn.Parameter(torch.zeros(3, 2, device="meta"))
    p.grad = torch.zeros(3, 2, device="meta")
    opt = OPTIMIZERS[name]([p], lr=0.01)
    opt.step()
    assert p.device.type == "meta" and float(opt.state[p]["step"]) == 1


@pytest.mark.parametrize("name", TORCH_FLAGS_NAMES)
def test_torchs_backend_flags_are_accepted_with_torchs_meaning(name):
    """foreach=, fused=, capturable=, differentiable= as torch spells them. MERIT maps them onto its
    backends (fused: the device's fused kernel; foreach=True: foreach; foreach=False: the for-loop
    reference); differentiable=True is refused in one line, as are fused and foreach together."""
    make = OPTIMIZERS[name]
    base = (lambda params, **kw: MERIT(params, **kw)) if name.startswith("merit") else make
    for flags in (dict(foreach=True), dict(foreach=False), dict(fused=True), dict(capturable=False), {}):
        params = _params()
        opt = base(params, lr=0.01, **flags)
        _steps(opt, params, 1)
        assert all(bool(torch.isfinite(p).all()) for p in params), flags
    with pytest.raises((ValueError, RuntimeError), match="differentiable|fused"):
        base(_params(), lr=0.01, differentiable=True, fused=True)
    with pytest.raises((ValueError, RuntimeError), match="fused.*foreach|foreach.*fused"):
        base(_params(), lr=0.01, foreach=True, fused=True)
    if name.startswith("merit"):
        assert [MERIT(_params(), **f).param_groups[0]["implementation"] for f in
                (dict(foreach=True), dict(foreach=False), dict(fused=True), dict(fused=False))] == \
            ["foreach", "reference", "fused", "foreach"]  # fmt: skip
        with pytest.raises(ValueError, match="^MERIT: differentiable=True is not supported"):
            MERIT(_params(), differentiable=True)
        with pytest.raises(ValueError, match="implementation= or torch's foreach="):
            MERIT(_params(), implementation="cpu", foreach=True)


@pytest.mark.slow
def test_the_triton_column_passes_under_the_interpreter():
    """The triton backend's rows of this table, in a child pytest with TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("this is the child: its rows run here")
    pytest.importorskip("triton", reason="the triton column needs triton (pip install triton)")
    pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    from tests.interpreted import run_under_interpreter

    summary, report = run_under_interpreter(__file__)
    assert " passed" in summary and " failed" not in summary, report
