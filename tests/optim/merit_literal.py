"""The one literal transcription of MERIT (docs/MERIT.md) that the tests check the backends against:
plain Python loops over elements, rows and columns, in float64. Shared by tests/optim and the
torchrun script tests/dist_scripts/merit_sharded_check.py."""

import itertools
import math

import torch

# MERIT's switches at their defaults (MERIT(), the registry's "merit"): the tests' plain step,
# which each test overrides in part.
SWITCHES = dict(norm="max", elementwise=True, weight_bound=True, clip=1.0, bias_correction=False, maximize=False)


def _norm(values, kind):
    values = list(values)
    if kind == "max":
        return max(abs(x) for x in values)
    return math.sqrt(sum(x * x for x in values))


def _ratio(a, b):
    return 1.0 if a == 0 or b == 0 else a / b


def literal_step(
    w,
    g,
    m,
    v,
    step,
    *,
    lr,
    betas,
    eps,
    weight_decay,
    **switches,
):
    """One MERIT step on float64 tensors: returns new (w, m, v); inputs are not modified.
    ``switches``: any of :data:`SWITCHES`, the others at their defaults."""
    unknown = set(switches) - set(SWITCHES)
    if unknown:
        raise TypeError(f"literal_step: unknown switches {sorted(unknown)}")
    switches = {**SWITCHES, **switches}
    norm, elementwise, weight_bound = switches["norm"], switches["elementwise"], switches["weight_bound"]
    clip, bias_correction, maximize = switches["clip"], switches["bias_correction"], switches["maximize"]
    b1, b2 = betas
    shape = tuple(w.shape)
    idx = list(itertools.product(*[range(n) for n in shape]))
    W = {i: float(w[i]) for i in idx}
    G = {i: (-1.0 if maximize else 1.0) * float(g[i]) for i in idx}
    M = {i: b1 * float(m[i]) + (1 - b1) * G[i] for i in idx}
    V = {i: b2 * float(v[i]) + (1 - b2) * G[i] ** 2 for i in idx}
    bc1 = 1 - b1**step if bias_correction else 1.0
    bc2 = 1 - b2**step if bias_correction else 1.0
    U = {i: (M[i] / bc1) / (math.sqrt(V[i] / bc2) + eps) + weight_decay * W[i] for i in idx}

    b = _ratio(_norm(W.values(), norm), _norm(U.values(), norm))
    S = {}
    if len(shape) >= 2 and elementwise:
        rows, cols = shape[0], shape[1]
        trailing = list(itertools.product(*[range(n) for n in shape[2:]]))
        for t in trailing:  # each trailing index is its own [rows, cols] matrix
            rw = [_norm((W[(i, j) + t] for j in range(cols)), norm) for i in range(rows)]
            ru = [_norm((U[(i, j) + t] for j in range(cols)), norm) for i in range(rows)]
            cw = [_norm((W[(i, j) + t] for i in range(rows)), norm) for j in range(cols)]
            cu = [_norm((U[(i, j) + t] for i in range(rows)), norm) for j in range(cols)]
            for i in range(rows):
                for j in range(cols):
                    if rw[i] == 0 or ru[i] == 0 or cw[j] == 0 or cu[j] == 0:
                        S[(i, j) + t] = 1.0
                    else:
                        s = max(rw[i] / ru[i], cw[j] / cu[j])
                        S[(i, j) + t] = max(s, b) if weight_bound else s
    else:
        S = {i: b for i in idx}

    new_w = torch.empty(shape, dtype=torch.float64)
    new_m, new_v = torch.empty_like(new_w), torch.empty_like(new_w)
    for i in idx:
        d = S[i] * U[i]
        if clip is not None:
            d = min(max(d, -clip), clip)
        new_w[i] = W[i] - lr * d
        new_m[i], new_v[i] = M[i], V[i]
    return new_w, new_m, new_v
