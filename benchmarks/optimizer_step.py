"""Time one optimizer step on real model shapes: AdamW (fused, foreach) and every MERIT backend
available on the device, in one run, with launches per step and the memory-traffic floor.

    python benchmarks/optimizer_step.py                          # CPU: GPT-2 small, fp32 and bf16
    python benchmarks/optimizer_step.py --device cuda            # CUDA: GPT-2 small, Llama-1B, Llama-3.2-1B
    python benchmarks/optimizer_step.py --models tiny --steps 1  # a quick smoke run
    python benchmarks/optimizer_step.py --device cuda --compile  # also the opt-in compile backend

Shapes: GPT-2 small (124M params, 148 tensors; HF layout, Conv1D weights [in, out], head tied),
Llama-1B (24 layers, 2048 wide, 32 heads, MLP 5461 (an unaligned width), vocab 32000, head
untied; nn.Linear [out, in]), Llama-3.2-1B (16 layers, 2048 wide, MLP 8192, GQA with 8 of 32
heads for k/v (k/v projections 512 x 2048), vocab 128256, head tied) and "tiny" (a 2-layer,
64-wide GPT-2). Gradients are random and fixed. Each
optimizer gets `--warmup` untimed steps (state creation, kernel builds, compilation), then
`--steps` timed steps; the median is reported (CUDA: torch.cuda.Event around each step, after a
synchronize; CPU: wall clock). Optimizers run one after another, so only one set of state is
alive at a time; AdamW(fused=True) runs first and last and the mean is the baseline of the
ratios, so drift during the run shows. On CUDA, the Triton backend also runs with the warps per
program it used before (``PREVIOUS_PASS_WARPS``), next to its current ones (``Tiling``).

Columns:
  launches   GPU kernel launches per step, counted on meta tensors by
             benchmarks/launches.py (foreach/reference paths and AdamW foreach; the fused
             AdamW figure is the multi_tensor_apply model of its one kernel), or counted at the
             Triton backend's launch points (``TritonLaunches``) for one step; "-" where the path
             cannot be counted either way (C++ kernel, compiled).
  floor ms   bytes the update must move at least, over the device's memory bandwidth: AdamW
             reads g, w, m, v and writes w, m, v (7 tensors); MERIT's two passes read g, w, m, v
             and write m, v, then read w, m, v and write w (10), with fp32 moments for bf16
             parameters (AdamW keeps its moments in the parameter's dtype): 40 B per fp32
             parameter, 32 B per bf16 one. The bandwidth is measured by a large device-to-device
             copy (CUDA) or memory copy (CPU) in this run.
  % floor    floor ms / measured ms.
  floor1 ms  the same with each weight read once per step (pass 1 without w: 36 B per fp32
             parameter, 30 B per bf16 one). It applies with weight_decay = 0 only (the
             benchmark's MERIT() default): with decay, u = m / (sqrt(v) + eps) + wd*w needs w in
             pass 1 for the maxima of |u|. For AdamW it equals floor ms.
  % floor1   floor1 ms / measured ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.launches import TritonLaunches, count_step_launches, multi_tensor_apply_launches  # noqa: E402
from merit_core.optim.merit import MERIT  # noqa: E402
from merit_core.optim.merit.functional import BACKENDS, choose  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gpt2_shapes(n_layer=12, d=768, vocab=50257, ctx=1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 LM (HF layout: Conv1D weights are [in, out]; head tied)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def llama_shapes(n_layer=24, d=2048, mlp=5461, vocab=32000, kv_dim=None, tied=False) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama LM (nn.Linear [out, in]; no biases; head untied unless ``tied``)."""
    kv_dim = kv_dim or d
    shapes = [(vocab, d)]
    for _ in range(n_layer):
        shapes += [(d, d), (kv_dim, d), (kv_dim, d), (d, d), (mlp, d), (mlp, d), (d, mlp), (d,), (d,)]
    return shapes + [(d,)] + ([] if tied else [(vocab, d)])


