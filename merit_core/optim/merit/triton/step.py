"""The Triton backend's step (:func:`merit_triton`, the common backend signature) and the cache
of plans it keeps, one per list of parameters and tiling."""

from __future__ import annotations

from collections import OrderedDict

import torch

from merit_core.optim.merit.common import Hyper
from merit_core.optim.merit.triton.plan import DEFAULT_TILING, DTYPE_CODES, Scalars, Tiling, TritonPlan, scalars

_CACHE_SIZE = 16  # plans kept (one per distinct list of parameters, e.g. per param group)
_plans: OrderedDict = OrderedDict()


def _check(params, grads, exp_avgs, exp_avg_sqs) -> torch.device:
    device = params[0].device
    for n, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        where = f" (tensor {n} of the group, shape {tuple(p.shape)})"
        if p.dtype not in DTYPE_CODES:
            raise ValueError(
                f"merit_triton: parameters must be float32, bfloat16 or float16, got {p.dtype}{where}; "
                "Triton has no fast float64 path, use another MERIT backend for float64"
            )
        if g.dtype not in DTYPE_CODES:
            raise ValueError(f"merit_triton: grads must be float32, bfloat16 or float16, got {g.dtype}{where}")
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise ValueError(f"merit_triton: exp_avg and exp_avg_sq must be float32, got {m.dtype}, {v.dtype}{where}")
        if not (g.shape == m.shape == v.shape == p.shape):
            raise ValueError(f"merit_triton: param, grad, exp_avg and exp_avg_sq shapes differ{where}")
        if not (p.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            raise ValueError(
                f"merit_triton: params, exp_avg and exp_avg_sq must be contiguous (the kernels address "
                f"them as dense row-major arrays){where}"
            )
        if g.is_sparse or any(t.device != device for t in (p, g, m, v)):
            raise ValueError(f"merit_triton: all tensors must be dense and on {device}{where}")
    return device


def plan_for(params, grads, exp_avgs, exp_avg_sqs, tiling: Tiling = DEFAULT_TILING) -> TritonPlan:
    """The cached plan of these tensors for this tiling, its pointer table rebuilt if any address
    changed."""
    param_entries, pointer_entries = [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        param_entries.append((p.data_ptr(), p.shape, p.dtype))
        pointer_entries.append((g.data_ptr(), g.stride(), g.dtype, g.shape, m.data_ptr(), v.data_ptr()))
    param_key, pointer_key = (tiling, params[0].device, *param_entries), tuple(pointer_entries)
    plan = _plans.get(param_key)
    if plan is not None and plan.pointer_key == pointer_key:
        _plans.move_to_end(param_key)
        return plan
    device = _check(params, grads, exp_avgs, exp_avg_sqs)
    if plan is None:
        plan = TritonPlan(params, device, tiling)
        _plans[param_key] = plan
        while len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    plan.bind(grads, exp_avgs, exp_avg_sqs, params, pointer_key)
    return plan


def merit_triton(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper, tiling: Tiling = DEFAULT_TILING) -> None:
    """One MERIT step of all given tensors in place, in 3 to 6 Triton launches (pass 1,
    finalize, pass 2; see the package's docstring). ``state_steps`` are CPU scalar tensors
    already incremented by the caller (read only, for the bias correction); ``h.lr`` is a float
    or a one-element tensor."""
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(state_steps)):
        raise ValueError("merit_triton: params, grads, exp_avgs, exp_avg_sqs and state_steps differ in length")
    if not params:
        return
    plan = plan_for(params, grads, exp_avgs, exp_avg_sqs, tiling)
    if plan.n_tiles == 0:
        return
    s = scalars(plan, state_steps, h)
    if plan.device.type == "cuda" and plan.device.index != torch.cuda.current_device():
        with torch.cuda.device(plan.device):  # Triton launches on the current device
            _run_phases(plan, s)
    else:
        _run_phases(plan, s)


def _run_phases(plan: TritonPlan, s: Scalars) -> None:
    plan.pass1(s)
    plan.finalize(s)
    plan.pass2(s)
