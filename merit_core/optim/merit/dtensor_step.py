"""MERIT's step on sharded (DTensor) parameters, exact on the global tensors.

FSDP2 (``fully_shard``) turns every parameter into a ``DTensor`` whose local shard holds a
block of rows (``Shard(0)``). MERIT's ratios are maxima (or l2 norms) over whole rows,
whole columns and the whole tensor, so a per-shard statistic is silently wrong. This module
computes every statistic on the local shards and completes it with explicit all-reduces
over exactly the mesh dimensions that split the reduced tensor dimension. The statistics of
all parameters of a step are packed into one flat buffer per (process group, reduce op,
dtype), so a step under plain FSDP2 costs ONE all-reduce whatever the number of parameters.

The algorithm is the one of docs/MERIT.md, on the full tensor, for each parameter ``w``:

    m <- b1*m + (1-b1)*g ;  v <- b2*v + (1-b2)*g^2
    u  = m_hat / (sqrt(v_hat) + eps) + wd*w      (m_hat = m, v_hat = v without bias correction)
    2-D and larger (elementwise=True):  s_ij = max(r_i, c_j, b)   (b only with weight_bound)
        r_i = |w[i,:]| / |u[i,:]|,  c_j = |w[:,j]| / |u[:,j]|,  b = |w| / |u|
        s_ij = 1 wherever one of the row/column norms of w or u feeding it is zero
    2-D and larger (elementwise=False) and 1-D/0-D:  s = |w| / |u|, or 1 if either is zero
    d = clamp(s*u, -clip, clip)   (no clamp when clip is None);   w <- w - lr*d

where ``|.|`` is the max-norm (largest absolute entry; ``norm="max"``) or the l2 norm
(``norm="l2"``). Tensors with 3 or more dims follow ``merit_core.optim.merit`` (and the
authors' code): rows along dim 0, columns along dim 1, and every index of the trailing dims
is its own [dim 0, dim 1] matrix for the row and column norms, while b spans the whole
tensor. With ``elementwise=False`` the ``weight_bound`` switch has no effect (s = b).
Non-finite values follow the rule of ``common.py`` on the *global* tensor: a NaN/inf anywhere
in a parameter's w or u (on any rank) makes every element of it NaN on every rank. Local max
statistics count NaN as +inf before the all-reduce (collectives' MAX need not propagate NaN),
and the tensor-wide norms are always completed, also without the weight-wise bound.
The update is computed in the moments' dtype (fp32 moments for a bf16 parameter, as MERIT
keeps them) and the new weight is rounded to the parameter's dtype once.

Placements: ``Shard(d)`` for any d (even or uneven, including empty local shards) and
``Replicate()``, on meshes of any dimension: FSDP ``(Shard(0),)``, HSDP
``(Replicate(), Shard(0))``, tensor-parallel ``Shard(1)``, or several mesh dims sharding one
tensor. Row norms are completed over the mesh dims that split dim 1, column norms over those
that split dim 0, and tensor-wide norms over all splitting mesh dims (or derived from the
completed row/column norms when those already cover the tensor). ``Partial``,
``_StridedShard`` and any other placement raise ``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from merit_core.optim.merit import cpu as _cpu
from merit_core.optim.merit.common import Hyper, finite_norms

__all__ = ["merit_sharded"]

_STATS = torch.float64  # statistics travel in float64: the C++ passes write them so, one bucket per group


@dataclass
class _Layout:
    """The process groups over which a parameter's statistics must be completed."""

    row_groups: list = field(default_factory=list)  # mesh dims (size > 1) that split tensor dim 0
    col_groups: list = field(default_factory=list)  # ... that split tensor dim 1
    batch_groups: list = field(default_factory=list)  # ... that split a trailing dim (3-D and up)

    @property
    def all_groups(self) -> list:
        return self.row_groups + self.col_groups + self.batch_groups


@dataclass
class _Request:
    """A statistics tensor still to be reduced over ``groups`` (one group per round)."""

    stats: Tensor
    op: str
    groups: list


