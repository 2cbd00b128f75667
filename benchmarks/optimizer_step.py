"""Time one optimizer step on GPT-2 small's parameter shapes: every MERIT path against AdamW
(fused and foreach), pytorch-optimizer's Lamb and a literal per-parameter MERIT, in one run.

    python benchmarks/optimizer_step.py                  # GPT-2 small, 124M params, all threads
    python benchmarks/optimizer_step.py --threads 1 --steps 9
    python benchmarks/optimizer_step.py --small          # tiny shapes: a quick smoke run
    python benchmarks/optimizer_step.py --compile        # also the torch.compile path (cold: ~1 min)

Gradients are random (fixed per run). Each optimizer gets `--warmup` untimed steps, then the
median of `--steps` timed steps is reported with its ratio to AdamW(fused=True). Optimizers run
one after another (only one set of optimizer state is alive at a time); AdamW(fused=True) is
timed first and last and the mean is the baseline, so drift on a shared machine shows. Last,
AdamW(fused=True) and the default MERIT() step alternately, and the median of the per-round
ratios is printed: the number to trust when the machine is shared.

Extra memory of a step is measured after all timings: glibc is told to serve every allocation
of 64 KiB or more with its own mmap (mallopt), so each temporary is resident while alive and
unmapped when freed; the growth of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) over the resident set before the step then counts every temporary,
whichever allocator made it, the C++ kernel's row/column buffers included. Linux/glibc only;
left blank elsewhere.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from merit_core.optim.merit import MERIT  # noqa: E402
from merit_core.optim.merit import cpu as merit_kernels  # noqa: E402


def gpt2_shapes(n_layer=12, d=768, vocab=50257, ctx=1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 LM (HF layout: Conv1D weights are [in, out]; head tied)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def literal_merit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, wd=0.0):
    """MERIT written the obvious way, one parameter at a time with plain torch ops."""
    state = {}

    def step():
        with torch.no_grad():
            for w in params:
                g = w.grad
                m, v = state.setdefault(w, (torch.zeros_like(w), torch.zeros_like(w)))
                m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                u = m / (v.sqrt() + eps) + wd * w
                aw, au = w.abs(), u.abs()
                if w.ndim >= 2:
                    rw, ru = aw.amax(1, keepdim=True), au.amax(1, keepdim=True)
                    cw, cu = aw.amax(0, keepdim=True), au.amax(0, keepdim=True)
                    s = torch.maximum(torch.maximum(rw / ru, cw / cu), aw.amax() / au.amax())
                    s = torch.where((rw == 0) | (ru == 0) | (cw == 0) | (cu == 0), torch.ones_like(s), s)
                else:
                    bw, bu = aw.amax(), au.amax()
                    s = torch.where((bw == 0) | (bu == 0), torch.ones_like(bw), bw / bu)
                w.sub_((s * u).clamp_(-1, 1), alpha=lr)

    return step


def _absmax(x, dim=None):
    if dim is None:
        return torch.maximum(x.amax(), -x.amin())
    return torch.maximum(x.amax(dim, keepdim=True), -x.amin(dim, keepdim=True))


def foreach_merit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6):
    """A multi-tensor sketch: moments and u for all parameters with torch._foreach_* ops (u is
    materialized for every parameter at once), then the per-tensor ratios. Benchmark only: it
    shows what the foreach route costs on this machine."""
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]

    def step():
        with torch.no_grad():
            gs = [p.grad for p in params]
            torch._foreach_lerp_(ms, gs, 1 - betas[0])
            torch._foreach_mul_(vs, betas[1])
            torch._foreach_addcmul_(vs, gs, gs, value=1 - betas[1])
            us = torch._foreach_sqrt(vs)
            torch._foreach_add_(us, eps)
            torch._foreach_div_(us, ms)
            torch._foreach_reciprocal_(us)  # u = m / (sqrt(v) + eps)
            for w, u in zip(params, us):
                bw, bu = _absmax(w), _absmax(u)
                b = torch.where((bw == 0) | (bu == 0), torch.ones_like(bw), bw / bu)
                if w.ndim >= 2:
                    rw, ru, cw, cu = _absmax(w, 1), _absmax(u, 1), _absmax(w, 0), _absmax(u, 0)
                    s = torch.maximum(torch.maximum(rw / ru, cw / cu), b)
                    u.mul_(torch.where((rw == 0) | (ru == 0) | (cw == 0) | (cu == 0), torch.ones_like(s), s))
                else:
                    u.mul_(b)
            torch._foreach_clamp_min_(us, -1.0)
            torch._foreach_clamp_max_(us, 1.0)
            torch._foreach_add_(params, us, alpha=-lr)

    return step


def _rss_now() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return None


def exact_malloc_accounting() -> bool:
    """Make glibc mmap (and on free, unmap) every allocation >= 64 KiB, so RSS tracks live bytes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 16)) and bool(libc.mallopt(m_trim_threshold, 1 << 16))
    except (OSError, AttributeError, TypeError):
        return False


