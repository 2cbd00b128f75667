"""A grouped Triton backend of MERIT: one step of all of a param group's tensors in 3 to 6 launches.

:mod:`.kernels` holds the kernels and the layout of the metadata table they read, :mod:`.plan`
the per-list plan (tables, tile lists, scratch buffers, the launches of each phase, for a
:class:`~.plan.Tiling`), :mod:`.step` the backend step :func:`~.step.merit_triton` and the plan cache.

The math is exactly that of :func:`~merit_core.optim.merit.reference.reference_step`, in the
same order of fp32 operations (IEEE division and square root); only the schedule differs.
Every tensor is described as a batch of ``K`` matrices ``[R, C]`` (rows along dim 0, columns
along dim 1, ``K`` = the product of the trailing dims, each index of which is its own matrix
for the row and column norms, as the reference does); a tensor with fewer than 2 dims is laid
out flat as rows of ``Tiling.cols`` elements and only its whole-tensor norm is used. Each matrix
is cut into ``Tiling.rows x Tiling.cols`` tiles, and the tiles of all tensors form one launch grid:

1. ``pass 1`` (one program per tile): m <- b1*m + (1-b1)*g, v <- b2*v + (1-b2)*g^2 (stored),
   u from the new moments, then the tile's partial norms of |w| and |u|: one per row of the
   tile, one per column of the tile and one for the whole tile (maxima, or sums of squares for
   ``norm="l2"``), written to per-tile slots.
2. ``finalize`` (one program per tile that reduces something, listed in the plan): the first
   tile of each tile-row reduces its rows' partials over the column tiles; for "max" the first
   tile of each chunk of ``Tiling.fin_row_tiles`` row tiles reduces that chunk's column partials and
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
:class:`~.plan.TritonPlan`), and with max-norm element-wise ratios (MERIT's default) one fill zeroes
the column and tensor norms before finalize: 3 to 6 launches per step, independent of the
number of tensors.

Per-tensor addresses, shapes and strides live in a small int64 table on the device, with a
tile -> tensor table. Both are cached per list of parameters and rebuilt when any data pointer
or grad stride changes (``zero_grad(set_to_none=True)`` reallocates grads). Nothing in a step
synchronises with the device: the step counters are CPU tensors read on the host, a float lr
is a runtime kernel argument, a device lr tensor is loaded inside pass 2 (so a changing lr
never recompiles anything).

Phases for sharded callers: :func:`~.step.plan_for` returns the cached :class:`~.plan.TritonPlan` of a
list of tensors; ``plan.pass1(s)``, ``plan.finalize(s)`` and ``plan.pass2(s)`` (``s`` from
:func:`~.plan.scalars`: the step's :class:`~.plan.Scalars`, derived from the one hyperparameter record
:class:`~merit_core.optim.merit.common.Hyper`) run the launches, and between finalize and pass 2 a caller may combine
``plan.row_stats``, ``plan.col_stats`` and ``plan.tensor_stats`` across ranks (MAX for "max",
SUM for "l2").

Importing :mod:`.kernels` (and so :mod:`.plan` and :mod:`.step`) imports triton; this package's
``__init__`` does not, so that it can be read without triton. On CPU tensors it runs under Triton's interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before triton is first imported in the
process (triton's own library functions are decorated then), e.g. in a fresh subprocess.

The kernels write parameters and moments through raw addresses, as other Triton optimizers do:
autograd's version counters of these tensors are not bumped.

Non-finite values follow the rule of ``merit/common.py``: pass 1 counts |NaN| as +inf in its max
partials (Triton's max, like the hardware's, drops NaN), so a tensor-wide norm of w or u is
infinite exactly when an entry is not finite (l2 sums propagate NaN/inf by themselves), and
pass 2 then writes NaN to every element of that tensor.
"""
