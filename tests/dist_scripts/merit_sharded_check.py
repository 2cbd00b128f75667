"""Check merit_sharded on DTensors against a literal single-process MERIT, under torchrun.

Run: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_scripts/merit_sharded_check.py
(also works with 4 processes, which adds 2x2 meshes). Every rank builds the same global
tensors, distributes them over several meshes/placements, runs a few MERIT steps for every
ablation combination, gathers the results and compares them with ``reference_step`` (the
shared literal transcription, tests/optim/merit_literal.py: plain Python loops in float64). It
counts all-reduces per step and asserts the expected number. Prints one ``CONFIG ...`` line per layout and ``ALL OK`` on success.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run from a checkout
from tests.optim.merit_literal import SWITCHES, literal_step  # noqa: E402

HP = dict(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-6)
STEPS = 3

# name -> (shape, what is special about it)
SHAPES = {
    "zero_row": (6, 4),  # w row 1 and g row 1 zero: a zero row of w and of u in every step
    "zero_col": (4, 6),  # w col 3 and g col 3 zero; w row 0 zero only before the first step
    "tiny_row": (1, 5),  # dim 0 < world size: empty local shard under Shard(0)
    "single": (1,),  # 1-D with an empty shard under Shard(0)
    "uneven": (5, 3),  # 5 rows over 2 ranks: shards of 3 and 2
    "bias": (7,),  # all-zero bias: s = 1 on the first step
    "cube": (4, 3, 2),  # 3-D: rows along dim 0, columns along dim 1, one matrix per dim-2 index
    "hyper": (3, 2, 2, 3),  # 4-D, uneven over 2 ranks in dim 0 and in the last dim
    "thin_col": (5, 1),  # dim 1 < world size: empty local shard under Shard(1)
}


def make_problem(seed: int = 0) -> tuple[dict, dict]:
    """Global float64 weights and per-step gradients, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    weights, grads = {}, {}
    for name, shape in SHAPES.items():
        w = torch.randn(shape, generator=gen, dtype=torch.float64)
        gs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
        if name == "zero_row":
            w[1] = 0
            for g in gs:
                g[1] = 0
        elif name == "zero_col":
            w[:, 3] = 0
            w[0] = 0
            for g in gs:
                g[:, 3] = 0
        elif name == "bias":
            w.zero_()
        weights[name], grads[name] = w, gs
    return weights, grads


# ---------------------------------------------------------------- literal reference


CLIPPED = [0]  # how many elements the reference clipped (sanity: the test exercises clipping)


def reference_step(w, g, m, v, t, *, lr, beta1, beta2, eps, **opts):
    """One MERIT step on full float64 tensors by the shared literal transcription
    (tests/optim/merit_literal.py); returns (w, m, v). t is the 1-based step number."""
    new_w, new_m, new_v = literal_step(w, g, m, v, t, lr=lr, betas=(beta1, beta2), eps=eps, **opts)
    if opts["clip"] is not None:  # an element was clipped where the step is exactly lr * clip
        CLIPPED[0] += int(((new_w - w).abs() >= lr * opts["clip"] * (1 - 1e-12)).sum())
    return new_w, new_m, new_v


def sharded_step(fn, params, grads, exp_avgs, exp_avg_sqs, steps, *, beta1, beta2, local=None, **kw):
    """What the functional core does around merit_sharded: build the hyperparameter record,
    advance the step counters (when they are tensors; merit_sharded refuses anything else)."""
    from merit_core.optim.merit.common import Hyper

    h = Hyper.of(betas=(beta1, beta2), **kw)
    if all(isinstance(s, torch.Tensor) for s in steps):
        torch._foreach_add_(steps, 1)
    fn(params, grads, exp_avgs, exp_avg_sqs, steps, h, local=local)


# The keyword arguments of one merit_sharded step through `sharded_step`; tests override a few.
STEP_DEFAULTS = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.0, **SWITCHES)


def combos() -> list[dict]:
    """Every ablation (norm x elementwise x weight_bound x clip); the rest cycles per combo."""
    out = []
    for k, (norm, elementwise, weight_bound, clip) in enumerate(
        itertools.product(("max", "l2"), (True, False), (True, False), (0.5, None))
    ):
        out.append(
            dict(
                norm=norm,
                elementwise=elementwise,
                weight_bound=weight_bound,
                clip=clip,
                bias_correction=k % 2 == 1,
                maximize=k % 3 == 2,
                weight_decay=0.0 if k % 4 == 3 else 0.1,
            )
        )
    return out


def reference_run(weights, grads, opts) -> dict:
    """Final (w, m, v) of every parameter after STEPS literal steps."""
    out = {}
    for name, w in weights.items():
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        for t in range(1, STEPS + 1):
            w, m, v = reference_step(w, grads[name][t - 1], m, v, t, **HP, **opts)
        out[name] = (w, m, v)
    return out


# ---------------------------------------------------------------- distributed check


