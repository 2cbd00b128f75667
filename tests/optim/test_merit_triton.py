"""The grouped Triton backend against the reference, under Triton's interpreter on CPU tensors.

TRITON_INTERPRET=1 must be set before triton is first imported (triton's own library functions
are decorated then), and in an ordinary test process triton may already have been imported
(torch.compile's tests import it) without it. So in an ordinary process this file holds one
test, which runs this file again in a child pytest with TRITON_INTERPRET=1 and passes if all of
its cases pass; with TRITON_INTERPRET=1 set (the child, or a direct
``TRITON_INTERPRET=1 pytest tests/optim/test_merit_triton.py``) the cases themselves are
collected. No other test sees the variable.
"""

import math
import os
import re

import pytest
import torch

pytest.importorskip(
    "triton",
    reason="triton is not installed: pip install -e '.[dev,triton]' runs the Triton backend's tests under its interpreter",
)
pytest.importorskip("numpy")  # the interpreter needs it

from benchmarks.launches import TritonLaunches  # noqa: E402
from merit_core.optim.merit.common import Hyper  # noqa: E402
from merit_core.optim.merit.reference import merit_reference  # noqa: E402
from tests.interpreted import run_under_interpreter  # noqa: E402
from tests.optim.nonfinite import BASE as DEFAULTS  # noqa: E402  (the functional keywords of a plain step)

_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def mt():
    """The backend's step module (merit_triton, plan_for, scalars), its kernels interpreted."""
    from merit_core.optim.merit.triton import kernels, step

    assert type(kernels.pass1_kernel).__name__ == "InterpretedFunction"
    return step


@pytest.fixture
def small_tiles(mt):
    """Tiles of 8x16 and finalize chunks of 2: many tiles per tensor, several loop iterations."""
    from merit_core.optim.merit.triton.plan import Tiling

    return Tiling(rows=8, cols=16, fin_col_tiles=2, fin_row_tiles=2, fin_tiles=2)


@pytest.fixture
def launches(mt):
    """Kernels, copies and pointer-table rebuilds the backend issues during the test."""
    with TritonLaunches() as counter:
        yield counter


def _assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    bits = _MANTISSA_BITS[want.dtype]
    exponent = torch.frexp(want.float().abs()).exponent.float()
    ulp = torch.where(want == 0, torch.full_like(exponent, 2.0**-133), torch.exp2(exponent - 1 - bits))
    err = (got.float() - want.float()).abs()
    assert bool((err <= ulp).all()), f"{want.dtype}: max error {err.max().item()} exceeds one ulp"


