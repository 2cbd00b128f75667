"""MERIT's two passes as torch.compile'd functions: the opt-in ``implementation="compile"`` backend.

Opt-in, because the first step compiles each distinct (shape, dtype, switches) combination:
on a 2-core CPU with a cold Inductor cache, tens of seconds for GPT-2 small's 9 shapes, much
less with a warm one (``TORCHINDUCTOR_CACHE_DIR``). Hyperparameters, the learning rate included,
travel as one tensor, so a changing (or tensor) learning rate never recompiles. It is kept for
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


def _direction(m, v, w, hp):
    # hp = [lr, beta1, beta2, eps, weight_decay, 1/bc1, 1/sqrt(bc2), clip]
    return (m * hp[5]) / (v.sqrt() * hp[6] + hp[3]) + hp[4] * w


def _pass1(g, w, m, v, hp, kind: str, per_element: bool, maximize: bool):
    g = g.to(m.dtype)
    if maximize:
        g = -g
    m.mul_(hp[1]).add_((1 - hp[1]) * g)
    v.mul_(hp[2]).add_((1 - hp[2]) * g * g)
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
        d = torch.minimum(torch.maximum(d, -hp[7]), hp[7])
    w.copy_(torch.where(finite_norms(bw, bu), w32 - hp[0] * d, torch.nan))  # the non-finite rule


_compiled: dict = {}


def _get(name: str):
    if name not in _compiled:
        passes: dict[str, Callable[..., None]] = {"pass1": _pass1, "pass2": _pass2}
        _compiled[name] = torch.compile(passes[name], dynamic=False)
    return _compiled[name]


def merit_compiled(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    """The compile backend (the signature: :class:`~merit_core.optim.merit.common.BackendStep`)."""
    cache = {}
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT * 4):
        for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
            if not p.numel():
                continue
            key = (float(step), m.dtype, p.device)
            if key not in cache:
                hp = torch.tensor(h.kernel_vector(step), dtype=m.dtype)
                if isinstance(h.lr, Tensor):
                    hp[0] = h.lr
                cache[key] = hp.to(p.device, non_blocking=True)
            hp = cache[key]
            per_element = p.dim() >= 2 and h.elementwise
            stats = _get("pass1")(g, p, m, v, hp, h.norm, per_element, h.maximize)
            _get("pass2")(p, m, v, hp, stats, per_element, h.weight_bound, h.clip is not None)
