"""The plan of one list of tensors for the Triton backend: its metadata table, tile lists and
scratch buffers, and the launches of one step's phases.

A :class:`Tiling` (tile shape, finalize chunks, warps per launch) is fixed when a plan is built;
:data:`DEFAULT_TILING` is what the backend uses (tests build plans with smaller tiles to exercise
many tiles per tensor). The table's field numbers come from :mod:`.kernels`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from merit_core.optim.merit.common import Hyper
from merit_core.optim.merit.triton import kernels as K

DTYPE_CODES = {getattr(torch, name): code for code, name in enumerate(K.DTYPE_NAMES)}


@dataclass(frozen=True)
class Tiling:
    """The compile-time shape of a plan's launches.

    A finalize program reduces its partials in blocks of ``fin_*`` tiles per iteration, so a tall
    matrix's columns take ``nrt / fin_row_tiles`` programs ("max") or iterations of one ("l2").
    ``aligned_warps`` / ``strided_warps``: warps of a pass 1 / pass 2 program over vectorisable
    and other tiles, chosen for sm_90 as the setting that keeps the most warps resident per SM
    with no register spilled (benchmarks/kernel_resources.py; its table is in
    benchmarks/README.md): fewer warps per tile give each thread more elements and registers,
    and fewer warps fit.
    """

    rows: int = 32  # tile rows (BR)
    cols: int = 128  # tile columns (BC); a flat (0-D/1-D) tensor is laid out in rows of this many
    fin_col_tiles: int = 16  # column tiles per iteration when reducing a tile-row's row partials (FC)
    fin_row_tiles: int = 64  # row tiles per program ("max") / iteration ("l2") reducing column partials (FR)
    fin_tiles: int = 1024  # tiles per iteration when reducing a tensor's tile partials (FT)
    finalize_warps: int = 8
    aligned_warps: int = 16
    strided_warps: int = 32

    def constexprs(self) -> dict:
        """The tile shape every kernel is compiled for (``BR``, ``BC``)."""
        return dict(BR=self.rows, BC=self.cols)

    def finalize_constexprs(self) -> dict:
        """The finalize kernel's chunks (``FC``, ``FR``, ``FT``) with the tile shape."""
        return dict(self.constexprs(), FC=self.fin_col_tiles, FR=self.fin_row_tiles, FT=self.fin_tiles)

    def launch_options(self, aligned: bool) -> dict:
        """The ``ALIGNED`` switch and ``num_warps`` of a pass 1 / pass 2 launch over vectorisable
        (``aligned``) or other tiles."""
        return dict(ALIGNED=aligned, num_warps=self.aligned_warps if aligned else self.strided_warps)


DEFAULT_TILING = Tiling()


class Scalars(NamedTuple):
    """One step's launch arguments: the group's record ``h`` and what :func:`scalars` resolves
    from it for this plan and step (the lr's form, the bias corrections)."""

    h: Hyper
    lr: float  # used when lr_tensor is None
    lr_tensor: torch.Tensor | None  # a 1-element tensor on the params' device, loaded in pass 2
    bc1: float  # used when bc_tensor is None
    bc2: float
    bc_tensor: torch.Tensor | None  # [T, 2] fp32 per-tensor bias corrections when steps differ


def scalars(plan: TritonPlan, state_steps, h: Hyper) -> Scalars:
    """This step's :class:`Scalars` from the record (on the host; no device sync: steps are CPU
    tensors)."""
    lr_tensor, lr_value = None, 0.0
    if isinstance(h.lr, torch.Tensor):
        if h.lr.device == plan.device:
            lr_tensor = h.lr  # read inside pass 2: no sync, no recompile when it changes
        else:
            lr_value = float(h.lr)  # a CPU scalar next to device params: reading it does not sync
    else:
        lr_value = float(h.lr)
    bc1 = bc2 = 1.0
    bc_tensor = None
    if h.bias_correction:
        corrections = [h.corrections(state_steps[n]) for n in plan.index]
        if corrections and all(c == corrections[0] for c in corrections):
            bc1, bc2 = corrections[0]
        elif corrections:
            bc_tensor = _to_device(torch.tensor(corrections, dtype=torch.float32), plan.device)
    return Scalars(h=h, lr=lr_value, lr_tensor=lr_tensor, bc1=bc1, bc2=bc2, bc_tensor=bc_tensor)