def layouts(world: int):
    """(name, mesh shape, mesh dim names, placements-of(shape), expected all-reduces per step).

    Expected counts take (elementwise, weight_bound) since they decide which statistics exist.
    """
    from torch.distributed.tensor import Replicate, Shard

    one = lambda *_: 1  # noqa: E731
    items = [
        ("fsdp", (world,), None, lambda s: (Shard(0),), one),
        ("tp", (world,), None, lambda s: (Shard(len(s) - 1),), one),
        ("replicate", (world,), None, lambda s: (Replicate(),), lambda *_: 0),
    ]
    if world == 2:
        items += [
            ("hsdp_1x2", (1, 2), ("rep", "shard"), lambda s: (Replicate(), Shard(0)), one),
            ("2d_2x1", (2, 1), ("dp", "tp"), lambda s: (Shard(0), Shard(1) if len(s) >= 2 else Replicate()), one),
        ]
    if world == 4:
        items += [
            ("hsdp_2x2", (2, 2), ("rep", "shard"), lambda s: (Replicate(), Shard(0)), one),
            ("nested_2x2", (2, 2), ("a", "b"), lambda s: (Shard(0), Shard(0)), lambda *_: 2),
            (
                "2d_2x2",
                (2, 2),
                ("dp", "tp"),
                lambda s: (Shard(0), Shard(1) if len(s) >= 2 else Replicate()),
                # rows over tp + cols over dp (round 0); the tensor-wide norms of 2-D params
                # also need tp in round 1; without elementwise, 2-D totals go dp then tp.
                lambda elementwise, weight_bound: 3 if elementwise and weight_bound else 2,
            ),
        ]
    return items


class Counter:
    """Counts torch.distributed.all_reduce calls (the step's only collective)."""

    def __init__(self):
        import torch.distributed as dist

        self.calls = 0
        self._orig = dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting


def check_layout(name, mesh, placements_of, expected, weights, grads, references, counter, dtype, atol):
    from torch.distributed.tensor import distribute_tensor

    from merit_core.optim.merit.dtensor_step import merit_sharded

    worst = 0.0
    # Scatter once per layout; every combo starts from (local) clones of these DTensors.
    d_weights = {p: distribute_tensor(w.to(dtype, copy=True), mesh, placements_of(w.shape)) for p, w in weights.items()}
    d_grads = [
        [distribute_tensor(grads[p][t].to(dtype, copy=True), mesh, placements_of(w.shape)) for p, w in weights.items()]
        for t in range(STEPS)
    ]
    for opts, ref in zip(combos(), references):
        params = {p: w.clone() for p, w in d_weights.items()}
        ms = {p: torch.zeros_like(w) for p, w in params.items()}
        vs = {p: torch.zeros_like(w) for p, w in params.items()}
        steps = [torch.tensor(0.0) for _ in params]
        for t in range(STEPS):
            gs = d_grads[t]
            before = counter.calls
            sharded_step(
                merit_sharded,
                list(params.values()),
                gs,
                list(ms.values()),
                list(vs.values()),
                steps,
                lr=HP["lr"],
                beta1=HP["beta1"],
                beta2=HP["beta2"],
                eps=HP["eps"],
                **opts,
            )
            calls = counter.calls - before
            want = expected(opts["elementwise"], opts["weight_bound"])
            assert calls == want, f"{name} {opts}: {calls} all-reduces in one step, expected {want}"
        assert all(float(s) == STEPS for s in steps), f"{name}: step counters {steps}"
        for pname in params:
            for got, exp, what in zip((params[pname], ms[pname], vs[pname]), ref[pname], ("w", "m", "v")):
                err = (got.full_tensor().double() - exp).abs().max().item()
                assert err <= atol, f"{name} {pname} {what} {opts}: max abs error {err:.3g} > {atol:g}"
                worst = max(worst, err)
    return worst


