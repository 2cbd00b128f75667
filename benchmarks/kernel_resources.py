"""Static resources of the Triton backend's kernels, compiled for an NVIDIA GPU without one.

    python benchmarks/kernel_resources.py               # sm_90 (H100/H200), MERIT()'s default step
    python benchmarks/kernel_resources.py --arch 80     # A100
    python benchmarks/kernel_resources.py --json out.json
    python benchmarks/kernel_resources.py --arch device  # as compiled for the GPU of this machine

Triton's compiler and the ptxas and cuobjdump its wheel bundles need no GPU, so what each kernel
asks of the hardware can be read on any machine (benchmarks/triton_resources.py):
registers per thread, spilled bytes, shared memory, SASS instructions, global loads and stores
by width, and from registers, warps and shared memory the theoretical occupancy (programs and
warps resident per SM). These are properties of the code, not timings:
`optimizer_step.py --device cuda` measures the time.

Rows: pass 1 and pass 2 over vectorisable ("aligned") and other ("strided") tiles (see
``TritonPlan``) at 4 to 32 warps a program (the backend's choice, ``Tiling``'s, is marked *),
without bias correction (MERIT's default) and, at the backend's warps, with it; then finalize.
The other switches are those of MERIT()'s default step (max-norm, element-wise ratios with the
weight-wise bound, clipping, a float lr).

Columns:
  warps     num_warps of the launch
  regs      registers per thread;  local, stack: spilled bytes per thread (0 is what we want)
  smem      shared memory per program (bytes, static + Triton's scratch)
  progs/SM  programs resident per SM, limited by registers, shared memory and warp slots
  warps/SM  progs/SM x warps (of 64)
  sass      SASS instructions in the kernel (all dtype branches: fp32, bf16, fp16 params/grads)
  ldg128 / ldg64 / ldg32  global loads by width;  stg128 / stg64 / stg32  stores
  mufu      MUFU instructions (reciprocal and square-root approximations inside IEEE div/sqrt)
  ld>st     global loads placed after the kernel's first global store (a load the compiler
            could not move above a store it cannot prove disjoint waits for it)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

COLUMNS = ["warps", "regs", "local", "stack", "smem", "progs/SM", "warps/SM", "sass"]
COLUMNS += ["ldg128", "ldg64", "ldg32", "stg128", "stg64", "stg32", "mufu", "ld>st"]


def variants(chosen_only: bool = False):
    """(label, kernel, constexprs, num_warps) of each launch MERIT()'s default step can make, at
    the backend's warps and others (not with `chosen_only`), and with bias correction."""
    from merit_core.optim.merit.triton import kernels
    from merit_core.optim.merit.triton.plan import DEFAULT_TILING as tiling

    tile = tiling.constexprs()
    default = dict(L2=False, ROWCOL=True, PER_TENSOR_BC=False)
    passes = (
        ("pass 1", kernels.pass1_kernel, dict(default, MAXIMIZE=False)),
        ("pass 2", kernels.pass2_kernel, dict(default, BOUND=True, CLIP=True, LR_PTR=False)),
    )
    for aligned in (True, False):
        options = tiling.launch_options(aligned)
        chosen = options.pop("num_warps")
        layout = "aligned" if aligned else "strided"
        runs = [(False, warps) for warps in ((chosen,) if chosen_only else (4, 8, 16, 32))] + [(True, chosen)]
        for bias_correction, warps in runs:
            for name, kernel, flags in passes:
                label = f"{name}, {layout}, {warps} warps" + ("*" if warps == chosen else "")
                label += ", bias corr." if bias_correction else ""
                consts = {**tile, **flags, **options, "BIAS_CORRECTION": bias_correction}
                yield label, kernel, consts, warps
    consts = dict(tiling.finalize_constexprs(), L2=False, ROWCOL=True)
    yield "finalize", kernels.finalize_kernel, consts, tiling.finalize_warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", default="90", help="compute capability x 10 (90: H100/H200, 80: A100), or 'device': this GPU's"
    )
    parser.add_argument("--chosen-only", action="store_true", help="only the backend's own warps per program")
    parser.add_argument("--limit", type=int, default=None, help="only the first N kernels (a quick check)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        import triton
    except ImportError:
        sys.exit("kernel_resources: triton is not installed (pip install triton)")
    import torch

    if args.arch == "device":
        if not torch.cuda.is_available():
            sys.exit("kernel_resources: --arch device, but torch sees no CUDA device")
        major, minor = torch.cuda.get_device_capability()
        args.arch = 10 * major + minor
    args.arch = int(args.arch)
    print(f"Triton {triton.__version__} kernels compiled for sm_{args.arch} (no GPU used); torch {torch.__version__}")
    from benchmarks.triton_resources import compile_for, occupancy, resources

    print(f"  {'kernel':<40}" + "".join(f"{c:>9}" for c in COLUMNS))
    out = []
    for label, kernel, consts, warps in list(variants(args.chosen_only))[: args.limit]:
        r = resources(compile_for(kernel, consts, warps, args.arch))
        progs = occupancy(r["regs"], r["smem"], warps, args.arch)
        r = dict(kernel=label, warps=warps, **r, **{"progs/SM": progs, "warps/SM": progs * warps})
        out.append(r)
        print(f"  {label:<40}" + "".join(f"{r[c]:>9}" for c in COLUMNS), flush=True)
        if args.json:  # after each kernel: a run cut off keeps the rows it compiled
            args.json.write_text(json.dumps(dict(arch=args.arch, triton=triton.__version__, rows=out), indent=1) + "\n")


if __name__ == "__main__":
    main()