class TritonPlan:
    """Tables and scratch buffers of one list of tensors, and the launches of a step.

    Tensors that are 1-D or 2-D, 16-byte aligned and hold whole 4-element groups per row (with
    grads and moments alike) are "vectorisable": their tiles come first and pass 1 / pass 2 run
    them in a launch compiled with alignment hints (128-bit loads); the other tiles take a second,
    strided launch. So a step is 3 launches (pass 1, finalize, pass 2) when all tensors are of one
    kind and 5 when both kinds are present, whatever the number of tensors, plus a fill of the
    column and tensor norms before finalize with max-norm element-wise ratios (the default).

    ``row_stats`` ([2, total_rows]: |w| then |u| norms, one per row of each matrix),
    ``col_stats`` ([2, total_cols]) and ``tensor_stats`` ([T, 2]) hold the finalized norms
    between :meth:`finalize` and :meth:`pass2` (sums of squares for ``norm="l2"``). The phases
    launch on the current device: make the tensors' device current before calling them. Tensor ``n``
    of the plan (``plan.index[n]`` is its position in the caller's lists; empty tensors are
    left out) has its rows at ``row_offset[n]`` (``K * R`` of them, matrix-major) and its
    columns at ``col_offset[n]``.
    """

    def __init__(self, params, device: torch.device, tiling: Tiling = DEFAULT_TILING):
        self.device, self.tiling = device, tiling
        nonempty = [n for n, p in enumerate(params) if p.numel() > 0]
        vec = [n for n in nonempty if _vectorisable(params[n], tiling.cols)]
        self.index = vec + [n for n in nonempty if n not in set(vec)]  # their tiles come first
        self.n_vec = len(vec)
        self.row_offset: list[int] = []
        self.col_offset: list[int] = []
        static: list[list[int]] = []
        tile_tensor: list[int] = []
        work: list[torch.Tensor] = []
        rows = cols = tiles = 0
        for n in self.index:
            p = params[n]
            if p.dim() >= 2:
                n_rows, n_cols, k_mats = p.shape[0], p.shape[1], math.prod(p.shape[2:])
                lim, strides, is_mat = n_rows * n_cols, (n_cols * k_mats, k_mats, 1), 1
            else:
                n_cols, k_mats = tiling.cols, 1
                n_rows = -(-p.numel() // n_cols)
                lim, strides, is_mat = p.numel(), (n_cols, 1, 0), 0
            nrt, nct = -(-n_rows // tiling.rows), -(-n_cols // tiling.cols)
            entry = [0] * int(K.META_WIDTH)
            entry[K.ROWS], entry[K.COLS], entry[K.LIMIT] = n_rows, n_cols, lim
            entry[K.P_ROW_STRIDE], entry[K.P_COL_STRIDE], entry[K.P_MAT_STRIDE] = strides
            entry[K.FIRST_TILE], entry[K.ROW_TILES], entry[K.COL_TILES] = tiles, nrt, nct
            entry[K.FIRST_ROW_SLOT], entry[K.FIRST_COL_SLOT], entry[K.IS_MATRIX] = rows, cols, is_mat
            entry[K.PARAM_DTYPE], entry[K.MATRICES] = DTYPE_CODES[p.dtype], k_mats
            static.append(entry)
            self.row_offset.append(rows)
            self.col_offset.append(cols)
            n_tiles = k_mats * nrt * nct
            tile_tensor += [len(static) - 1] * n_tiles
            local = torch.arange(n_tiles)
            rem = local % (nrt * nct)
            rt = rem // nct  # row tiles that start a chunk reduce columns (see the finalize kernel)
            reduces = (local == 0) | (bool(is_mat) & ((rem % nct == 0) | (rt % tiling.fin_row_tiles == 0)))
            work.append(local[reduces] + tiles)
            tiles += n_tiles
            if len(static) == self.n_vec:
                self.n_vec_tiles = tiles
            if is_mat:
                rows += k_mats * n_rows
                cols += k_mats * n_cols
        self.static, self.n_tiles, self.total_rows, self.total_cols = static, tiles, max(rows, 1), max(cols, 1)
        f32: dict[str, Any] = dict(device=device, dtype=torch.float32)
        self.tile_tensor = _to_device(torch.tensor(tile_tensor, dtype=torch.int32), device)
        # the tiles finalize runs: the first of each tile-row and of each chunk of fin_row_tiles
        # row tiles of a tile-column of each matrix, and the first of each tensor (the others
        # have nothing to reduce; a launch over all tiles would start and end that many idle
        # programs)
        finalize = torch.cat(work) if work else torch.zeros(0, dtype=torch.int64)
        self.finalize_tiles = _to_device(finalize.to(torch.int32), device)
        self.row_part = torch.empty(max(tiles, 1) * 2 * tiling.rows, **f32)
        self.col_part = torch.empty(max(tiles, 1) * 2 * tiling.cols, **f32)
        self.tensor_part = torch.empty(max(tiles, 1) * 2, **f32)
        self.row_stats = torch.empty(2, self.total_rows, **f32)
        # column and tensor norms in one buffer: for "max" finalize combines column chunks into
        # them with atomic max, after one fill launch has zeroed it
        n_stats = max(len(static), 1)
        self._max_stats = torch.empty(2 * self.total_cols + 2 * n_stats, **f32)
        self.col_stats = self._max_stats[: 2 * self.total_cols].view(2, self.total_cols)
        self.tensor_stats = self._max_stats[2 * self.total_cols :].view(n_stats, 2)
        if self.n_vec == 0:
            self.n_vec_tiles = 0
        self.pointer_key: tuple[Any, ...] | None = None
        self.meta: torch.Tensor | None = None
        self.aligned = False  # whether the vectorised kernels may take the first n_vec_tiles tiles
        self._keep: list[torch.Tensor] | None = None  # grad copies the table points at (grads that could not be viewed)

    def bind(self, grads, exp_avgs, exp_avg_sqs, params, pointer_key) -> None:
        """(Re)build the device table with the current addresses and grad strides."""
        table, keep = [], []
        aligned = True
        for pos, (entry, n) in enumerate(zip(self.static, self.index)):
            g = _grad_view(params[n], grads[n])
            if g.data_ptr() != grads[n].data_ptr() or g.storage_offset() != grads[n].storage_offset():
                keep.append(g)
            entry = list(entry)
            entry[K.PARAM], entry[K.EXP_AVG], entry[K.EXP_AVG_SQ] = (
                params[n].data_ptr(),
                exp_avgs[n].data_ptr(),
                exp_avg_sqs[n].data_ptr(),
            )
            entry[K.GRAD], entry[K.GRAD_DTYPE] = g.data_ptr(), DTYPE_CODES[g.dtype]
            if params[n].dim() >= 2:
                entry[K.G_ROW_STRIDE], entry[K.G_COL_STRIDE], entry[K.G_MAT_STRIDE] = g.stride()
            else:
                strides = (self.tiling.cols * g.stride(0), g.stride(0), 0)
                entry[K.G_ROW_STRIDE], entry[K.G_COL_STRIDE], entry[K.G_MAT_STRIDE] = strides
            if pos < self.n_vec:
                addresses = (entry[K.GRAD], entry[K.EXP_AVG], entry[K.EXP_AVG_SQ])
                aligned &= (
                    entry[K.G_COL_STRIDE] == 1
                    and entry[K.G_ROW_STRIDE] % 4 == 0
                    and all(a % 16 == 0 for a in addresses)
                )
            table.append(entry)
        self.aligned = aligned
        self.meta = _to_device(torch.tensor(table or [[0] * int(K.META_WIDTH)], dtype=torch.int64), self.device)
        self._keep = keep
        # A copied grad must be copied again next step: leave the key unset so the table is rebuilt.
        self.pointer_key = None if keep else pointer_key

    def _segments(self):
        """(first tile, tiles, vectorised) of each launch of a pass: one launch for the tiles of
        the vectorisable tensors and one for the rest (or one for all, if addresses disallow)."""
        if not self.aligned or self.n_vec_tiles == 0:
            return [(0, self.n_tiles, False)]
        rest = self.n_tiles - self.n_vec_tiles
        return [(0, self.n_vec_tiles, True)] + ([(self.n_vec_tiles, rest, False)] if rest else [])

    def pass1(self, s: Scalars) -> None:
        """Update m and v; write per-tile partial norms of |w| and |u|."""
        bc = s.bc_tensor if s.bc_tensor is not None else self.tensor_stats
        for first, count, aligned in self._segments():
            self._pass1(s, bc, first, count, aligned)

    def _pass1(self, s: Scalars, bc, first: int, count: int, aligned: bool) -> None:
        K.pass1_kernel[(count,)](
            self.meta,
            self.tile_tensor,
            first,
            self.row_part,
            self.col_part,
            self.tensor_part,
            s.h.beta1,
            1 - s.h.beta1,
            s.h.beta2,
            1 - s.h.beta2,
            s.bc1,
            s.bc2,
            bc,
            s.h.eps,
            s.h.weight_decay,
            **self.tiling.constexprs(),
            MAXIMIZE=s.h.maximize,
            L2=s.h.norm == "l2",
            ROWCOL=s.h.elementwise,
            BIAS_CORRECTION=s.h.bias_correction,
            PER_TENSOR_BC=s.bc_tensor is not None,
            **self.tiling.launch_options(aligned),
        )

    def finalize(self, s: Scalars) -> None:
        """Reduce the partials into ``row_stats``, ``col_stats`` and ``tensor_stats``."""
        if s.h.norm == "max" and s.h.elementwise:  # the column chunks' atomic maxima start at 0
            self.clear_max_stats()
        K.finalize_kernel[(self.finalize_tiles.numel(),)](
            self.meta,
            self.tile_tensor,
            self.finalize_tiles,
            self.row_part,
            self.col_part,
            self.tensor_part,
            self.row_stats,
            self.col_stats,
            self.tensor_stats,
            self.total_rows,
            self.total_cols,
            **self.tiling.finalize_constexprs(),
            L2=s.h.norm == "l2",
            ROWCOL=s.h.elementwise,
            num_warps=self.tiling.finalize_warps,
        )

    def clear_max_stats(self) -> None:
        """Zero the column and tensor norms (one fill launch) before finalize combines the column
        chunks' maxima into them."""
        self._max_stats.zero_()

    def pass2(self, s: Scalars) -> None:
        """Recompute u and apply w <- w - lr * clamp(s*u)."""
        bc = s.bc_tensor if s.bc_tensor is not None else self.tensor_stats
        lr_t = s.lr_tensor if s.lr_tensor is not None else self.tensor_stats
        for first, count, aligned in self._segments():
            self._pass2(s, bc, lr_t, first, count, aligned)

    def _pass2(self, s: Scalars, bc, lr_t, first: int, count: int, aligned: bool) -> None:
        K.pass2_kernel[(count,)](
            self.meta,
            self.tile_tensor,
            first,
            self.row_stats,
            self.col_stats,
            self.tensor_stats,
            self.total_rows,
            self.total_cols,
            s.lr,
            lr_t,
            s.bc1,
            s.bc2,
            bc,
            s.h.eps,
            s.h.weight_decay,
            1.0 if s.h.clip is None else s.h.clip,
            **self.tiling.constexprs(),
            L2=s.h.norm == "l2",
            ROWCOL=s.h.elementwise,
            BOUND=s.h.weight_bound,
            CLIP=s.h.clip is not None,
            LR_PTR=s.lr_tensor is not None,
            BIAS_CORRECTION=s.h.bias_correction,
            PER_TENSOR_BC=s.bc_tensor is not None,
            **self.tiling.launch_options(aligned),
        )


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built table on the device without a blocking copy (pinned memory, non_blocking)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _vectorisable(p: torch.Tensor, tile_cols: int) -> bool:
    """1-D/2-D, a whole number of 4-element groups per row and 16-byte aligned (the grad and
    moments are checked when the table is built)."""
    per_row = p.shape[1] if p.dim() == 2 else tile_cols
    return p.dim() <= 2 and p.numel() % 4 == 0 and per_row % 4 == 0 and p.data_ptr() % 16 == 0


def _grad_view(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g as the kernel addresses it: [d0, d1, K] for 2+ dims, flat otherwise (copied only if
    its strides cannot be expressed that way, e.g. a non-contiguous 3-D+ grad with mixed
    trailing strides)."""
    shape = (p.shape[0], p.shape[1], math.prod(p.shape[2:])) if p.dim() >= 2 else (p.numel(),)
    try:
        return g.view(shape)
    except RuntimeError:
        return g.contiguous().view(shape)
