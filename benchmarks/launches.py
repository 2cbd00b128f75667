"""Count the GPU kernel launches of an optimizer step: on meta tensors without a GPU, and the
Triton backend's own work (:class:`TritonLaunches`).

Run the step on ``meta`` tensors (shapes without data: no memory, no arithmetic) under
:class:`LaunchCounter`, a ``TorchDispatchMode`` that sees every aten op the step dispatches:

* an op that touches a meta tensor counts as one launch, except views and allocations
  (``empty*``, ``_unsafe_view``, ``detach``, ...), which launch nothing;
* a ``_foreach_*`` / ``_fused_*`` op counts the launches CUDA's ``multi_tensor_apply`` makes:
  chunks of 65,536 elements, at most 320 blocks and 110/64/48/36/30 tensors (for 1-5 tensor
  lists) per launch; ``_foreach_norm`` adds its clean-up kernel; lists whose tensors differ in
  dtype, shape or strides take the per-tensor slow path (one launch per tensor);
* ops on CPU tensors only (MERIT's step counters) are host work, not launches;
* ``.item()``-style reads of a meta tensor raise: a step that counts is free of host syncs.

It models torch's CUDA code as of 2.x; the figures are exact for what they count (ops and
chunks), not a timing.

The Triton backend launches its own kernels, which no dispatch mode sees: :class:`TritonLaunches`
counts them by wrapping the backend's launch points while it is open (the backend keeps no
counter of its own).
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import ExitStack
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CHUNK = 65536
MAX_BLOCKS = 320
MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_FREE = {"empty", "empty_like", "empty_strided", "_unsafe_view", "detach", "lift_fresh", "alias", "set_"}


def multi_tensor_apply_launches(numels: list[int], depth: int) -> int:
    """Launches of one multi_tensor_apply over tensors of these sizes with `depth` tensor lists."""
    max_tensors = MAX_TENSORS[min(max(depth, 1), 5)]
    launches = tensors = blocks = 0
    sizes = [n for n in numels if n]
    for k, n in enumerate(sizes):
        tensors += 1
        chunks = math.ceil(n / CHUNK)
        for c in range(chunks):
            blocks += 1
            last_chunk = c == chunks - 1
            if (tensors == max_tensors and last_chunk) or blocks == MAX_BLOCKS or (k == len(sizes) - 1 and last_chunk):
                launches += 1
                blocks = 0
                tensors = 0 if last_chunk else 1
    return launches


def _fast_route(lists: list[list[torch.Tensor]]) -> bool:
    first = lists[0]
    for other in lists[1:]:
        for a, b in zip(first, other):
            if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
                return False
    return all(t.is_contiguous() for lst in lists for t in lst)


class LaunchCounter(TorchDispatchMode):
    """Counts launches (``.launches``) and ops by name (``.ops``) of what runs inside it."""

    def __init__(self):
        super().__init__()
        self.launches = 0
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == "meta" for t in flat_in + flat_out)
        if not on_device or func.is_view or name in _FREE:
            return out
        if name.startswith(("_foreach_", "_fused_")):
            lists = [list(a) for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            lists = [lst for lst in lists if lst[0].device.type == "meta"]  # not the CPU step counters
            if not _fast_route(lists):
                n = len(lists[0])
            else:
                depth = len(lists) + (0 if name.endswith("_") or name == "_foreach_norm" else 1)
                n = multi_tensor_apply_launches([t.numel() for t in lists[0]], depth)
                n += 1 if name == "_foreach_norm" else 0
        else:
            n = 1
        self.launches += n
        self.ops[name] += n
        return out


def count_step_launches(make_step, shapes: list[tuple[int, ...]], dtype=torch.float32, steps: int = 2) -> int:
    """Launches of one steady-state step: ``make_step(params)`` returns a step function for
    these meta parameters (gradients set); the first steps create state and are not counted."""
    params = [torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    step = make_step(params)
    for _ in range(steps - 1):
        step()
    with LaunchCounter() as counter:
        step()
    return counter.launches


class _CountedKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) add to ``counts["kernels"]``."""

    def __init__(self, kernel, counts: dict):
        self.kernel, self.counts = kernel, counts

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counts["kernels"] += 1
            return launch(*args, **kwargs)

        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


class TritonLaunches:
    """While open, counts what the Triton backend issues: ``kernels`` (Triton launches and the
    fill of the column and tensor maxima), ``copies`` (host-to-device copies of tables, and grad
    copies it had to make) and ``rebuilds`` (pointer tables rebuilt). A steady step adds 3
    kernels, one more (the fill) with max-norm element-wise ratios, and two more when the list
    mixes vectorisable and other tensors (see ``TritonPlan``), and nothing else."""

    def __init__(self):
        self.counts = {"kernels": 0, "copies": 0, "rebuilds": 0}
        self._stack = ExitStack()

    def __enter__(self) -> TritonLaunches:
        from merit_core.optim.merit.triton import kernels, plan

        counts = self.counts
        for name in ("pass1_kernel", "finalize_kernel", "pass2_kernel"):
            self._stack.enter_context(mock.patch.object(kernels, name, _CountedKernel(getattr(kernels, name), counts)))
        to_device, grad_view = plan._to_device, plan._grad_view
        bind, clear = plan.TritonPlan.bind, plan.TritonPlan.clear_max_stats

        def counted_to_device(t, device):
            out = to_device(t, device)
            counts["copies"] += out is not t
            return out

        def counted_grad_view(p, g):
            out = grad_view(p, g)
            counts["copies"] += out.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
            return out

        def counted_bind(self_, *args, **kwargs):
            counts["rebuilds"] += 1
            return bind(self_, *args, **kwargs)

        def counted_clear(self_):
            counts["kernels"] += 1
            return clear(self_)

        patches = dict(_to_device=counted_to_device, _grad_view=counted_grad_view)
        for name, fn in patches.items():
            self._stack.enter_context(mock.patch.object(plan, name, fn))
        self._stack.enter_context(mock.patch.object(plan.TritonPlan, "bind", counted_bind))
        self._stack.enter_context(mock.patch.object(plan.TritonPlan, "clear_max_stats", counted_clear))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def take(self) -> dict[str, int]:
        """The counts since the last take (or since opening)."""
        out = dict(self.counts)
        for key in self.counts:
            self.counts[key] = 0
        return out