@dataclass
class _Pending:
    """One parameter between its local statistics and its update."""

    w: Tensor
    u: Tensor | None  # the torch path's update direction; None: the C++ passes recompute it
    m: Tensor  # moments and step, for the C++ pass 2
    v: Tensor
    step: Tensor
    total: Tensor  # [2]: tensor-wide norms of w and u
    rows: Tensor | None = None  # [2, local rows, T] (or [2, rows*T]): row norms of w and u
    cols: Tensor | None = None  # [2, local cols, T]: column norms of w and u (set with rows)
    total_from: str = "local"  # "local" | "rows" | "cols": source of the tensor-wide norms


def _is_dtensor(t: Tensor) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _layout(p: Tensor, others: tuple[Tensor, ...]) -> _Layout | None:
    """Groups that split ``p``'s rows and columns; None when this rank holds none of ``p``."""
    if not _is_dtensor(p):
        for t in others:
            if _is_dtensor(t):
                raise ValueError("merit_sharded: a plain parameter has a DTensor gradient or state")
        return _Layout()
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for t in others:
        if not _is_dtensor(t) or t.placements != p.placements or t.device_mesh != p.device_mesh:
            got = t.placements if _is_dtensor(t) else "a plain tensor"
            raise NotImplementedError(
                f"merit_sharded: gradient/state placements {got} differ from the parameter's "
                f"{p.placements}; redistribute them to the parameter's placements first"
            )
    mesh = p.device_mesh
    if mesh.get_coordinate() is None:
        return None
    layout = _Layout()
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or isinstance(placement, _StridedShard):
            raise NotImplementedError(
                f"merit_sharded: placement {placement!r} (mesh dim {mesh_dim}) is not supported; "
                "MERIT supports Shard(d) and Replicate() parameters"
            )
        if mesh.size(mesh_dim) == 1:
            continue
        dim = placement.dim % max(p.ndim, 1)
        group = mesh.get_group(mesh_dim)
        (layout.row_groups, layout.col_groups, layout.batch_groups)[min(dim, 2)].append(group)
    return layout


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _as_3d(x: Tensor) -> Tensor:
    """View a tensor with >= 2 dims as [rows, columns, product of the trailing dims]."""
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def _norm(x: Tensor, dim: int | None, norm: str, dtype: torch.dtype) -> Tensor:
    """Max-norm, or SQUARED l2 norm, of ``x`` along ``dim`` (all dims if None), in ``dtype``.

    For the max-norm ``x`` must already hold absolute values. An empty reduction gives 0, the
    identity of both MAX over absolute values and SUM, so a rank whose shard is empty still
    contributes a well-formed buffer to the collective (``amax`` would raise there).
    """
    if norm == "l2":
        return torch.linalg.vector_norm(x, 2, dim=dim, dtype=dtype).square()
    size = x.numel() if dim is None else x.shape[dim]
    if size == 0:
        shape = () if dim is None else x.shape[:dim] + x.shape[dim + 1 :]
        return x.new_zeros(shape, dtype=dtype)
    return (x.amax() if dim is None else x.amax(dim=dim)).to(dtype)


def _norms(w: Tensor, u: Tensor, dims: tuple[int | None, ...], norm: str, dtype: torch.dtype) -> list[Tensor]:
    """For each reduction dim, the [2, ...] stack of the norms of ``w`` and ``u`` along it."""
    if norm == "max":  # one |.| pass per tensor, shared by all reductions
        w, u = w.abs(), u.abs()
    # amax propagates NaN; a NaN statistic becomes +inf, which every MAX all-reduce keeps
    return [
        torch.stack([_norm(w, d, norm, dtype), _norm(u, d, norm, dtype)]).nan_to_num_(nan=math.inf, posinf=math.inf)
        for d in dims
    ]


def _combine(stats: Tensor, norm: str) -> Tensor:
    """Tensor-wide norms from a [2, ...] stack of (nonnegative) partial norms: max, or sum."""
    flat = stats.flatten(1)
    if norm == "l2":
        return flat.sum(1)
    if flat.shape[1] == 0:
        return flat.new_zeros(2)
    return flat.amax(1)