MODELS = {
    "gpt2-small": gpt2_shapes,
    "llama-1b": llama_shapes,
    "llama-3.2-1b": lambda: llama_shapes(16, 2048, 8192, 128256, kv_dim=512, tied=True),
    "tiny": lambda: gpt2_shapes(2, 64, 512, 128),
}


def floor_bytes(shapes, dtype: torch.dtype, merit: bool, weight_once: bool = False) -> int:
    """Bytes one step must read and write at least (see the module docstring); ``weight_once``:
    MERIT's pass 1 does not read w (its maxima kept from the previous pass 2)."""
    p = torch.tensor([], dtype=dtype).element_size()
    numel = sum(math.prod(s) for s in shapes)
    if not merit:
        return numel * 7 * p  # g, w, m, v in; w, m, v out; moments in the parameter's dtype
    s = 4 if dtype in (torch.float16, torch.bfloat16, torch.float32) else 8
    pass1 = p + (0 if weight_once else p) + 2 * s + 2 * s  # g (w) m v in; m v out
    return numel * (pass1 + p + 2 * s + p)  # pass 2: w m v in; w out


class Clock:
    """Median step time in seconds on the device (CUDA events) or the host (wall clock)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, steps: int) -> float:
        times = []
        for _ in range(steps):
            self.sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def bandwidth(device: torch.device, clock: Clock) -> float:
    """Bytes per second of a large copy (read + write counted) on the device."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    seconds = clock.time(lambda: b.copy_(a), 5)
    return 2 * n * 4 / seconds


