"""MERIT's two passes as torch.compile'd functions: the opt-in ``implementation="compile"`` backend.

Opt-in, because the first step compiles each distinct (shape, dtype, switches) combination:
on a 2-core CPU with a cold Inductor cache, tens of seconds for GPT-2 small's 9 shapes, much
less with a warm one (``TORCHINDUCTOR_CACHE_DIR``). Hyperparameters, the learning rate included,
travel as one tensor in the moments' dtype, so a changing (or tensor) learning rate never
recompiles. Every coefficient, ``1 - beta`` included, is computed in float64 on the host (as the
other backends compute them in Python floats) and rounded once into that tensor, so the compiled
math uses the other backends' coefficients (``1 - beta2`` computed in float32 from a rounded
``beta2`` would not be). Inside an outer
``torch.compile`` (e.g. ``fullgraph=True`` around ``opt.step()``) the two passes are traced into
the caller's graph instead of compiled apart. It is kept for
devices where Inductor generates code but neither the C++ kernel (CPU only) nor the Triton
backend applies, and as an independent check of the other backends.

The update is split into two compiled functions (moments + norms; then the scaled, clipped
write) because Inductor in torch 2.13 fails on the single in-place function on CPU
(``KeyError: 'buf14'`` in its outer-loop fusion).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from merit_core.optim.merit.common import Hyper, finite_norms, norm, ratio_or_one

RECOMPILE_LIMIT = 256  # one graph per distinct shape; torch's default (8) is below GPT-2's 9


# The layout of the float64 hyperparameter vector (see _vector).
LR, BETA1, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, EPS, WEIGHT_DECAY, INV_BC1, INV_SQRT_BC2, CLIP = range(10)


def _vector(h: Hyper, step: Tensor) -> list[float]:
    """The hyperparameters as the compiled passes read them (clip inf for none), computed in float64."""
    lr, beta1, beta2, eps, weight_decay, inv_bc1, inv_sqrt_bc2, clip = h.kernel_vector(step)
    return [lr, beta1, 1 - beta1, beta2, 1 - beta2, eps, weight_decay, inv_bc1, inv_sqrt_bc2, clip]


def _direction(m, v, w, hp):
    return (m * hp[INV_BC1]) / (v.sqrt() * hp[INV_SQRT_BC2] + hp[EPS]) + hp[WEIGHT_DECAY] * w


def _pass1(g, w, m, v, hp, kind: str, per_element: bool, maximize: bool):
    g = g.to(m.dtype)
    if maximize:
        g = -g
    m.mul_(hp[BETA1]).add_(hp[ONE_MINUS_BETA1] * g)
    v.mul_(hp[BETA2]).add_(hp[ONE_MINUS_BETA2] * g * g)
    w = w.to(m.dtype)
    u = _direction(m, v, w, hp)
    if per_element:
        return norm(w, kind, 1), norm(u, kind, 1), norm(w, kind, 0), norm(u, kind, 0), norm(w, kind), norm(u, kind)
    return norm(w, kind), norm(u, kind)


def _pass2(w, m, v, hp, stats, per_element: bool, bound: bool, clip: bool):
    w32 = w.to(m.dtype)
    u = _direction(m, v, w32, hp)
    if per_element:
        rw, ru, cw, cu, bw, bu = stats
        s = torch.maximum(rw / ru, cw / cu)
        if bound:
            s = torch.maximum(s, ratio_or_one(bw, bu))
        s = torch.where((rw == 0) | (ru == 0) | (cw == 0) | (cu == 0), torch.ones_like(s), s)
    else:
        bw, bu = stats
        s = ratio_or_one(bw, bu)
    d = s * u
    if clip:
        d = torch.minimum(torch.maximum(d, -hp[CLIP]), hp[CLIP])
    w.copy_(torch.where(finite_norms(bw, bu), w32 - hp[LR] * d, torch.nan))  # the non-finite rule


_compiled: dict = {}


def _get(name: str):
    passes: dict[str, Callable[..., None]] = {"pass1": _pass1, "pass2": _pass2}
    function = passes[name]
    if torch.compiler.is_compiling():
        return function  # traced into the outer graph
    if name not in _compiled:
        _compiled[name] = torch.compile(function, dynamic=False)
    return _compiled[name]


def merit_compiled(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    """The compile backend (the signature: :class:`~merit_core.optim.merit.common.BackendStep`)."""
    if torch.compiler.is_compiling():
        _steps(params, grads, exp_avgs, exp_avg_sqs, state_steps, h)
        return
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT * 4):
        _steps(params, grads, exp_avgs, exp_avg_sqs, state_steps, h)


def _steps(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    cache: dict = {}
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        if not p.numel():
            continue
        key = (
            float(step) if h.bias_correction else None,
            m.dtype,
            p.device,
        )  # the step is read only for the correction
        if key not in cache:
            hp = torch.tensor(_vector(h, step), dtype=m.dtype)  # float64 values, each rounded once
            if isinstance(h.lr, Tensor):
                hp[LR] = h.lr.reshape(())
            cache[key] = hp.to(p.device, non_blocking=True)
        hp = cache[key]
        per_element = p.dim() >= 2 and h.elementwise
        stats = _get("pass1")(g, p, m, v, hp, h.norm, per_element, h.maximize)
        _get("pass2")(p, m, v, hp, stats, per_element, h.weight_bound, h.clip is not None)
