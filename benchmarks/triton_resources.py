"""What the Triton backend's kernels ask of an NVIDIA GPU, read without one.

Triton's compiler, and the ptxas and cuobjdump its wheel bundles, run on any machine: a kernel
compiled ahead of time for a compute capability (:func:`compile_for`) shows its registers per
thread, spilled bytes, shared memory and SASS (:func:`resources`), and from those follows how
many programs an SM holds at once (:func:`occupancy`), the latency hiding a memory-bound kernel
lives on. These are properties of the code, not timings; ``benchmarks/kernel_resources.py``
prints them for every launch variant, and a test (tests/optim/test_merit_triton.py) keeps the
launch settings free of spills.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

# Triton types of the kernels' runtime arguments, by name.
ARG_TYPES = {
    **dict(meta="*i64", tile_tensor="*i32", work="*i32", first_tile="i32", total_rows="i64", total_cols="i64"),
    **dict.fromkeys(("bc1", "bc2", "eps", "wd", "lr", "clip", "beta1", "one_minus_beta1"), "fp32"),
    **dict.fromkeys(("beta2", "one_minus_beta2"), "fp32"),
    **dict.fromkeys(("row_part", "col_part", "tensor_part", "row_stats", "col_stats"), "*fp32"),
    **dict.fromkeys(("tensor_stats", "bcs", "lr_ptr"), "*fp32"),
}

REGS_PER_SM = 65536
MAX_WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64, 100: 64}
SMEM_PER_SM = {80: 167936, 86: 101376, 89: 101376, 90: 233472, 100: 233472}  # bytes blocks may use


def compile_for(kernel, constexprs: dict, num_warps: int, arch: int = 90, maxnreg: int | None = None):
    """``kernel`` compiled for an NVIDIA GPU of compute capability ``arch`` (90: H100/H200) with
    these constexpr switches; the result's ``asm`` holds "ptx" and "cubin"."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else ARG_TYPES[name] for name in kernel.arg_names}
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg is not None else {})
    return triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32), options=options
    )


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (a triton wheel with the NVIDIA backend bundles it)")
    return str(path)


def resources(compiled) -> dict:
    """Of one compiled kernel: ``regs`` per thread, spilled bytes (``local``, ``stack``),
    shared memory per program (``smem``), SASS instructions (``sass``), global loads and stores
    by width (``ldg128`` ... ``stg32``), ``mufu`` (the reciprocal and square-root units inside
    IEEE division and sqrt), and ``ld>st``: global loads placed after the first global store (a
    load the compiler could not lift above a store it cannot prove disjoint waits for it)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout

    def field(name: str) -> int:
        return int(re.search(rf"{name}:(\d+)", usage).group(1))

    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]

    def wide(prefix: str, width: str) -> int:
        return sum(op.startswith(prefix) and op.split(".")[-1] == width for op in ops)

    def plain(prefix: str) -> int:  # 32-bit: no width suffix
        return sum(op.startswith(prefix) and not op.endswith((".64", ".128", ".U8", ".U16")) for op in ops)

    first_store = next((n for n, op in enumerate(ops) if op.startswith("STG")), len(ops))
    return {
        "regs": field("REG"),
        "local": field("LOCAL"),
        "stack": field("STACK"),
        "smem": max(field("SHARED"), compiled.metadata.shared),
        "sass": len(ops),
        "ldg128": wide("LDG", "128"),
        "ldg64": wide("LDG", "64"),
        "ldg32": plain("LDG"),
        "stg128": wide("STG", "128"),
        "stg64": wide("STG", "64"),
        "stg32": plain("STG"),
        "mufu": sum(op.startswith("MUFU") for op in ops),
        "ld>st": sum(op.startswith("LDG") for op in ops[first_store:]),
    }


def occupancy(regs: int, smem: int, num_warps: int, arch: int = 90) -> int:
    """Programs resident per SM, limited by registers (allocated per warp, 8 per thread at a
    time), shared memory (1 KiB reserved per program) and the SM's warp slots."""
    by_regs = REGS_PER_SM // (-(-regs // 8) * 8 * 32 * num_warps)
    by_warps = MAX_WARPS_PER_SM.get(arch, 64) // num_warps
    by_smem = SMEM_PER_SM.get(arch, 233472) // (smem + 1024) if smem else by_warps
    return min(by_regs, by_warps, by_smem)