def _all_reduce_rounds(requests: list[_Request]) -> None:
    """Complete every request in place with as few all-reduces as the groups allow.

    Round k reduces each request over its k-th group; requests sharing (group, op, dtype)
    travel in one flat buffer. Bucket order follows parameter order, which is the same on
    every rank, and the members of one group hold equally-sized statistics, so every rank
    issues the same collectives with the same sizes.
    """
    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    rounds = max((len(r.groups) for r in requests), default=0)
    for k in range(rounds):
        buckets: dict[tuple, list[Tensor]] = {}
        for req in requests:
            if len(req.groups) > k:
                key = (req.groups[k], req.op, req.stats.dtype, req.stats.device)
                buckets.setdefault(key, []).append(req.stats)
        launched = []
        for (group, op, _, _), tensors in buckets.items():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            work = dist.all_reduce(flat, op=ops[op], group=group, async_op=True)
            launched.append((work, flat, tensors))
        for work, flat, tensors in launched:
            work.wait()
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))


def _ratio(stats: Tensor, norm: str) -> tuple[Tensor, Tensor]:
    """Ratio |w|/|u| from stacked [2, ...] norms, and the mask where either norm is zero."""
    ratio = stats[0] / stats[1]
    if norm == "l2":
        ratio = ratio.sqrt()
    return ratio, (stats[0] == 0) | (stats[1] == 0)


def _apply(job: _Pending, u: Tensor, h: Hyper) -> None:
    """Scale, clip and apply one parameter's update ``u`` (``job.u``) from its completed statistics (torch path)."""
    w, norm = job.w, h.norm
    finite = finite_norms(job.total[0], job.total[1])  # the non-finite rule, on the global tensor
    if job.rows is None or job.cols is None:  # one ratio for the whole tensor
        b, zero = _ratio(job.total, norm)
        scale = torch.where(zero, torch.ones_like(b), b)
        u.mul_(torch.where(finite, scale, torch.nan).to(u.dtype))
    else:
        r, r_zero = _ratio(job.rows, norm)
        c, c_zero = _ratio(job.cols, norm)
        scale = torch.maximum(r[:, None], c[None, :])  # [rows, 1, T] and [1, cols, T]
        if h.weight_bound:
            b, _ = _ratio(job.total, norm)  # b's own zeros imply a zero row, masked below
            scale = torch.maximum(scale, b)
        zero = r_zero[:, None] | c_zero[None, :]
        scale = torch.where(zero, torch.ones_like(scale), scale)
        scale = torch.where(finite, scale, torch.nan)
        u.mul_(scale.to(u.dtype).reshape(u.shape))
    if h.clip is not None:
        u.clamp_(-h.clip, h.clip)
    if isinstance(h.lr, Tensor):
        w.sub_(u.mul_(h.lr))
    else:
        w.add_(u, alpha=-h.lr)


