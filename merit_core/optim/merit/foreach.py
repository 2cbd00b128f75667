"""The eager multi-tensor MERIT backend: the fallback for accelerators without the Triton backend
(CUDA without triton, MPS, XPU) and for CPUs without a C++ compiler.

All tensors of a (device, dtype) group move together:

* the element-wise parts (moments, ``u``, clipping, the weight update) are ``torch._foreach_*``
  ops, a few multi-tensor launches each whatever the number of tensors;
* the tensor-wide norms of w and u are two ``_foreach_norm`` calls; the weight-wise ratios of
  all tensors are then computed on one stacked vector;
* the row and column norms are one ``vector_norm`` kernel each per 2-D+ tensor; the row and
  column ratios of all tensors are concatenated into one vector and formed there, with +inf
  marking "a feeding norm is zero" (+inf survives ``maximum`` and becomes 1 at the end);
* a tensor whose norms of w or u are not finite (the non-finite rule of ``common.py``) gets
  b = NaN, and b (or, without the weight-wise bound, a floor of -inf/NaN) is folded into its
  column ratios: NaN survives ``maximum`` and every later op, so the whole tensor becomes NaN;
* per tensor remain the element-wise scale (``maximum`` of its row and column ratios, +inf -> 1,
  multiply; one temporary of the tensor's size at a time) and, for 1-D tensors, one multiply.

No host syncs: step counters are CPU tensors, every other quantity stays on the device.
``benchmarks/launches.py`` counts the kernel launches of a step; tests/optim/test_merit_foreach.py bounds them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from merit_core.optim.merit.common import Hyper, finite_norms, norm

_COLUMN_INDEX: dict = {}  # (device, tensors, column counts) -> the tensor index of every column statistic


def _group(params, grads, exp_avgs, exp_avg_sqs, state_steps) -> dict:
    """Non-empty tensors by (device, parameter dtype, gradient dtype)."""
    groups: dict = {}
    for item in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        p = item[0]
        if p.numel():
            groups.setdefault((p.device, p.dtype, item[1].dtype), []).append(item)
    return groups


def _column_index(device: torch.device, tensors: tuple[int, ...], counts: tuple[int, ...]) -> Tensor:
    """For concatenated column statistics, the index of each one's tensor (cached: no host-to-device
    copy per step)."""
    key = (device, tensors, counts)
    if key not in _COLUMN_INDEX:
        idx = torch.repeat_interleave(torch.tensor(tensors), torch.tensor(counts))
        _COLUMN_INDEX[key] = idx.to(device)
    return _COLUMN_INDEX[key]


def _marked_ratio(wn: Tensor, un: Tensor) -> Tensor:
    """wn / un, +inf wherever wn or un is zero (an infinite ratio, which needs a subnormal u, is
    marked too), NaN where either norm is NaN."""
    return (wn / un).masked_fill_((wn == 0) | (un == 0), math.inf)


@torch.no_grad()
def merit_foreach(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    """The foreach backend (the signature: :class:`~merit_core.optim.merit.common.BackendStep`)."""
    for (device, _, _), items in _group(params, grads, exp_avgs, exp_avg_sqs, state_steps).items():
        _step(*map(list, zip(*items)), h=h, device=device)


def _step(ps, gs, ms, vs, steps, *, h: Hyper, device: torch.device) -> None:
    # Moments (fp32 for bf16/fp16 parameters). Grads of another dtype are cast once, so that the
    # moment updates take the multi-tensor fast path (mixed-dtype lists go tensor by tensor).
    if gs[0].dtype != ms[0].dtype:
        gs = [g.to(ms[0].dtype) for g in gs]
    sign = -1.0 if h.maximize else 1.0
    torch._foreach_mul_(ms, h.beta1)
    torch._foreach_add_(ms, gs, alpha=sign * (1 - h.beta1))
    torch._foreach_mul_(vs, h.beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - h.beta2)

    # u = m_hat / (sqrt(v_hat) + eps) + wd * w
    us = torch._foreach_sqrt(vs)
    if h.bias_correction:
        corrections = [h.corrections(t) for t in steps]
        torch._foreach_div_(us, [math.sqrt(bc2) for _, bc2 in corrections])
    torch._foreach_add_(us, h.eps)
    torch._foreach_reciprocal_(us)
    torch._foreach_mul_(us, ms)
    if h.bias_correction:
        torch._foreach_div_(us, [bc1 for bc1, _ in corrections])
    if h.weight_decay != 0:
        torch._foreach_add_(us, ps, alpha=h.weight_decay)

    # Weight-wise ratios b of every tensor, on one vector.
    order = math.inf if h.norm == "max" else 2
    dtype = us[0].dtype
    wn = torch.stack(torch._foreach_norm(ps, order, dtype=dtype))
    un = torch.stack(torch._foreach_norm(us, order))
    b = torch.where((wn == 0) | (un == 0), torch.ones_like(wn), wn / un)
    b = torch.where(finite_norms(wn, un), b, torch.nan)  # the non-finite rule: NaN poisons the tensor

    per_element = [k for k, p in enumerate(ps) if p.dim() >= 2 and h.elementwise]
    if per_element:
        # Row and column norms, one kernel each; ratios of all tensors on one vector.
        w_stats, u_stats, row_sizes, col_sizes = [], [], [], []
        for k in per_element:
            for dim in (1, 0):
                w_stats.append(norm(ps[k], h.norm, dim=dim, dtype=dtype).reshape(-1))
                u_stats.append(norm(us[k], h.norm, dim=dim).reshape(-1))
            row_sizes.append(w_stats[-2].numel())
            col_sizes.append(w_stats[-1].numel())
        ratios = _marked_ratio(torch.cat(w_stats), torch.cat(u_stats))
        parts = ratios.split([n for pair in zip(row_sizes, col_sizes) for n in pair])
        # The floor b (or, without the bound, -inf), NaN for a poisoned tensor, folded into the
        # column ratios (+inf marks and NaN survive maximum).
        floor = b if h.weight_bound else torch.where(torch.isnan(b), b, -math.inf)
        cols = torch.cat(parts[1::2])
        floor = floor[_column_index(device, tuple(per_element), tuple(col_sizes))]
        parts = list(parts)
        parts[1::2] = torch.maximum(cols, floor).split(col_sizes)
        for n, k in enumerate(per_element):
            u = us[k]
            rows_shape = (u.shape[0], 1, *u.shape[2:])
            cols_shape = (1, *u.shape[1:])
            s = torch.maximum(parts[2 * n].view(rows_shape), parts[2 * n + 1].view(cols_shape))
            u.mul_(s.nan_to_num_(nan=math.nan, posinf=1.0))
    done = set(per_element)
    for k, u in enumerate(us):
        if k not in done:
            u.mul_(b[k])

    if h.clip is not None:
        torch._foreach_clamp_min_(us, -h.clip)
        torch._foreach_clamp_max_(us, h.clip)
    if isinstance(h.lr, Tensor):
        torch._foreach_mul_(us, h.lr.to(device=device, dtype=dtype))
        torch._foreach_sub_(ps, us)
    else:
        torch._foreach_add_(ps, us, alpha=-h.lr)