class Case:
    """Params, moments and steps of the Triton run and of the reference run, in lockstep."""

    def __init__(self, shapes, dtypes=None, seed=0, init=None, device="cpu", tiling=None):
        gen = torch.Generator().manual_seed(seed)
        self.tiling = {} if tiling is None else {"tiling": tiling}
        dtypes = dtypes or [torch.float32] * len(shapes)
        self.gen, self.device = gen, device
        # |w| ~ 0.2 keeps most of |s*u| below the clip of 1, so the ratios decide the update
        self.params = [(0.2 * torch.randn(s, generator=gen)).to(device, d) for s, d in zip(shapes, dtypes)]
        if init is not None:
            init(self.params)
        self.ref = [p.clone() for p in self.params]
        self.m = [torch.zeros(p.shape, device=device) for p in self.params]
        self.v = [torch.zeros(p.shape, device=device) for p in self.params]
        self.m_ref = [torch.zeros(p.shape, device=device) for p in self.params]
        self.v_ref = [torch.zeros(p.shape, device=device) for p in self.params]
        self.steps = [torch.tensor(0.0) for _ in self.params]  # CPU, as the optimizer keeps them

    def grads(self, make=None):
        make = make or (lambda p, gen: torch.randn(p.shape, generator=gen).to(p.dtype))
        return [make(p, self.gen).to(self.device) for p in self.params]

    def step(self, mt, grads, **kw):
        h = Hyper.of(**{**DEFAULTS, **kw})
        for s in self.steps:
            s += 1
        mt.merit_triton(self.params, grads, self.m, self.v, self.steps, h, **self.tiling)
        for p, g, m, v, s in zip(self.ref, grads, self.m_ref, self.v_ref, self.steps):
            if p.numel():  # the reference cannot reduce an empty tensor; the backend skips them
                merit_reference([p], [g], [m], [v], [s], h)
        for n, (got, want) in enumerate(zip(self.params, self.ref)):
            if want.dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"tensor {n}: {m}")
            else:
                _assert_within_one_ulp(got, want)
                want.copy_(got)  # one ulp may flip the next step's rounding: compare each step afresh
            torch.testing.assert_close(self.m[n], self.m_ref[n], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(self.v[n], self.v_ref[n], rtol=1e-6, atol=1e-9)

    def run(self, mt, n_steps=3, make=None, **kw):
        for _ in range(n_steps):
            self.step(mt, self.grads(make), **kw)


SHAPES = [(12, 20), (20,), (3, 5, 2), (1,), ()]


def test_0d_1d_2d_3d_and_4d_match_the_reference(mt):
    Case([*SHAPES, (2, 3, 1, 2)]).run(mt)


def test_many_tiles_and_finalize_loops_match_the_reference(mt, small_tiles):
    Case([(17, 36), (10, 17, 2), (200,)], tiling=small_tiles).run(mt, n_steps=2, weight_decay=0.05)
    Case([(12, 36)], seed=1, tiling=small_tiles).run(mt, n_steps=2, norm="l2")


def _zero_row_and_column(params):
    for p in params:
        p.mul_(25)  # |w| >> |u|: ratios above 1, so a zero norm's "ratio 1" rule shows (clip=None)
    params[0][3] = 0
    params[0][:, 5] = 0
    params[1][:, :, 1] = 0  # a whole matrix of a 3-D tensor
    params[2].zero_()


def test_zero_rows_and_columns_of_w_and_u(mt, small_tiles):
    def grads(p, gen):
        g = torch.randn(p.shape, generator=gen)
        if p.dim() == 2:
            g[:, 7] = 0  # with no weight decay the column of u stays zero
            g[10] = 0
        return g

    for kw in (dict(clip=None), dict(norm="l2", clip=None)):
        case = Case([(12, 20), (3, 10, 2), (30,)], init=_zero_row_and_column, tiling=small_tiles)
        case.run(mt, n_steps=2, make=grads, **kw)


@pytest.mark.parametrize(
    "ablation",
    [
        dict(clip=None),
        dict(weight_bound=False),
        dict(elementwise=False),
        dict(norm="l2"),
        dict(norm="l2", elementwise=False, clip=None),  # LAMB
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_each_ablation_matches_the_reference(mt, ablation):
    Case([(12, 20), (3, 5, 2)]).run(mt, n_steps=2, lr=0.05, **ablation)


@pytest.mark.parametrize(
    "flags",
    [dict(maximize=True, clip=0.5), dict(weight_decay=0.1), dict(bias_correction=True, weight_decay=0.01)],
    ids=lambda kw: ",".join(kw),
)
def test_maximize_weight_decay_and_bias_correction(mt, flags):
    Case(SHAPES[:2]).run(mt, n_steps=2, lr=0.05, **flags)


def test_bias_correction_with_different_step_counts(mt):
    case = Case(SHAPES[:2])
    case.steps[1] += 5  # e.g. a tensor that had grads before the others
    case.run(mt, n_steps=2, bias_correction=True)


def test_non_contiguous_grads(mt, launches):
    case = Case([(12, 20), (20,), (3, 5, 2), (2, 3, 2, 2)])

    def grads(p, gen):
        if p.dim() == 1:
            return torch.randn(2 * p.numel(), generator=gen)[::2]
        if p.dim() == 2:
            return torch.randn(p.shape[::-1], generator=gen).t()  # transposed
        if p.dim() == 3:
            return torch.randn(p.shape[0], p.shape[1], 2 * p.shape[2], generator=gen)[:, :, ::2]
        return torch.randn(p.shape[::-1], generator=gen).permute(3, 2, 1, 0)  # trailing dims not mergeable

    case.run(mt, n_steps=2, make=grads)
    assert launches.take()["copies"] == 2  # only the 4-D grad is copied, once a step


def test_mixed_dtypes_in_one_call(mt):
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float16]
    case = Case([(12, 20), (12, 20), (3, 5, 2), (20,), (20,)], dtypes=dtypes)
    case.run(mt, n_steps=2, weight_decay=0.1)
    # bf16 params with fp32 grads (e.g. grads accumulated in fp32)
    case.run(mt, make=lambda p, gen: torch.randn(p.shape, generator=gen), n_steps=1)


def test_float_and_tensor_learning_rates(mt):
    case = Case(SHAPES[:2])
    for lr in (0.01, 0.003):
        case.step(mt, case.grads(), lr=lr)
    lr = torch.tensor(0.01)
    for value in (0.005, 0.03):
        lr.fill_(value)  # the same tensor, a new value: read by the kernel at launch
        case.step(mt, case.grads(), lr=lr)
    case.step(mt, case.grads(), lr=torch.tensor(0.02, dtype=torch.float64))


def test_pointer_table_is_rebuilt_only_when_addresses_change(mt, launches):
    case = Case(SHAPES[:2])
    grads = case.grads()
    case.step(mt, grads)
    launches.take()
    for g in grads:  # accumulate in place: same addresses, same table
        g.copy_(torch.randn(g.shape, generator=case.gen))
    case.step(mt, grads)
    assert launches.take()["rebuilds"] == 0
    fresh = [g.clone() for g in case.grads()]  # zero_grad(set_to_none=True): new grad tensors
    case.step(mt, fresh)
    assert launches.take()["rebuilds"] == 1
    case.m = [m.clone() for m in case.m]  # e.g. load_state_dict replaced the moments
    case.v = [v.clone() for v in case.v]
    case.step(mt, fresh)
    assert launches.take()["rebuilds"] == 1


@pytest.mark.parametrize(
    "shapes, kernels, norm",
    [
        ([(8, 12)], 4, "max"),  # pass 1, the fill of the column and tensor maxima, finalize, pass 2
        ([(8, 12)], 3, "l2"),  # no fill: sums are reduced in order, not by atomics
        ([(8, 12), (12,), (3, 4)] * 2, 4, "max"),  # all vectorisable: one launch per pass
        ([(5,), (3, 4, 2), (7, 3)], 4, "max"),  # none vectorisable
        ([(8, 12), (5,), (3, 4, 2)] * 2, 6, "max"),  # both kinds: pass 1 and pass 2 launch twice
        ([(8, 12), (5,), (3, 4, 2)] * 2, 5, "l2"),
    ],
    ids=["one", "one-l2", "six-vectorised", "three-plain", "six-mixed", "six-mixed-l2"],
)
def test_launches_per_step_do_not_depend_on_the_number_of_tensors(mt, launches, shapes, kernels, norm):
    case = Case(shapes)
    grads = case.grads()
    case.step(mt, grads, bias_correction=True, lr=torch.tensor(0.01), norm=norm)
    launches.take()
    case.step(mt, grads, bias_correction=True, lr=torch.tensor(0.02), norm=norm)
    assert launches.take() == {"kernels": kernels, "copies": 0, "rebuilds": 0}


def test_finalize_runs_only_the_tiles_that_reduce(mt, small_tiles):
    # 8 x 16 tiles, chunks of 2 row tiles: (40, 37) has 5 x 3 tiles; the first of each tile-row
    # (5) and of each chunk of a tile-column (row tiles 0, 2, 4: 9) run. (5, 6, 3) is 3 matrices
    # of one tile. A 1-D tensor of 300 elements (19 rows of 16) has 3 x 1 tiles, of which only its
    # first reduces (1-D tensors have only a tensor norm); it is vectorisable, so its tiles come first.
    case = Case([(40, 37), (5, 6, 3), (300,)], tiling=small_tiles)
    case.run(mt, n_steps=2)
    plan = mt.plan_for(case.params, case.grads(), case.m, case.v, small_tiles)
    assert plan.index == [2, 0, 1] and plan.n_tiles == 3 + 15 + 3
    assert plan.finalize_tiles.tolist() == [0] + [3, 4, 5, 6, 9, 10, 11, 12, 15, 16, 17] + [18, 19, 20]


def test_phases_can_be_run_separately(mt):
    case = Case([(12, 20), (20,)])
    grads = case.grads()
    for s in case.steps:
        s += 1
    plan = mt.plan_for(case.params, grads, case.m, case.v)
    scalars = mt.scalars(plan, case.steps, Hyper.of(**DEFAULTS))
    plan.pass1(scalars)
    plan.finalize(scalars)
    w = case.params[0]
    torch.testing.assert_close(plan.row_stats[0, :12], w.abs().amax(1))
    torch.testing.assert_close(plan.col_stats[0, :20], w.abs().amax(0))
    torch.testing.assert_close(plan.tensor_stats[:, 0], torch.stack([w.abs().max(), case.params[1].abs().max()]))
    plan.pass2(scalars)
    for p, g, m, v in zip(case.ref, grads, case.m_ref, case.v_ref):
        merit_reference([p], [g], [m], [v], [torch.tensor(1.0)], Hyper.of(**DEFAULTS))
    for got, want in zip(case.params, case.ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class Traffic:
    """Bytes every load and store the interpreter executes moves, by tensor (elements counted
    where the mask is on; anything outside the named tensors is "other": tables, partials)."""

    def __init__(self, monkeypatch, named: dict):
        import numpy as np
        from triton.runtime.interpreter import InterpreterBuilder, _get_np_dtype

        self.ranges = {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in named.items()}
        self.bytes, self.elements = {}, {}
        load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

        def count(kind, ptrs, mask):
            addresses = ptrs.data[mask.data].astype(np.uint64)
            element = np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize
            for name, (lo, hi) in self.ranges.items():
                inside = addresses[(addresses >= lo) & (addresses < hi)]
                if inside.size:
                    self.bytes[name, kind] = self.bytes.get((name, kind), 0) + inside.size * element
                    self.elements.setdefault((name, kind), []).append(inside)
                    addresses = addresses[(addresses < lo) | (addresses >= hi)]
            self.bytes["other", kind] = self.bytes.get(("other", kind), 0) + addresses.size * element

        def counted_load(builder, ptrs, mask, *args):
            count("load", ptrs, mask)
            return load(builder, ptrs, mask, *args)

        def counted_store(builder, ptrs, value, mask, *args):
            count("store", ptrs, mask)
            return store(builder, ptrs, value, mask, *args)

        monkeypatch.setattr(InterpreterBuilder, "create_masked_load", counted_load)
        monkeypatch.setattr(InterpreterBuilder, "create_masked_store", counted_store)

    def take(self):
        """(bytes, distinct elements) by (tensor, kind) since the last take."""
        import numpy as np

        out = {key: (n, len(np.unique(np.concatenate(self.elements[key]))) if key in self.elements else 0)
               for key, n in self.bytes.items()}  # fmt: skip
        self.bytes, self.elements = {}, {}
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_pass_moves_each_tensor_once(mt, monkeypatch, dtype):
    """The bytes the floor of benchmarks/optimizer_step.py counts (40 B per fp32 parameter, 32 B
    per bf16 one with fp32 moments), counted on every load and store the kernels execute: pass 1
    reads g, m, v and w and writes m and v, each element once; pass 2 reads m, v and w and writes
    w; finalize touches none of them; the rest (tables, partial and final norms) stays small."""
    shapes = [(256, 512), (512,)]  # default tiles: 4 x 4 tiles, and one
    case = Case(shapes, dtypes=[dtype] * 2)
    grads = case.grads()
    for step in case.steps:
        step += 1
    plan = mt.plan_for(case.params, grads, case.m, case.v)
    scalars = mt.scalars(plan, case.steps, Hyper.of(**DEFAULTS))
    named = {f"{kind}{n}": t for kind, ts in dict(g=grads, m=case.m, v=case.v, w=case.params).items()
             for n, t in enumerate(ts)}  # fmt: skip
    traffic = Traffic(monkeypatch, named)
    numel = [math.prod(s) for s in shapes]
    expected = {
        "pass1": {("g", "load"), ("m", "load"), ("v", "load"), ("w", "load"), ("m", "store"), ("v", "store")},
        "finalize": set(),
        "pass2": {("m", "load"), ("v", "load"), ("w", "load"), ("w", "store")},
    }
    data = other = 0
    for phase in ("pass1", "finalize", "pass2"):
        getattr(plan, phase)(scalars)
        moved = traffic.take()
        seen = {(name[0], kind) for name, kind in moved if name != "other"}
        assert seen == expected[phase], phase
        for (name, kind), (nbytes, distinct) in moved.items():
            if name == "other":
                other += nbytes
                continue
            n = int(name[1:])
            assert distinct == numel[n], (phase, name, kind)  # every element, once
            assert nbytes == numel[n] * named[name].element_size(), (phase, name, kind)
            data += nbytes
    per_param = 40 if dtype == torch.float32 else 32
    assert data == per_param * sum(numel)
    assert other < 0.05 * data, other / data


def test_empty_tensors_are_skipped(mt):
    case = Case([(0, 5), (12, 20), (0,)])
    case.run(mt, n_steps=2)


def test_bad_inputs_raise_value_errors(mt):
    def call(params, grads=None, **kw):
        grads = grads if grads is not None else [torch.zeros_like(p) for p in params]
        zeros = [torch.zeros(p.shape) for p in params]
        steps = [torch.tensor(1.0) for _ in params]
        mt.merit_triton(params, grads, zeros, [z.clone() for z in zeros], steps, Hyper.of(**{**DEFAULTS, **kw}))

    with pytest.raises(ValueError, match="float64"):
        call([torch.zeros(3, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="contiguous"):
        call([torch.zeros(4, 3).t()])
    with pytest.raises(ValueError, match="shapes differ"):
        call([torch.zeros(3, 4)], grads=[torch.zeros(4, 3)])
    with pytest.raises(ValueError, match="norm"):
        call([torch.zeros(3, 4)], norm="l1")
    with pytest.raises(ValueError, match="clip"):
        call([torch.zeros(3, 4)], clip=0.0)
    with pytest.raises(ValueError, match="one element"):
        call([torch.zeros(3, 4)], lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="length"):
        mt.merit_triton([torch.zeros(2)], [], [], [], [], Hyper.of(**DEFAULTS))


def test_every_element_moves_by_at_most_lr(mt):
    case = Case([(12, 20)])
    before = case.params[0].clone()
    case.step(mt, [torch.randn(12, 20, generator=case.gen) * 1e3], lr=0.1)
    assert (case.params[0] - before).abs().max().item() <= 0.1 * (1 + 1e-6)
    assert math.isfinite(case.params[0].sum().item())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN
@pytest.mark.parametrize("config", ["default", "l2-unbounded", "weightwise-decay"])
def test_non_finite_values_follow_the_one_rule(mt, config):
    """The table of tests/optim/nonfinite.py: NaN/inf in a gradient, a weight, a whole row, a
    1-D tensor; the poisoned tensor is NaN everywhere after steps 1 and 2, its moments are
    non-finite exactly where the gradient was, the other tensors are untouched."""
    from tests.optim.nonfinite import CASES, check

    for case in CASES:
        check(mt.merit_triton, case, config)


def test_merit_optimizer_with_triton_matches_the_reference_backend(mt, launches):
    """Through the public class: MERIT(implementation="triton") on CPU tensors under the
    interpreter equals MERIT(implementation="reference"), with param groups and several steps,
    and takes a handful of launches per group whatever the number of tensors."""
    from merit_core.optim import MERIT

    gen = torch.Generator().manual_seed(5)
    shapes = [(12, 20), (20,), (3, 4, 5), (7, 9), (9,)]
    ours = [torch.nn.Parameter(0.2 * torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(ps):
        return [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "lr": 0.02}]

    opt = MERIT(groups(ours), lr=0.01, implementation="triton")
    opt_ref = MERIT(groups(ref), lr=0.01, implementation="reference")
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        launches.take()
        opt.step()
        assert launches.take()["kernels"] <= 2 * 6  # two groups
        opt_ref.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


if not _INTERPRETED:
    # Not collected here: the child pytest below runs them, with the interpreter on.
    for _name in [name for name in globals() if name.startswith("test_")]:
        del globals()[_name]

    def test_triton_backend_under_the_interpreter():
        """Every case above, in a child pytest with TRITON_INTERPRET=1 (see the module docstring)."""
        summary, report = run_under_interpreter(__file__)
        assert re.fullmatch(r"(\d+) passed in .*", summary) and int(summary.split()[0]) >= 20, report

    def _transposed(p):
        g = torch.randn(p.shape[::-1]) if p.dim() == 2 else torch.randn(p.shape)
        return g.to(p.dtype)

    def test_kernels_compile_for_sm90_without_a_gpu(monkeypatch, tmp_path):
        """Triton's compiler (and the ptxas, cuobjdump its wheel bundles) needs no GPU: compile the
        richest variants at the backend's launch settings for an H100/H200 and check them: no
        register spilled, 128-bit loads in the aligned passes, every load of a pass before its
        first store, and the default step free of the bias correction's divisions."""
        pytest.importorskip("triton.backends.nvidia")
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile afresh, leave ~/.triton alone
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (it warns otherwise)
        from benchmarks.triton_resources import compile_for, occupancy, resources
        from merit_core.optim.merit.triton import kernels
        from merit_core.optim.merit.triton.plan import DEFAULT_TILING as tiling

        tile = tiling.constexprs()
        finalize = dict(tiling.finalize_constexprs(), ROWCOL=True)
        for l2 in (True, False):  # in-order sums; maxima of column chunks by atomic max
            r = resources(compile_for(kernels.finalize_kernel, {**finalize, "L2": l2}, tiling.finalize_warps))
            assert r["local"] == r["stack"] == 0, r
        pass1 = dict(MAXIMIZE=True, L2=False, ROWCOL=True, PER_TENSOR_BC=True)
        pass2 = dict(L2=False, ROWCOL=True, BOUND=True, CLIP=True, LR_PTR=True, PER_TENSOR_BC=False)
        for aligned in (True, False):
            options = tiling.launch_options(aligned)
            warps = options.pop("num_warps")
            for kernel, flags in ((kernels.pass1_kernel, pass1), (kernels.pass2_kernel, pass2)):
                got = {}
                for bias_correction in (True, False):
                    consts = {**tile, **flags, **options, "BIAS_CORRECTION": bias_correction}
                    got[bias_correction] = r = resources(compile_for(kernel, consts, warps))
                    where = (kernel.__name__, aligned, bias_correction, r)
                    assert r["local"] == r["stack"] == 0, where
                    assert r["ld>st"] == 0, where
                    assert (r["ldg128"] > 0) == aligned, where
                    assert occupancy(r["regs"], r["smem"], warps) * warps >= 32, where
                assert got[False]["mufu"] < got[True]["mufu"], got  # two IEEE divisions fewer per element

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
    def test_compiled_kernels_on_cuda_match_the_reference_and_lr_never_recompiles():
        from merit_core.optim.merit.triton import kernels as K
        from merit_core.optim.merit.triton import step as mt

        def compiled():
            kernels = (K.pass1_kernel, K.finalize_kernel, K.pass2_kernel)
            return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

        dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float16]
        case = Case([(300, 200), (200,), (300, 200), (64, 48, 3), (1000, 50)], dtypes=dtypes, device="cuda")
        case.run(mt, n_steps=2, weight_decay=0.01, bias_correction=True)
        case.step(mt, [g.mT if g.dim() == 2 else g for g in case.grads(lambda p, gen: _transposed(p))], lr=0.02)
        lr = torch.tensor(0.01, device="cuda")
        case.step(mt, case.grads(), lr=lr)  # compiles the device-lr variants of pass 2
        count = compiled()
        for value in (0.003, 0.03):
            case.step(mt, case.grads(), lr=value)
            lr.fill_(value)
            case.step(mt, case.grads(), lr=lr)
        assert compiled() == count  # a new lr value, float or tensor, compiles nothing
        grads = case.grads()
        with TritonLaunches() as launches:
            case.step(mt, grads, lr=lr)
            case.step(mt, grads, lr=lr)
        # 6 launches a step: two shapes are vectorisable, (64, 48, 3) and (1000, 50) are not,
        # and the fill of the column and tensor maxima before finalize
        assert launches.counts == {"kernels": 12, "copies": 1, "rebuilds": 1}