@torch.no_grad()
def merit_sharded(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper, *, local: str | None = None) -> None:
    """One MERIT step, in place, on DTensor (or plain) parameters and their AdamW-shaped state.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: equal-length lists. For a DTensor parameter the
            gradient and both moments must be DTensors with the parameter's mesh and
            placements (what FSDP2 and ``torch.zeros_like(param)`` give). Plain tensors are
            treated as whole tensors (no communication).
        state_steps: one scalar step tensor per parameter (AdamW's ``state["step"]``), already
            advanced for this step by the caller (the functional core); used only for bias
            correction, read through tensor ops or, by the C++ passes, on the CPU.
        h: the hyperparameter record (:class:`~merit_core.optim.merit.common.Hyper`).
        local: how each rank computes on its local shards: ``"cpu"`` (the C++ kernel's two
            passes; CPU shards), ``"torch"`` (torch ops; any device), or None: the C++ passes
            where they can take the shard, torch ops elsewhere.

    Every rank of every mesh that holds a parameter must call this with the same parameter
    list, since the statistics are completed by collectives. Under FSDP2 (1-D mesh,
    ``Shard(0)``) a step issues exactly one all-reduce; in general one per (round, process
    group, reduce op), where a tensor split on both its rows and its columns needs one round
    per splitting mesh dimension.

    Raises:
        ValueError: unknown ``local`` or mismatched list lengths.
        NotImplementedError: a placement other than Shard/Replicate, or states whose
            placements differ from their parameter's.
    """
    if local not in (None, "cpu", "torch"):
        raise ValueError(f"merit_sharded: local must be None, 'cpu' or 'torch', got {local!r}")
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(state_steps) == n):
        raise ValueError("merit_sharded: params, grads, exp_avgs, exp_avg_sqs, state_steps differ in length")
    norm = h.norm
    reduce_op = "max" if norm == "max" else "sum"

    # The C++ passes take lr as a number: a tensor lr is read once (a CPU tensor: no device sync).
    h_cpu = dataclasses.replace(h, lr=float(h.lr)) if isinstance(h.lr, Tensor) else h

    # Validate every parameter before touching any state or issuing any collective, so a
    # refused placement fails on every rank alike instead of leaving ranks in a collective.
    layouts = [_layout(p, (g, m, v)) for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs)]
    if not all(isinstance(step, Tensor) for step in state_steps):
        raise TypeError("merit_sharded: state_steps must be scalar tensors (AdamW's state['step'])")

    jobs: list[_Pending] = []
    requests: list[_Request] = []
    for p, g, m, v, step, layout in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, layouts):
        if layout is None:
            continue
        w, g, m, v = _local(p), _local(g), _local(m), _local(v)
        per_element = w.ndim >= 2 and h.elementwise
        rows: Tensor | None = None
        cols: Tensor | None = None
        if _use_kernel(local, w, g):
            u = None
            shapes = _cpu.stats_shapes(w, h)
            if shapes is not None:
                rows, cols = (w.new_zeros(s, dtype=_STATS) for s in shapes)
            total = w.new_zeros(2, dtype=_STATS)
            _cpu.pass1(w, g, m, v, step, h_cpu, rows, cols, total)
        else:
            u = _direction(w, g, m, v, step, h)
            if per_element:
                rows, cols, total = _norms(_as_3d(w), _as_3d(u), (1, 0, None), norm, _STATS)
            else:
                (total,) = _norms(w, u, (None,), norm, _STATS)
        job = _Pending(w=w, u=u, m=m, v=v, step=step, total=total, rows=rows, cols=cols)
        jobs.append(job)
        if rows is not None and cols is not None:  # per_element: the row and column norms exist
            # The tensor-wide norms are completed also without the weight-wise bound: the
            # non-finite rule needs them on the global tensor.
            if not (layout.col_groups or layout.batch_groups):
                job.total_from = "cols"  # the completed column norms cover the whole tensor
            elif not (layout.row_groups or layout.batch_groups):
                job.total_from = "rows"  # likewise the completed row norms
            requests.append(_Request(rows, reduce_op, layout.col_groups))
            requests.append(_Request(cols, reduce_op, layout.row_groups))
            if job.total_from == "local":  # complete the local tensor-wide norms over every group
                requests.append(_Request(job.total, reduce_op, layout.all_groups))
        else:
            requests.append(_Request(job.total, reduce_op, layout.all_groups))

    _all_reduce_rounds(requests)
    for job in jobs:
        if job.total_from == "cols" and job.cols is not None:
            job.total = _combine(job.cols, norm)
        elif job.total_from == "rows" and job.rows is not None:
            job.total = _combine(job.rows, norm)
        if job.u is None:
            _cpu.pass2(job.w, job.m, job.v, job.step, h_cpu, job.rows, job.cols, job.total)
        else:
            _apply(job, job.u, h)


def _use_kernel(local: str | None, w: Tensor, g: Tensor) -> bool:
    """Whether this rank's shard takes the C++ passes (``local="cpu"`` insists: checked by the caller)."""
    if local == "torch":
        return False
    if local == "cpu":
        return True
    return w.device.type == "cpu" and _cpu.unavailable([w], [g]) is None


def _direction(w: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, h: Hyper) -> Tensor:
    """Moments in place, and u = m_hat / (sqrt(v_hat) + eps) + wd*w in the moments' dtype (torch ops)."""
    if h.maximize:
        g = -g
    m.mul_(h.beta1).add_(g, alpha=1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    if h.bias_correction:  # factors from the step tensor, at the parameter's precision or better
        t = step.to(torch.promote_types(step.dtype, m.dtype))
        denom = (v / (1 - h.beta2**t)).sqrt_().add_(h.eps)
        u = (m / (1 - h.beta1**t)).div_(denom)
    else:
        u = m / (v.sqrt().add_(h.eps))
    if h.weight_decay != 0:
        u.add_(w, alpha=h.weight_decay)
    return u
