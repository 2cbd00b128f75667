"""The Triton backend's kernels and the layout of the metadata table they read.

Each tensor of a plan has one row of ``META_WIDTH`` int64 fields in the metadata table; the
field numbers below are ``tl.constexpr`` globals, so that the kernels (``tl.load(row + ROWS)``)
and the host that fills the table (:mod:`~merit_core.optim.merit.triton.plan`, ``entry[ROWS]``)
read the same names. What each pass computes is said in the package's docstring
(:mod:`merit_core.optim.merit.triton`); the tile shape and finalize chunks are compile-time
switches (``BR``, ``BC``, ``FC``, ``FR``, ``FT``) the plan's :class:`~merit_core.optim.merit.triton.plan.Tiling` sets.

Importing this module imports triton (and decorates the kernels): under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is first imported) they run on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Fields of one tensor's row in the metadata table (int64).
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ = (tl.constexpr(n) for n in range(4))  # addresses
ROWS, COLS, LIMIT = (
    tl.constexpr(n) for n in range(4, 7)
)  # rows, columns, valid elements per matrix (R*C, or numel if flat)
P_ROW_STRIDE, P_COL_STRIDE, P_MAT_STRIDE = (
    tl.constexpr(n) for n in range(7, 10)
)  # element strides of param and moments
G_ROW_STRIDE, G_COL_STRIDE, G_MAT_STRIDE = (tl.constexpr(n) for n in range(10, 13))  # the same for the grad
FIRST_TILE, ROW_TILES, COL_TILES = (
    tl.constexpr(n) for n in range(13, 16)
)  # first tile; tiles per column, per row (of a matrix)
FIRST_ROW_SLOT, FIRST_COL_SLOT = tl.constexpr(16), tl.constexpr(17)  # first slot of this tensor's row / column norms
IS_MATRIX, PARAM_DTYPE, GRAD_DTYPE = (
    tl.constexpr(n) for n in range(18, 21)
)  # 1 for 2+ dims; dtype codes (DTYPE_CODES)
MATRICES = tl.constexpr(21)  # matrices in the tensor (product of the trailing dims; 1 for 1-D and 2-D)
META_WIDTH = tl.constexpr(24)  # int64 fields per row

# The dtypes the kernels load and store (the PARAM_DTYPE and GRAD_DTYPE fields hold these codes).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


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
def _tile(meta, tile_tensor, pid, BR: tl.constexpr, BC: tl.constexpr, ALIGNED: tl.constexpr):
    """Tile ``pid``'s tensor row in the table, its tile coordinates and element offsets.
    ALIGNED: the tensor is 1-D/2-D, its column count (and size) a multiple of 4 elements and
    its addresses 16-byte aligned, so that loads and stores can be vectorised."""
    t = tl.load(tile_tensor + pid)
    row = meta + t.to(tl.int64) * META_WIDTH
    n_rows = tl.load(row + ROWS)
    n_cols = tl.load(row + COLS)
    lim = tl.load(row + LIMIT)
    nrt = tl.load(row + ROW_TILES)
    nct = tl.load(row + COL_TILES)
    local = pid - tl.load(row + FIRST_TILE)
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
        p_offs = i[:, None] * tl.multiple_of(tl.load(row + P_ROW_STRIDE), 4) + j[None, :]
    else:
        p_offs = (
            i[:, None] * tl.load(row + P_ROW_STRIDE)
            + j[None, :] * tl.load(row + P_COL_STRIDE)
            + k * tl.load(row + P_MAT_STRIDE)
        )
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
def pass1_kernel(
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
        meta, tile_tensor, tl.program_id(0).to(tl.int64) + first_tile, BR, BC, ALIGNED
    )  # int64: offsets into the partials may pass 2**31
    if ALIGNED:
        g_offs = i[:, None] * tl.multiple_of(tl.load(row + G_ROW_STRIDE), 4) + j[None, :]
    else:
        g_offs = (
            i[:, None] * tl.load(row + G_ROW_STRIDE)
            + j[None, :] * tl.load(row + G_COL_STRIDE)
            + k * tl.load(row + G_MAT_STRIDE)
        )
    g = _load_f32(tl.load(row + GRAD), tl.load(row + GRAD_DTYPE), g_offs, mask, ALIGNED)
    if MAXIMIZE:
        g = -g
    m_ptr = tl.load(row + EXP_AVG).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + EXP_AVG_SQ).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    m = tl.load(m_ptr + p_offs, mask=mask, other=0.0) * beta1 + one_minus_beta1 * g
    v = tl.load(v_ptr + p_offs, mask=mask, other=0.0) * beta2 + one_minus_beta2 * g * g
    # Every load (w, the table's matrix flag, per-tensor bias corrections) comes before the
    # moments are stored: the compiler cannot tell that the stores miss what a later load
    # reads, so that load would wait for them (one more round trip to memory per tile).
    w = _load_f32(tl.load(row + PARAM), tl.load(row + PARAM_DTYPE), p_offs, mask, ALIGNED)
    is_matrix = tl.load(row + IS_MATRIX) != 0
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
def finalize_kernel(
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
    pid, t, row, k, rt, ct, i, j, mask, p_offs = _tile(meta, tile_tensor, pid, BR, BC, False)
    nrt = tl.load(row + ROW_TILES)
    nct = tl.load(row + COL_TILES)
    tile0 = tl.load(row + FIRST_TILE)
    if ROWCOL:
        if tl.load(row + IS_MATRIX) != 0:
            n_rows = tl.load(row + ROWS)
            n_cols = tl.load(row + COLS)
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
                slot = tl.load(row + FIRST_ROW_SLOT) + k * n_rows + i
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
                    slot = tl.load(row + FIRST_COL_SLOT) + k * n_cols + j
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
                slot = tl.load(row + FIRST_COL_SLOT) + k * n_cols + j
                tl.atomic_max(col_stats + slot, acc_w, mask=j < n_cols)
                tl.atomic_max(col_stats + total_cols + slot, acc_u, mask=j < n_cols)
                tl.atomic_max(tensor_stats + 2 * t, tl.max(acc_w, axis=0))
                tl.atomic_max(tensor_stats + 2 * t + 1, tl.max(acc_u, axis=0))
    whole = pid == tile0  # the whole tensor, over all its tiles
    if ROWCOL:
        if not L2:
            whole = whole & (tl.load(row + IS_MATRIX) == 0)  # a matrix's maxima came with its columns'
    if whole:
        q = tl.arange(0, FT)
        n_tiles = tl.load(row + MATRICES) * nrt * nct
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
def pass2_kernel(
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
        meta, tile_tensor, tl.program_id(0).to(tl.int64) + first_tile, BR, BC, ALIGNED
    )  # int64: offsets into the partials may pass 2**31
    m_ptr = tl.load(row + EXP_AVG).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + EXP_AVG_SQ).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    m = tl.load(m_ptr + p_offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + p_offs, mask=mask, other=0.0)
    w = _load_f32(tl.load(row + PARAM), tl.load(row + PARAM_DTYPE), p_offs, mask, ALIGNED)
    u = _direction(m, v, w, t, bc1, bc2, bcs, eps, wd, BIAS_CORRECTION, PER_TENSOR_BC)
    tw = tl.load(tensor_stats + 2 * t)
    tu = tl.load(tensor_stats + 2 * t + 1)
    poison = _not_finite(tw) | _not_finite(tu)  # the non-finite rule: NaN in every element
    b, _ = _ratio(tw, tu, L2)
    s = tl.zeros([BR, BC], dtype=tl.float32) + b
    if ROWCOL:
        if tl.load(row + IS_MATRIX) != 0:
            n_rows = tl.load(row + ROWS)
            n_cols = tl.load(row + COLS)
            rslot = tl.load(row + FIRST_ROW_SLOT) + k * n_rows + i
            cslot = tl.load(row + FIRST_COL_SLOT) + k * n_cols + j
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
    _store_from_f32(tl.load(row + PARAM), tl.load(row + PARAM_DTYPE), p_offs, new_w, mask, ALIGNED)
