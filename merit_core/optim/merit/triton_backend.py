"""A grouped Triton backend of MERIT: one step of all of a param group's tensors in 3 to 6 launches.

The math is exactly that of :func:`~merit_core.optim.merit.reference.reference_step`, in the
same order of fp32 operations (IEEE division and square root); only the schedule differs.
Every tensor is described as a batch of ``K`` matrices ``[R, C]`` (rows along dim 0, columns
along dim 1, ``K`` = the product of the trailing dims, each index of which is its own matrix
for the row and column norms, as the reference does); a tensor with fewer than 2 dims is laid out flat as rows of ``TILE_COLS``
elements and only its whole-tensor norm is used. Each matrix is cut into ``TILE_ROWS x
TILE_COLS`` tiles, and the tiles of all tensors form one launch grid:

1. ``pass 1`` (one program per tile): m <- b1*m + (1-b1)*g, v <- b2*v + (1-b2)*g^2 (stored),
   u from the new moments, then the tile's partial norms of |w| and |u|: one per row of the
   tile, one per column of the tile and one for the whole tile (maxima, or sums of squares for
   ``norm="l2"``), written to per-tile slots.
2. ``finalize`` (one program per tile that reduces something, listed in the plan): the first
   tile of each tile-row reduces its rows' partials over the column tiles; for "max" the first
   tile of each chunk of ``FIN_ROW_TILES`` row tiles reduces that chunk's column partials and
   combines them, and the chunk's tensor maximum, with the other chunks' by atomic max (exact
   in any order; the slots are zeroed first, by one fill launch), so a tall matrix such as an embedding has many
   column programs, not one per tile-column; for "l2" the first tile of each tile-column sums
   all its row tiles in order (deterministic), and the first tile of each tensor (of each 1-D
   tensor, for "max") the tile partials of the whole tensor. Results: one norm of
   |w| and of |u| per row of each matrix, per column of each matrix and per tensor (for "l2"
   still sums of squares, so that sharded callers can all-reduce them with SUM; pass 2 takes
   the square roots).
3. ``pass 2`` (one program per tile): recomputes u from m and v, builds s = max(r_i, c_j[, b]) (1 where a
   feeding norm is zero) or s = b, and writes w - lr * clamp(s*u, -clip, clip), rounded once to
   the parameter's dtype.

Passes 1 and 2 launch twice when vectorisable and other tensors are mixed (see
:class:`TritonPlan`), and with max-norm element-wise ratios (MERIT's default) one fill zeroes
the column and tensor norms before finalize: 3 to 6 launches per step, independent of the
number of tensors.

Per-tensor addresses, shapes and strides live in a small int64 table on the device, with a
tile -> tensor table. Both are cached per list of parameters and rebuilt when any data pointer
or grad stride changes (``zero_grad(set_to_none=True)`` reallocates grads). Nothing in a step
synchronises with the device: the step counters are CPU tensors read on the host, a float lr
is a runtime kernel argument, a device lr tensor is loaded inside pass 2 (so a changing lr
never recompiles anything).

Phases for sharded callers: :func:`plan_for` returns the cached :class:`TritonPlan` of a list of
tensors; ``plan.pass1(s)``, ``plan.finalize(s)`` and ``plan.pass2(s)`` (``s`` from
:func:`scalars`: the step's :class:`Scalars`, derived from the one hyperparameter record
:class:`~merit_core.optim.merit.common.Hyper`) run the launches, and between finalize and pass 2 a caller may combine
``plan.row_stats``, ``plan.col_stats`` and ``plan.tensor_stats`` across ranks (MAX for "max",
SUM for "l2").

Triton is imported when this module is; without it, :func:`is_available` is False and
:func:`merit_triton` raises RuntimeError. On CPU tensors it runs under Triton's interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before triton is first imported in the
process (triton's own library functions are decorated then), e.g. in a fresh subprocess.

The kernels write parameters and moments through raw addresses, as other Triton optimizers do:
autograd's version counters of these tensors are not bumped.

Non-finite values follow the rule of ``common.py``: pass 1 counts |NaN| as +inf in its max
partials (Triton's max, like the hardware's, drops NaN), so a tensor-wide norm of w or u is
infinite exactly when an entry is not finite (l2 sums propagate NaN/inf by themselves), and
pass 2 then writes NaN to every element of that tensor.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import torch

from merit_core.optim.merit.common import Hyper

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is not installed
    triton = None
    tl = None

# Tile and chunk sizes (read at each launch; tests shrink them to exercise many tiles). A
# finalize program reduces its partials in blocks of FIN_* tiles per iteration, so a tall
# matrix's columns take nrt / FIN_ROW_TILES programs ("max") or iterations of one ("l2").
TILE_ROWS = 32
TILE_COLS = 128
FIN_COL_TILES = 16  # column tiles per iteration when reducing a tile-row's row partials
FIN_ROW_TILES = 64  # row tiles per program ("max") / iteration ("l2") reducing column partials
FIN_TILES = 1024  # tiles per iteration when reducing a tensor's tile partials
NUM_WARPS = 8  # finalize
# Warps of a pass 1 / pass 2 program over vectorisable ("aligned") and other ("strided") tiles:
# for sm_90, the setting that keeps the most warps resident per SM with no register spilled
# (benchmarks/kernel_resources.py; its table is in benchmarks/README.md). Fewer warps per tile
# give each thread more elements and more registers, and fewer warps fit. Read at each launch,
# so that benchmarks/optimizer_step.py can time other settings in the same run.
PASS_WARPS = {"aligned": 16, "strided": 32}

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CACHE_SIZE = 16  # plans kept (one per distinct list of parameters, e.g. per param group)

# Fields of one tensor's row in the metadata table (int64).
_F_P, _F_G, _F_M, _F_V = 0, 1, 2, 3  # addresses of param, grad, exp_avg, exp_avg_sq
_F_R, _F_C, _F_LIM = 4, 5, 6  # rows, columns, valid elements per matrix (R*C, or numel if flat)
_F_PR, _F_PC, _F_PK = 7, 8, 9  # element strides of param/moments for row, column, matrix index
_F_GR, _F_GC, _F_GK = 10, 11, 12  # the same for the grad
_F_TILE0, _F_NRT, _F_NCT = 13, 14, 15  # first tile, tiles per column, tiles per row (per matrix)
_F_ROW0, _F_COL0 = 16, 17  # first slot of this tensor's row / column norms
_F_MAT, _F_PDT, _F_GDT = 18, 19, 20  # 1 for matrices (2+ dims), dtype codes of param and grad
_F_K = 21  # matrices in the tensor (product of the trailing dims; 1 for 1-D and 2-D)
NMETA = 24  # the kernels read these fields by their numbers above

_launches = {"kernels": 0, "copies": 0, "rebuilds": 0}


def is_available() -> bool:
    """Whether triton could be imported (a usable GPU, or the interpreter, is still needed)."""
    return triton is not None


def launch_counts() -> dict[str, int]:
    """Work this module has issued since import: ``kernels`` (Triton launches), ``copies``
    (host-to-device copies of tables and grad copies it had to make) and ``rebuilds`` (pointer
    tables rebuilt). A steady step adds 3 kernels, one more (a fill) with max-norm element-wise
    ratios, and two more when the list mixes vectorisable and other tensors (see
    :class:`TritonPlan`), and nothing else."""
    return dict(_launches)


class Scalars(NamedTuple):
    """One step's launch arguments: the group's record ``h`` and what :func:`scalars` resolves
    from it for this plan and step (the lr's form, the bias corrections)."""

    h: Hyper
    lr: float  # used when lr_tensor is None
    lr_tensor: torch.Tensor | None  # a 1-element tensor on the params' device, loaded in pass 2
    bc1: float  # used when bc_tensor is None
    bc2: float
    bc_tensor: torch.Tensor | None  # [T, 2] fp32 per-tensor bias corrections when steps differ


if triton is not None:

    @triton.jit
    def _load_f32(addr, dt, offs, mask, ALIGNED: tl.constexpr):
        # addr: an int64 address (16-byte aligned if ALIGNED); dt: 0 fp32, 1 bf16, 2 fp16.
        if dt == 0:
            p32 = addr.to(tl.pointer_type(tl.float32))
            if ALIGNED:
                p32 = tl.multiple_of(p32, 16)
            x = tl.load(p32 + offs, mask=mask, other=0.0)
        elif dt == 1:
            pbf = addr.to(tl.pointer_type(tl.bfloat16))
            if ALIGNED:
                pbf = tl.multiple_of(pbf, 16)
            x = tl.load(pbf + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            p16 = addr.to(tl.pointer_type(tl.float16))
            if ALIGNED:
                p16 = tl.multiple_of(p16, 16)
            x = tl.load(p16 + offs, mask=mask, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _store_from_f32(addr, dt, offs, x, mask, ALIGNED: tl.constexpr):
        if dt == 0:
            p32 = addr.to(tl.pointer_type(tl.float32))
            if ALIGNED:
                p32 = tl.multiple_of(p32, 16)
            tl.store(p32 + offs, x, mask=mask)
        elif dt == 1:
            pbf = addr.to(tl.pointer_type(tl.bfloat16))
            if ALIGNED:
                pbf = tl.multiple_of(pbf, 16)
            tl.store(pbf + offs, x.to(tl.bfloat16), mask=mask)
        else:
            p16 = addr.to(tl.pointer_type(tl.float16))
            if ALIGNED:
                p16 = tl.multiple_of(p16, 16)
            tl.store(p16 + offs, x.to(tl.float16), mask=mask)

    @triton.jit
    def _tile(meta, tile_tensor, pid, NM: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ALIGNED: tl.constexpr):
        """Tile ``pid``'s tensor row in the table, its tile coordinates and element offsets.
        ALIGNED: the tensor is 1-D/2-D, its column count (and size) a multiple of 4 elements and
        its addresses 16-byte aligned, so that loads and stores can be vectorised."""
        t = tl.load(tile_tensor + pid)
        row = meta + t.to(tl.int64) * NM
        n_rows = tl.load(row + 4)
        n_cols = tl.load(row + 5)
        lim = tl.load(row + 6)
        nrt = tl.load(row + 14)
        nct = tl.load(row + 15)
        local = pid - tl.load(row + 13)
        k = local // (nrt * nct)
        rem = local - k * (nrt * nct)
        rt = rem // nct
        ct = rem - rt * nct
        i = rt * BR + tl.arange(0, BR).to(tl.int64)
        j = ct * BC + tl.arange(0, BC).to(tl.int64)
        if ALIGNED:
            n_cols = tl.multiple_of(n_cols, 4)
            lim = tl.multiple_of(lim, 4)
        mask = (i[:, None] < n_rows) & (j[None, :] < n_cols) & ((i[:, None] * n_cols + j[None, :]) < lim)
        if ALIGNED:
            p_offs = i[:, None] * tl.multiple_of(tl.load(row + 7), 4) + j[None, :]
        else:
            p_offs = i[:, None] * tl.load(row + 7) + j[None, :] * tl.load(row + 8) + k * tl.load(row + 9)
        return pid, t, row, k, rt, ct, i, j, mask, p_offs

    @triton.jit
    def _direction(m, v, w, t, bc1, bc2, bcs, eps, wd, BIAS_CORRECTION: tl.constexpr, PER_TENSOR_BC: tl.constexpr):
        """u = m_hat / (sqrt(v_hat) + eps) + wd * w, in the reference's order of operations.
        Without bias correction m_hat = m / 1 = m exactly, so those two divisions are left out."""
        if BIAS_CORRECTION:
            if PER_TENSOR_BC:
                bc1 = tl.load(bcs + 2 * t)
                bc2 = tl.load(bcs + 2 * t + 1)
            m = tl.div_rn(m, bc1)
            v = tl.div_rn(v, bc2)
        return tl.div_rn(m, tl.sqrt_rn(v) + eps) + wd * w

    @triton.jit
    def _pass1_kernel(
        meta,
        tile_tensor,
        first_tile,
        row_part,
        col_part,
        tensor_part,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        bc1,
        bc2,
        bcs,
        eps,
        wd,
        NM: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
        MAXIMIZE: tl.constexpr,
        L2: tl.constexpr,
        ROWCOL: tl.constexpr,
        BIAS_CORRECTION: tl.constexpr,
        PER_TENSOR_BC: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        pid, t, row, k, rt, ct, i, j, mask, p_offs = _tile(
            meta, tile_tensor, tl.program_id(0).to(tl.int64) + first_tile, NM, BR, BC, ALIGNED
        )  # int64: offsets into the partials may pass 2**31
        if ALIGNED:
            g_offs = i[:, None] * tl.multiple_of(tl.load(row + 10), 4) + j[None, :]
        else:
            g_offs = i[:, None] * tl.load(row + 10) + j[None, :] * tl.load(row + 11) + k * tl.load(row + 12)
        g = _load_f32(tl.load(row + 1), tl.load(row + 20), g_offs, mask, ALIGNED)
        if MAXIMIZE:
            g = -g
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        m = tl.load(m_ptr + p_offs, mask=mask, other=0.0) * beta1 + one_minus_beta1 * g
        v = tl.load(v_ptr + p_offs, mask=mask, other=0.0) * beta2 + one_minus_beta2 * g * g
        # Every load (w, the table's matrix flag, per-tensor bias corrections) comes before the
        # moments are stored: the compiler cannot tell that the stores miss what a later load
        # reads, so that load would wait for them (one more round trip to memory per tile).
        w = _load_f32(tl.load(row + 0), tl.load(row + 19), p_offs, mask, ALIGNED)
        is_matrix = tl.load(row + 18) != 0
        u = _direction(m, v, w, t, bc1, bc2, bcs, eps, wd, BIAS_CORRECTION, PER_TENSOR_BC)
        tl.store(m_ptr + p_offs, m, mask=mask)
        tl.store(v_ptr + p_offs, v, mask=mask)
        if L2:
            sw = w * w
            su = u * u
            rw = tl.sum(sw, axis=1)
            ru = tl.sum(su, axis=1)
            tw = tl.sum(rw, axis=0)
            tu = tl.sum(ru, axis=0)
        else:  # |NaN| counts as +inf: Triton's max drops NaN (the non-finite rule, see the docstring)
            sw = tl.where(w == w, tl.abs(w), float("inf"))
            su = tl.where(u == u, tl.abs(u), float("inf"))
            rw = tl.max(sw, axis=1)
            ru = tl.max(su, axis=1)
            tw = tl.max(rw, axis=0)
            tu = tl.max(ru, axis=0)
        tl.store(tensor_part + 2 * pid, tw)
        tl.store(tensor_part + 2 * pid + 1, tu)
        if ROWCOL:
            if is_matrix:
                r = tl.arange(0, BR)
                c = tl.arange(0, BC)
                tl.store(row_part + pid * (2 * BR) + r, rw)
                tl.store(row_part + pid * (2 * BR) + BR + r, ru)
                if L2:
                    cw = tl.sum(sw, axis=0)
                    cu = tl.sum(su, axis=0)
                else:
                    cw = tl.max(sw, axis=0)
                    cu = tl.max(su, axis=0)
                tl.store(col_part + pid * (2 * BC) + c, cw)
                tl.store(col_part + pid * (2 * BC) + BC + c, cu)

    @triton.jit
    def _finalize_kernel(
        meta,
        tile_tensor,
        work,
        row_part,
        col_part,
        tensor_part,
        row_stats,
        col_stats,
        tensor_stats,
        total_rows,
        total_cols,
        NM: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
        FC: tl.constexpr,
        FR: tl.constexpr,
        FT: tl.constexpr,
        L2: tl.constexpr,
        ROWCOL: tl.constexpr,
    ):
        # only the tiles that reduce something run (the plan's list): the first of each tile-row,
        # of each chunk of FR row tiles of a tile-column, and of each tensor
        pid = tl.load(work + tl.program_id(0)).to(tl.int64)
        pid, t, row, k, rt, ct, i, j, mask, p_offs = _tile(meta, tile_tensor, pid, NM, BR, BC, False)
        nrt = tl.load(row + 14)
        nct = tl.load(row + 15)
        tile0 = tl.load(row + 13)
        if ROWCOL:
            if tl.load(row + 18) != 0:
                n_rows = tl.load(row + 4)
                n_cols = tl.load(row + 5)
                if ct == 0:  # this tile-row's rows, over all its column tiles
                    r = tl.arange(0, BR)
                    q = tl.arange(0, FC)
                    first = tile0 + (k * nrt + rt) * nct
                    acc_w = tl.zeros([BR], dtype=tl.float32)
                    acc_u = tl.zeros([BR], dtype=tl.float32)
                    for c0 in range(0, nct, FC):
                        sel = (r[:, None] < BR) & ((c0 + q)[None, :] < nct)
                        offs = (first + c0 + q)[None, :] * (2 * BR) + r[:, None]
                        xw = tl.load(row_part + offs, mask=sel, other=0.0)
                        xu = tl.load(row_part + offs + BR, mask=sel, other=0.0)
                        if L2:
                            acc_w += tl.sum(xw, axis=1)
                            acc_u += tl.sum(xu, axis=1)
                        else:
                            acc_w = tl.maximum(acc_w, tl.max(xw, axis=1))
                            acc_u = tl.maximum(acc_u, tl.max(xu, axis=1))
                    slot = tl.load(row + 16) + k * n_rows + i
                    tl.store(row_stats + slot, acc_w, mask=i < n_rows)
                    tl.store(row_stats + total_rows + slot, acc_u, mask=i < n_rows)
                if L2:
                    if rt == 0:  # this tile-column's columns, over all its row tiles, in order
                        c = tl.arange(0, BC)
                        q = tl.arange(0, FR)
                        first = tile0 + k * nrt * nct + ct
                        acc_w = tl.zeros([BC], dtype=tl.float32)
                        acc_u = tl.zeros([BC], dtype=tl.float32)
                        for r0 in range(0, nrt, FR):
                            sel = ((r0 + q)[:, None] < nrt) & (c[None, :] < BC)
                            offs = (first + (r0 + q) * nct)[:, None] * (2 * BC) + c[None, :]
                            acc_w += tl.sum(tl.load(col_part + offs, mask=sel, other=0.0), axis=0)
                            acc_u += tl.sum(tl.load(col_part + offs + BC, mask=sel, other=0.0), axis=0)
                        slot = tl.load(row + 17) + k * n_cols + j
                        tl.store(col_stats + slot, acc_w, mask=j < n_cols)
                        tl.store(col_stats + total_cols + slot, acc_u, mask=j < n_cols)
                elif rt % FR == 0:
                    # FR row tiles of this tile-column: its columns' maxima, and the tensor's,
                    # combined with the other chunks' by atomic max (order-free, so exact; the
                    # plan zeroed the slots). A tall matrix's columns take nrt / FR programs.
                    c = tl.arange(0, BC)
                    q = tl.arange(0, FR)
                    first = tile0 + (k * nrt + rt) * nct + ct
                    sel = ((rt + q)[:, None] < nrt) & (c[None, :] < BC)
                    offs = (first + q * nct)[:, None] * (2 * BC) + c[None, :]
                    acc_w = tl.max(tl.load(col_part + offs, mask=sel, other=0.0), axis=0)
                    acc_u = tl.max(tl.load(col_part + offs + BC, mask=sel, other=0.0), axis=0)
                    slot = tl.load(row + 17) + k * n_cols + j
                    tl.atomic_max(col_stats + slot, acc_w, mask=j < n_cols)
                    tl.atomic_max(col_stats + total_cols + slot, acc_u, mask=j < n_cols)
                    tl.atomic_max(tensor_stats + 2 * t, tl.max(acc_w, axis=0))
                    tl.atomic_max(tensor_stats + 2 * t + 1, tl.max(acc_u, axis=0))
        whole = pid == tile0  # the whole tensor, over all its tiles
        if ROWCOL:
            if not L2:
                whole = whole & (tl.load(row + 18) == 0)  # a matrix's maxima came with its columns'
        if whole:
            q = tl.arange(0, FT)
            n_tiles = tl.load(row + 21) * nrt * nct
            acc_w = tl.zeros([FT], dtype=tl.float32)
            acc_u = tl.zeros([FT], dtype=tl.float32)
            for q0 in range(0, n_tiles, FT):
                sel = (q0 + q) < n_tiles
                offs = (tile0 + q0 + q) * 2
                xw = tl.load(tensor_part + offs, mask=sel, other=0.0)
                xu = tl.load(tensor_part + offs + 1, mask=sel, other=0.0)
                if L2:
                    acc_w = acc_w + xw
                    acc_u = acc_u + xu
                else:
                    acc_w = tl.maximum(acc_w, xw)
                    acc_u = tl.maximum(acc_u, xu)
            if L2:
                tl.store(tensor_stats + 2 * t, tl.sum(acc_w, axis=0))
                tl.store(tensor_stats + 2 * t + 1, tl.sum(acc_u, axis=0))
            else:
                tl.store(tensor_stats + 2 * t, tl.max(acc_w, axis=0))
                tl.store(tensor_stats + 2 * t + 1, tl.max(acc_u, axis=0))

    @triton.jit
    def _not_finite(x):
        """NaN or +-inf (NaN compares false)."""
        return ~((x < float("inf")) & (x > -float("inf")))

    @triton.jit
    def _ratio(wn, un, L2: tl.constexpr):
        """(||w|| / ||u||, zero) where zero marks a zero norm (the ratio is then 1)."""
        if L2:
            wn = tl.sqrt_rn(wn)
            un = tl.sqrt_rn(un)
        zero = (wn == 0) | (un == 0)
        return tl.where(zero, 1.0, tl.div_rn(wn, tl.where(zero, 1.0, un))), zero

    @triton.jit
    def _pass2_kernel(
        meta,
        tile_tensor,
        first_tile,
        row_stats,
        col_stats,
        tensor_stats,
        total_rows,
        total_cols,
        lr,
        lr_ptr,
        bc1,
        bc2,
        bcs,
        eps,
        wd,
        clip,
        NM: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
        L2: tl.constexpr,
        ROWCOL: tl.constexpr,
        BOUND: tl.constexpr,
        CLIP: tl.constexpr,
        LR_PTR: tl.constexpr,
        BIAS_CORRECTION: tl.constexpr,
        PER_TENSOR_BC: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        pid, t, row, k, rt, ct, i, j, mask, p_offs = _tile(
            meta, tile_tensor, tl.program_id(0).to(tl.int64) + first_tile, NM, BR, BC, ALIGNED
        )  # int64: offsets into the partials may pass 2**31
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        m = tl.load(m_ptr + p_offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + p_offs, mask=mask, other=0.0)
        w = _load_f32(tl.load(row + 0), tl.load(row + 19), p_offs, mask, ALIGNED)
        u = _direction(m, v, w, t, bc1, bc2, bcs, eps, wd, BIAS_CORRECTION, PER_TENSOR_BC)
        tw = tl.load(tensor_stats + 2 * t)
        tu = tl.load(tensor_stats + 2 * t + 1)
        poison = _not_finite(tw) | _not_finite(tu)  # the non-finite rule: NaN in every element
        b, _ = _ratio(tw, tu, L2)
        s = tl.zeros([BR, BC], dtype=tl.float32) + b
        if ROWCOL:
            if tl.load(row + 18) != 0:
                n_rows = tl.load(row + 4)
                n_cols = tl.load(row + 5)
                rslot = tl.load(row + 16) + k * n_rows + i
                cslot = tl.load(row + 17) + k * n_cols + j
                rmask = i < n_rows
                cmask = j < n_cols
                rr, rz = _ratio(
                    tl.load(row_stats + rslot, mask=rmask, other=0.0),
                    tl.load(row_stats + total_rows + rslot, mask=rmask, other=0.0),
                    L2,
                )
                cr, cz = _ratio(
                    tl.load(col_stats + cslot, mask=cmask, other=0.0),
                    tl.load(col_stats + total_cols + cslot, mask=cmask, other=0.0),
                    L2,
                )
                s = tl.maximum(rr[:, None], cr[None, :])
                if BOUND:
                    s = tl.maximum(s, b)
                s = tl.where(rz[:, None] | cz[None, :], 1.0, s)
        d = s * u
        if CLIP:
            d = tl.minimum(tl.maximum(d, -clip), clip)
        if LR_PTR:
            lr = tl.load(lr_ptr).to(tl.float32)
        new_w = tl.where(poison, float("nan"), w - lr * d)
        _store_from_f32(tl.load(row + 0), tl.load(row + 19), p_offs, new_w, mask, ALIGNED)


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

    def __init__(self, params, device: torch.device):
        self.device = device
        nonempty = [n for n, p in enumerate(params) if p.numel() > 0]
        vec = [n for n in nonempty if _vectorisable(params[n])]
        self.index = vec + [n for n in nonempty if n not in set(vec)]  # their tiles come first
        self.n_vec = len(vec)
        self.row_offset, self.col_offset, static, tile_tensor, work = [], [], [], [], []
        self.fin_row_tiles = FIN_ROW_TILES  # the finalize's column chunks, fixed with its work list
        rows = cols = tiles = 0
        for n in self.index:
            p = params[n]
            if p.dim() >= 2:
                n_rows, n_cols, k_mats = p.shape[0], p.shape[1], math.prod(p.shape[2:])
                lim, strides, is_mat = n_rows * n_cols, (n_cols * k_mats, k_mats, 1), 1
            else:
                n_cols, k_mats = TILE_COLS, 1
                n_rows = -(-p.numel() // n_cols)
                lim, strides, is_mat = p.numel(), (n_cols, 1, 0), 0
            nrt, nct = -(-n_rows // TILE_ROWS), -(-n_cols // TILE_COLS)
            entry = [0] * NMETA
            entry[_F_R], entry[_F_C], entry[_F_LIM] = n_rows, n_cols, lim
            entry[_F_PR], entry[_F_PC], entry[_F_PK] = strides
            entry[_F_TILE0], entry[_F_NRT], entry[_F_NCT] = tiles, nrt, nct
            entry[_F_ROW0], entry[_F_COL0], entry[_F_MAT] = rows, cols, is_mat
            entry[_F_PDT], entry[_F_K] = _DTYPE_CODES[p.dtype], k_mats
            static.append(entry)
            self.row_offset.append(rows)
            self.col_offset.append(cols)
            n_tiles = k_mats * nrt * nct
            tile_tensor += [len(static) - 1] * n_tiles
            local = torch.arange(n_tiles)
            rem = local % (nrt * nct)
            rt = rem // nct  # row tiles that start a chunk reduce columns (see the finalize kernel)
            reduces = (local == 0) | (bool(is_mat) & ((rem % nct == 0) | (rt % self.fin_row_tiles == 0)))
            work.append(local[reduces] + tiles)
            tiles += n_tiles
            if len(static) == self.n_vec:
                self.n_vec_tiles = tiles
            if is_mat:
                rows += k_mats * n_rows
                cols += k_mats * n_cols
        self.static, self.n_tiles, self.total_rows, self.total_cols = static, tiles, max(rows, 1), max(cols, 1)
        f32 = dict(device=device, dtype=torch.float32)
        self.tile_tensor = _to_device(torch.tensor(tile_tensor, dtype=torch.int32), device)
        # the tiles finalize runs: the first of each tile-row and of each chunk of fin_row_tiles
        # row tiles of a tile-column of each matrix, and the first of each tensor (the others
        # have nothing to reduce; a launch over all tiles would start and end that many idle
        # programs)
        work = torch.cat(work) if work else torch.zeros(0, dtype=torch.int64)
        self.finalize_tiles = _to_device(work.to(torch.int32), device)
        self.row_part = torch.empty(max(tiles, 1) * 2 * TILE_ROWS, **f32)
        self.col_part = torch.empty(max(tiles, 1) * 2 * TILE_COLS, **f32)
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
        self.pointer_key = None
        self.meta = None
        self.aligned = False  # whether the vectorised kernels may take the first n_vec_tiles tiles
        self._keep = None  # grad copies the table points at (grads that could not be viewed)

    def bind(self, grads, exp_avgs, exp_avg_sqs, params, pointer_key) -> None:
        """(Re)build the device table with the current addresses and grad strides."""
        table, keep = [], []
        aligned = True
        for pos, (entry, n) in enumerate(zip(self.static, self.index)):
            g = _grad_view(params[n], grads[n])
            if g.data_ptr() != grads[n].data_ptr() or g.storage_offset() != grads[n].storage_offset():
                keep.append(g)
            entry = list(entry)
            entry[_F_P], entry[_F_M], entry[_F_V] = (
                params[n].data_ptr(),
                exp_avgs[n].data_ptr(),
                exp_avg_sqs[n].data_ptr(),
            )
            entry[_F_G], entry[_F_GDT] = g.data_ptr(), _DTYPE_CODES[g.dtype]
            if params[n].dim() >= 2:
                entry[_F_GR], entry[_F_GC], entry[_F_GK] = g.stride()
            else:
                entry[_F_GR], entry[_F_GC], entry[_F_GK] = TILE_COLS * g.stride(0), g.stride(0), 0
            if pos < self.n_vec:
                addresses = (entry[_F_G], entry[_F_M], entry[_F_V])
                aligned &= entry[_F_GC] == 1 and entry[_F_GR] % 4 == 0 and all(a % 16 == 0 for a in addresses)
            table.append(entry)
        self.aligned = aligned
        self.meta = _to_device(torch.tensor(table or [[0] * NMETA], dtype=torch.int64), self.device)
        self._keep = keep
        # A copied grad must be copied again next step: leave the key unset so the table is rebuilt.
        self.pointer_key = None if keep else pointer_key
        _launches["rebuilds"] += 1

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
        _pass1_kernel[(count,)](
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
            **tile_constexprs(),
            MAXIMIZE=s.h.maximize,
            L2=s.h.norm == "l2",
            ROWCOL=s.h.elementwise,
            BIAS_CORRECTION=s.h.bias_correction,
            PER_TENSOR_BC=s.bc_tensor is not None,
            **launch_options(aligned),
        )
        _launches["kernels"] += 1

    def finalize(self, s: Scalars) -> None:
        """Reduce the partials into ``row_stats``, ``col_stats`` and ``tensor_stats``."""
        if s.h.norm == "max" and s.h.elementwise:  # the column chunks' atomic maxima start at 0
            self._max_stats.zero_()
            _launches["kernels"] += 1
        _finalize_kernel[(self.finalize_tiles.numel(),)](
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
            **tile_constexprs(),
            FC=FIN_COL_TILES,
            FR=self.fin_row_tiles,
            FT=FIN_TILES,
            L2=s.h.norm == "l2",
            ROWCOL=s.h.elementwise,
            num_warps=NUM_WARPS,
        )
        _launches["kernels"] += 1

    def pass2(self, s: Scalars) -> None:
        """Recompute u and apply w <- w - lr * clamp(s*u)."""
        bc = s.bc_tensor if s.bc_tensor is not None else self.tensor_stats
        lr_t = s.lr_tensor if s.lr_tensor is not None else self.tensor_stats
        for first, count, aligned in self._segments():
            self._pass2(s, bc, lr_t, first, count, aligned)

    def _pass2(self, s: Scalars, bc, lr_t, first: int, count: int, aligned: bool) -> None:
        _pass2_kernel[(count,)](
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
            **tile_constexprs(),
            L2=s.h.norm == "l2",
            ROWCOL=s.h.elementwise,
            BOUND=s.h.weight_bound,
            CLIP=s.h.clip is not None,
            LR_PTR=s.lr_tensor is not None,
            BIAS_CORRECTION=s.h.bias_correction,
            PER_TENSOR_BC=s.bc_tensor is not None,
            **launch_options(aligned),
        )
        _launches["kernels"] += 1


_plans: OrderedDict = OrderedDict()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built table on the device without a blocking copy (pinned memory, non_blocking)."""
    if device.type == "cpu":
        return t
    _launches["copies"] += 1
    return t.pin_memory().to(device, non_blocking=True)


def tile_constexprs() -> dict:
    """The table width and tile shape every kernel is compiled for (``NM``, ``BR``, ``BC``),
    read at each launch."""
    return dict(NM=NMETA, BR=TILE_ROWS, BC=TILE_COLS)


def launch_options(aligned: bool) -> dict:
    """The ``ALIGNED`` switch and ``num_warps`` of a pass 1 / pass 2 launch over vectorisable
    (``aligned``) or other tiles (see :data:`PASS_WARPS`)."""
    return dict(ALIGNED=aligned, num_warps=PASS_WARPS["aligned" if aligned else "strided"])


def _vectorisable(p: torch.Tensor) -> bool:
    """1-D/2-D, a whole number of 4-element groups per row and 16-byte aligned (the grad and
    moments are checked when the table is built)."""
    per_row = p.shape[1] if p.dim() == 2 else TILE_COLS
    return p.dim() <= 2 and p.numel() % 4 == 0 and per_row % 4 == 0 and p.data_ptr() % 16 == 0


def _grad_view(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g as the kernel addresses it: [d0, d1, K] for 2+ dims, flat otherwise (copied only if
    its strides cannot be expressed that way, e.g. a non-contiguous 3-D+ grad with mixed
    trailing strides)."""
    shape = (p.shape[0], p.shape[1], math.prod(p.shape[2:])) if p.dim() >= 2 else (p.numel(),)
    try:
        return g.view(shape)
    except RuntimeError:
        _launches["copies"] += 1
        return g.contiguous().view(shape)


def _check(params, grads, exp_avgs, exp_avg_sqs) -> torch.device:
    device = params[0].device
    for n, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        where = f" (tensor {n} of the group, shape {tuple(p.shape)})"
        if p.dtype not in _DTYPE_CODES:
            raise ValueError(
                f"merit_triton: parameters must be float32, bfloat16 or float16, got {p.dtype}{where}; "
                "Triton has no fast float64 path, use another MERIT backend for float64"
            )
        if g.dtype not in _DTYPE_CODES:
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


def plan_for(params, grads, exp_avgs, exp_avg_sqs) -> TritonPlan:
    """The cached plan of these tensors, its pointer table rebuilt if any address changed."""
    param_key, pointer_key = [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        param_key.append((p.data_ptr(), p.shape, p.dtype))
        pointer_key.append((g.data_ptr(), g.stride(), g.dtype, g.shape, m.data_ptr(), v.data_ptr()))
    param_key, pointer_key = (params[0].device, *param_key), tuple(pointer_key)
    plan = _plans.get(param_key)
    if plan is not None and plan.pointer_key == pointer_key:
        _plans.move_to_end(param_key)
        return plan
    device = _check(params, grads, exp_avgs, exp_avg_sqs)
    if plan is None:
        plan = TritonPlan(params, device)
        _plans[param_key] = plan
        while len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    plan.bind(grads, exp_avgs, exp_avg_sqs, params, pointer_key)
    return plan


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


def merit_triton(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    """One MERIT step of all given tensors in place, in three Triton launches (pass 1,
    finalize, pass 2). ``state_steps`` are CPU scalar tensors already incremented by the caller
    (read only, for the bias correction); ``h.lr`` is a float or a one-element tensor."""
    if triton is None:
        raise RuntimeError("merit_triton: triton is not installed")
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(state_steps)):
        raise ValueError("merit_triton: params, grads, exp_avgs, exp_avg_sqs and state_steps differ in length")
    if not params:
        return
    plan = plan_for(params, grads, exp_avgs, exp_avg_sqs)
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