def extra_memory(step) -> int | None:
    """Peak resident bytes during step() above the resident bytes before it."""
    try:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _rss_now()
        step()
        with open("/proc/self/status") as f:
            hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
        return max(0, hwm - before)
    except (OSError, StopIteration, TypeError):
        return None


def time_steps(step, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds of the first step, median seconds of the timed steps)."""
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def head_to_head(params, rounds: int, warmup: int) -> tuple[float, float, float]:
    """AdamW(fused=True) and MERIT() stepping alternately: (median AdamW s, median MERIT s,
    median of the per-round ratios). Robust to load that changes during the run."""
    adamw, merit = torch.optim.AdamW(params, lr=1e-3, fused=True), MERIT(params)
    for _ in range(warmup):
        adamw.step()
        merit.step()
    ta, tm = [], []
    for _ in range(rounds):
        for opt, times in ((adamw, ta), (merit, tm)):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tm), statistics.median(m / a for a, m in zip(ta, tm))


def candidates(params, args):
    from pytorch_optimizer import Lamb

    out = [("AdamW(fused=True)", lambda: torch.optim.AdamW(params, lr=1e-3, fused=True).step)]
    out += [
        ("AdamW(foreach=True)", lambda: torch.optim.AdamW(params, lr=1e-3, foreach=True).step),
        ("pytorch_optimizer.Lamb", lambda: Lamb(params, lr=1e-3).step),
        ("literal per-parameter MERIT", lambda: literal_merit(params)),
        ("foreach MERIT sketch", lambda: foreach_merit(params)),
    ]
    out += [("MERIT() default", lambda: MERIT(params).step)]
    impls = ["reference", "foreach", "cpu"] + (["compile"] if args.compile else [])
    out += [(f"MERIT(implementation={i!r})", lambda i=i: MERIT(params, implementation=i).step) for i in impls]
    return out + [("AdamW(fused=True) again", out[0][1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch / OpenMP threads")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (state init, compilation)")
    ap.add_argument("--small", action="store_true", help="a 2-layer, 64-wide GPT-2 instead of GPT-2 small")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time implementation='compile' (its first step compiles: ~40 s cold)",
    )
    ap.add_argument("--only", default="", help="comma-separated substrings: time only matching optimizers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = gpt2_shapes(2, 64, 512, 128) if args.small else gpt2_shapes()
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    numel = sum(p.numel() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    t0 = time.perf_counter()
    merit_kernels.load_kernel()
    info = merit_kernels.kernel_info()
    kernel = (
        (f"built in {info['build_s']:.1f} s" if info["build_s"] is not None else "loaded from cache")
        if info["available"]
        else f"unavailable: {info['error']}"
    )
    print(
        f"{len(shapes)} tensors, {numel / 1e6:.1f}M params, {args.threads} threads, "
        f"torch {torch.__version__}; C++ kernel {kernel} ({time.perf_counter() - t0:.1f} s)"
    )

    rows = []
    only = [s for s in args.only.split(",") if s]
    chosen = [
        (n, mk)
        for n, mk in candidates(params, args)
        if not only or any(s in n for s in only) or n.startswith("AdamW(fused=True)")
    ]
    for name, make in chosen:
        step = make()
        first, med = time_steps(step, args.warmup, args.steps)
        rows.append([name, first, med, None])
        del step
        gc.collect()
    if exact_malloc_accounting():
        for row, (name, make) in zip(rows, chosen):
            if "MERIT" in name or name == "AdamW(fused=True)":
                step = make()
                step()  # state is created on the first step; measure the second
                row[3] = extra_memory(step)
                del step
                gc.collect()

    base = statistics.mean(r[2] for r in rows if r[0].startswith("AdamW(fused=True)"))
    print(f"\n{'optimizer':34} {'first step':>11} {'median step':>12} {'x fused AdamW':>14} {'extra memory':>22}")
    for name, first, med, extra in rows:
        mem = "" if extra is None else f"{extra / 2**20:8.1f} MiB = {extra / largest:4.2f}x"
        print(f"{name:34} {first:10.3f}s {med:11.3f}s {med / base:13.2f}x {mem:>22}")
    a, m, r = head_to_head(params, max(args.steps, 5), args.warmup)
    print(f"\nhead to head, alternating steps: AdamW(fused=True) {a:.3f} s, MERIT() {m:.3f} s, median ratio {r:.2f}x")
    biggest = max(shapes, key=lambda s: torch.Size(s).numel())
    print(
        f"\nbaseline AdamW(fused=True): {base:.3f} s (mean of first and last run); largest parameter: "
        f"{tuple(biggest)} = {largest / 2**20:.1f} MiB. Extra memory: peak RSS growth during one "
        "step with every allocation >= 64 KiB mmapped."
    )


if __name__ == "__main__":
    main()
