"""The table of non-finite cases every MERIT backend must pass (tests/optim/test_merit_nonfinite.py
runs the CPU backends, tests/optim/test_merit_triton.py the Triton one under the interpreter).

The rule (merit_core/optim/merit/common.py, NONFINITE_RULE): a parameter whose weight or update
direction holds a NaN or an infinity becomes NaN in every element; its moments are updated
element by element (non-finite exactly where the gradient was); other parameters are unaffected.
"""

from __future__ import annotations

import math

import torch

from merit_core.optim.merit.common import Hyper
from tests.optim.merit_literal import SWITCHES

SHAPES = [(5, 4), (4,), (5, 4)]  # two shapes only: the compile backend compiles each once
NAN, INF = math.nan, math.inf
# name: (index of the poisoned tensor, "grad" or "weight", where, value)
CASES = {
    "grad-nan": (0, "grad", (2, 3), NAN),
    "grad-inf": (0, "grad", (2, 3), INF),
    "grad-row-nan": (0, "grad", (4, slice(None)), NAN),
    "weight-nan": (0, "weight", (1, 3), NAN),
    "weight-inf": (0, "weight", (1, 3), -INF),
    "1d-grad-nan": (1, "grad", (3,), NAN),
    "1d-weight-inf": (1, "weight", (3,), INF),
}
CONFIGS = {
    "default": dict(),
    "l2-unbounded": dict(norm="l2", weight_bound=False, clip=None),
    "weightwise-decay": dict(elementwise=False, weight_decay=0.1, bias_correction=True),
}
BASE = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, **SWITCHES)


def hyper(config: str) -> Hyper:
    return Hyper.of(**{**BASE, **CONFIGS[config]})


def inputs(case: str, seed: int = 0, device: str = "cpu"):
    """(params, [grads of step 1, grads of step 2]) with the case's non-finite entry placed, on `device`."""
    target, kind, where, value = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    params = [0.2 * torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]
    if kind == "grad":
        grads[0][target][where] = value
    else:
        params[target][where] = value
    return [p.to(device) for p in params], [[g.to(device) for g in gs] for gs in grads]


def check(step, case: str, config: str, device: str = "cpu") -> None:
    """Run two steps of ``step(params, grads, exp_avgs, exp_avg_sqs, state_steps, h)`` (a backend
    with the functional signature; it advances nothing, this does) on `device` and assert the rule."""
    from merit_core.optim.merit.reference import merit_reference

    target, kind, where, _ = CASES[case]
    h = hyper(config)
    params, grads = inputs(case, device=device)
    params = [torch.nn.Parameter(p) for p in params]  # as the optimizer holds them (compiled graphs guard on it)
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    steps = [torch.tensor(0.0) for _ in params]
    others = [n for n in range(len(params)) if n != target]
    clean = [params[n].detach().clone() for n in others]  # the other tensors alone, by the reference
    clean_m = [torch.zeros_like(p) for p in clean]
    clean_v = [torch.zeros_like(p) for p in clean]
    clean_steps = [torch.tensor(0.0) for _ in clean]
    expected_moments = torch.zeros(SHAPES[target], dtype=torch.bool, device=device)
    if kind == "grad":
        expected_moments[where] = True
    for k in range(2):
        torch._foreach_add_(steps, 1)
        with torch.no_grad():
            step(params, [g.clone() for g in grads[k]], ms, vs, steps, h)
        torch._foreach_add_(clean_steps, 1)
        merit_reference(clean, [grads[k][n].clone() for n in others], clean_m, clean_v, clean_steps, h)
        label = f"{case}/{config}, after step {k + 1}"
        assert bool(params[target].isnan().all()), f"{label}: the poisoned tensor is not all NaN"
        for name, moment in (("exp_avg", ms[target]), ("exp_avg_sq", vs[target])):
            got = ~torch.isfinite(moment)
            assert torch.equal(got, expected_moments), f"{label}: non-finite {name} entries differ from the grad's"
        for n, want in zip(others, clean):
            assert bool(torch.isfinite(params[n]).all()), f"{label}: tensor {n} was touched"
            torch.testing.assert_close(params[n].detach(), want, rtol=1e-6, atol=1e-6)