def make_params(shapes, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=gen, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(s, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def candidates(device: torch.device, args) -> list[tuple[str, callable, str | None]]:
    """(label, make_step(params), launch-count kind) for this device."""
    out = [
        ("AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True).step, "fused"),
        ("AdamW(foreach=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True).step, "meta"),
        ("MERIT() default", lambda ps: MERIT(ps).step, None),
    ]
    names = ["reference", "foreach"] + (["cpu"] if device.type == "cpu" else [])
    if device.type == "cuda" and BACKENDS["triton"].function is not None:
        names.append("triton")
    if args.compile:
        names.append("compile")
    for name in names:
        kind = "meta" if name in ("reference", "foreach") else None
        out.append((f"MERIT({name!r})", lambda ps, name=name: MERIT(ps, implementation=name).step, kind))
    if "triton" in names:
        for warps in PREVIOUS_PASS_WARPS:
            label = "MERIT('triton') warps " + "/".join(str(warps[k]) for k in ("aligned", "strided"))
            out.append(
                (
                    label,
                    lambda ps, warps=warps: with_pass_warps(MERIT(ps, implementation="triton").step, warps),
                    "triton",
                )
            )
    return out + [("AdamW(fused=True) again", out[0][1], "fused")]


# Warps per pass program (aligned / strided tiles) the Triton backend launched with before its
# Tiling's warps were chosen by benchmarks/kernel_resources.py: timed next to the current ones.
PREVIOUS_PASS_WARPS = [{"aligned": 8, "strided": 16}]


def with_pass_warps(step, warps: dict):
    """``step`` run with the Triton backend's pass warps set to ``warps``: the registry's
    "triton" entry takes a tiling with these warps while it runs."""
    from dataclasses import replace
    from functools import partial
    from unittest import mock

    from merit_core.optim.merit.triton.plan import DEFAULT_TILING
    from merit_core.optim.merit.triton.step import merit_triton

    tiling = replace(DEFAULT_TILING, aligned_warps=warps["aligned"], strided_warps=warps["strided"])
    backend = replace(BACKENDS["triton"], function=partial(merit_triton, tiling=tiling))

    def run():
        with mock.patch.dict(BACKENDS, {"triton": backend}):
            step()

    return run


def triton_launches(step) -> str:
    """Kernels the Triton backend issued for one more step."""
    with TritonLaunches() as counter:
        step()
    return str(counter.counts["kernels"])


def launches(kind, make, shapes, dtype, step=None) -> str:
    if kind == "triton":
        return triton_launches(step)
    if kind == "meta":
        return str(count_step_launches(make, shapes, dtype=dtype))
    if kind == "fused":  # one _fused_adamw_ over 4 tensor lists + the step counters' increment
        numels = [math.prod(s) for s in shapes]
        return str(multi_tensor_apply_launches(numels, 4) + multi_tensor_apply_launches([1] * len(shapes), 1))
    return "-"


def run(model: str, dtype_name: str, device: torch.device, clock: Clock, bw: float, args) -> list[dict]:
    """Time every candidate on `model`'s shapes in `dtype_name`; print the table, return its rows."""
    shapes = MODELS[model]()
    dtype = DTYPES[dtype_name]
    numel = sum(math.prod(s) for s in shapes)
    params = make_params(shapes, dtype, device)
    default = choose(None, params, [p.grad for p in params])[0]
    print(
        f"\n{model}, {dtype_name} parameters: {len(shapes)} tensors, {numel / 1e6:.1f}M params; MERIT() -> {default!r}"
    )
    rows = []
    for label, make, kind in candidates(device, args):
        if label == "MERIT() default" and default in ("reference", "foreach"):
            kind = "meta"
        if (label == "MERIT() default" and default == "triton") or label == "MERIT('triton')":
            kind = "triton"
        try:
            step = make(params)
            for _ in range(args.warmup):
                step()
            seconds = clock.time(step, args.steps)
            count = launches(kind, make, shapes, dtype, step)
        except (ValueError, RuntimeError) as e:  # a backend this device or dtype cannot run
            print(f"  {label}: skipped ({str(e).splitlines()[0]})")
            continue
        finally:
            step = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        merit = label.startswith("MERIT")
        floors = [floor_bytes(shapes, dtype, merit, weight_once) / bw for weight_once in (False, True)]
        rows.append((label, seconds, count, floors))
    fused = [s for label, s, _, _ in rows if label.startswith("AdamW(fused=True)")]
    base = statistics.mean(fused) if fused else float("nan")
    print(
        f"  {'optimizer':26} {'ms/step':>9} {'x fused AdamW':>14} {'launches':>9} "
        f"{'floor ms':>9} {'% floor':>8} {'floor1 ms':>10} {'% floor1':>9}"
    )
    out = []
    for label, seconds, count, (floor_s, floor1_s) in rows:
        print(
            f"  {label:26} {1e3 * seconds:9.2f} {seconds / base:14.2f} {count:>9} "
            f"{1e3 * floor_s:9.2f} {100 * floor_s / seconds:7.0f}% {1e3 * floor1_s:10.2f} {100 * floor1_s / seconds:8.0f}%"
        )
        out.append(
            dict(model=model, dtype=dtype_name, optimizer=label, ms=1e3 * seconds, x_fused_adamw=seconds / base)
            | dict(launches=count, floor_ms=1e3 * floor_s, pct_floor=100 * floor_s / seconds)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--models", default=None, help="comma-separated: " + ", ".join(MODELS) + " (default per device)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated parameter dtypes: fp32, bf16")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (state, builds, compilation)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    ap.add_argument("--compile", action="store_true", help="also time the opt-in compile backend (compiles first)")
    ap.add_argument("--json", type=Path, help="also write the rows here (rewritten after each model and dtype)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/optimizer_step.py: --device cuda, but torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    models = (args.models or ("gpt2-small,llama-1b,llama-3.2-1b" if device.type == "cuda" else "gpt2-small")).split(",")
    clock = Clock(device)
    bw = bandwidth(device, clock)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"{name}; torch {torch.__version__}; measured copy bandwidth {bw / 1e9:.0f} GB/s (the floor's bandwidth)")
    rows = []
    for model in models:
        for dtype_name in args.dtypes.split(","):
            rows += run(model, dtype_name, device, clock, bw, args)
            if args.json:  # after each table: a run cut off keeps what it measured
                args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