def check_refusals(mesh):
    """Unsupported placements fail with a clear error on every rank, before any collective."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from merit_core.optim.merit.dtensor_step import merit_sharded

    kw = STEP_DEFAULTS
    local = torch.ones(2, 3)
    partial = DTensor.from_local(local, mesh, (Partial(),), run_check=False)
    replicated = DTensor.from_local(local, mesh, (Replicate(),), run_check=False)
    for params, grads, needle in (([partial], [partial], "Partial"), ([replicated], [partial], "differ")):
        try:
            sharded_step(
                merit_sharded,
                params,
                grads,
                [torch.zeros_like(params[0])],
                [torch.zeros_like(params[0])],
                [torch.tensor(0.0)],
                **kw,
            )
        except NotImplementedError as exc:
            assert needle in str(exc), f"unhelpful error: {exc}"
        else:
            raise AssertionError(f"{needle}: no NotImplementedError")
    assert float(local.sum()) == 6.0, "a refused step must not modify anything"


def check_nonfinite(mesh) -> int:
    """The non-finite rule on the global tensor: one NaN/inf entry on one rank's shard makes every
    shard of that parameter NaN on every rank (moments non-finite only at the entry), Shard(0)
    and Shard(1), torch and C++ local passes, with and without the weight-wise bound."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from merit_core.optim.merit.dtensor_step import merit_sharded

    checked = 0
    gen = torch.Generator().manual_seed(11)
    w0, w1 = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    g0, g1 = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    for kind, value in (("grad", float("nan")), ("grad", float("inf")), ("weight", float("-inf"))):
        for dim in (0, 1):
            for local in ("torch", "cpu"):
                for opts in (dict(), dict(norm="l2", weight_bound=False)):
                    w, g = w0.clone(), g0.clone()
                    (g if kind == "grad" else w)[1, 2] = value
                    params = [distribute_tensor(t, mesh, (Shard(dim),)) for t in (w, w1.clone())]
                    gs = [distribute_tensor(t, mesh, (Shard(dim),)) for t in (g, g1.clone())]
                    ms = [torch.zeros_like(t) for t in params]
                    vs = [torch.zeros_like(t) for t in params]
                    kw = {**STEP_DEFAULTS, **opts, "local": local}
                    sharded_step(merit_sharded, params, gs, ms, vs, [torch.tensor(0.0), torch.tensor(0.0)], **kw)
                    label = f"nonfinite {kind}={value} Shard({dim}) local={local} {opts}"
                    assert bool(params[0].to_local().isnan().all()), f"{label}: a local shard is not all NaN"
                    assert bool(torch.isfinite(params[1].full_tensor()).all()), f"{label}: the other tensor changed"
                    expected = torch.zeros(6, 4, dtype=torch.bool)
                    expected[1, 2] = kind == "grad"
                    for m in (ms[0], vs[0]):
                        assert torch.equal(~torch.isfinite(m.full_tensor()), expected), f"{label}: moments"
                    checked += 1
    return checked


def check_fully_shard(mesh) -> float:
    """Real FSDP2 parameters (Linear(4, 1) has a [1, 4] weight: an empty shard on rank 1)."""
    from torch.distributed.fsdp import fully_shard

    from merit_core.optim.merit.dtensor_step import merit_sharded

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    ms = {k: torch.zeros_like(p) for k, p in params.items()}
    vs = {k: torch.zeros_like(p) for k, p in params.items()}
    ref_m = {k: torch.zeros_like(w) for k, w in full.items()}
    ref_v = {k: torch.zeros_like(w) for k, w in full.items()}
    steps = [torch.tensor(0.0) for _ in params]
    opts = dict(combos()[0], bias_correction=True)
    worst = 0.0
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for t in range(1, STEPS + 1):
        model(x).square().mean().backward()
        grads = {k: p.grad.full_tensor() for k, p in params.items()}
        sharded_step(
            merit_sharded,
            list(params.values()),
            [p.grad for p in params.values()],
            list(ms.values()),
            list(vs.values()),
            steps,
            lr=HP["lr"],
            beta1=HP["beta1"],
            beta2=HP["beta2"],
            eps=HP["eps"],
            **opts,
        )
        model.zero_grad()
        for k in full:
            full[k], ref_m[k], ref_v[k] = reference_step(full[k], grads[k], ref_m[k], ref_v[k], t, **HP, **opts)
            err = (params[k].full_tensor() - full[k]).abs().max().item()
            assert err <= 1e-12, f"fully_shard {k} step {t}: max abs error {err:.3g}"
            worst = max(worst, err)
    return worst


def main() -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = Counter()
    weights, grads = make_problem()
    references = [reference_run(weights, grads, opts) for opts in combos()]
    assert CLIPPED[0] > 0, "the reference never clipped: the clip test is vacuous"
    t_ref = time.perf_counter() - t0

    for name, shape, dim_names, placements_of, expected in layouts(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dim_names)
        t = time.perf_counter()
        worst = check_layout(
            name, mesh, placements_of, expected, weights, grads, references, counter, torch.float64, atol=1e-12
        )
        if rank == 0:
            print(
                f"CONFIG {name} mesh={shape} combos={len(references)} steps={STEPS} "
                f"max_abs_err={worst:.2e} all_reduces_per_step={expected(True, True)} "
                f"time={time.perf_counter() - t:.2f}s",
                flush=True,
            )

    mesh = init_device_mesh("cpu", (world,))
    worst = check_layout(
        "fsdp_fp32",
        mesh,
        lambda s: (Shard(0),),
        lambda *_: 1,
        weights,
        grads,
        references,
        counter,
        torch.float32,
        atol=2e-5,
    )
    check_refusals(mesh)
    n_nonfinite = check_nonfinite(mesh)
    worst_fs = check_fully_shard(mesh)
    if rank == 0:
        print(f"CONFIG fsdp_fp32 max_abs_err={worst:.2e}")
        print(f"CONFIG fully_shard max_abs_err={worst_fs:.2e}")
        print(f"NONFINITE cases={n_nonfinite} ok")
        print(f"ALL OK world={world} reference={t_ref:.2f}s total={time.perf_counter() - t0:.2f}s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
