"""What the training device is and how well a run uses it: name, peak memory, model FLOPs utilisation.

The one place that knows accelerators' peak rates. MFU here is the usual training estimate
`6 * N * tokens_per_s / peak`, with N the model's parameter count and `peak` the device's dense
bf16 tensor-core rate from its datasheet (no sparsity). The 6N rule counts the forward (2N) and
backward (4N) matrix products per token and leaves out attention's sequence-length term, so it
slightly understates long-context runs. On a CPU no MFU is reported: there is no single peak
rate worth dividing by (it depends on the vector units, the cores in use and the clock).
"""

from __future__ import annotations

import platform
import resource
import sys
from dataclasses import dataclass

# Dense bf16 peak (FLOP/s, no 2:4 sparsity) by a lower-case substring of torch's device name.
# First match wins, so a more specific name comes before a shorter one it contains. GPUs without
# bf16 tensor cores (V100, T4) are left out: an MFU against their fp16 rate would mislead.
# Source: NVIDIA's datasheet of each GPU, "BF16 Tensor Core" row. The datasheets print the rate
# with 2:4 sparsity; the dense rate used here is half of it (H100 SXM: 1,979 -> 989 TFLOP/s).
# H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet; H200 SXM: "NVIDIA H200 Tensor
# Core GPU" datasheet; H800 / A800: the export versions, same tensor-core rate as H100 SXM / A100;
# B200 / B100: the "NVIDIA HGX B200 / B100" specifications (per GPU: the 8-GPU board's figure / 8);
# A100: "NVIDIA A100 Tensor Core GPU" datasheet; A10, RTX A6000, L40S, L40, L4: their product
# datasheets. (Lightning's throughput table is not used: it mixes sparse and dense figures.)
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h200", 989e12),  # H200 SXM, also GH200 (the H200 NVL's 836e12 is not told apart by name)
    ("h100 pcie", 756e12),  # 1,513 with sparsity
    ("h100 nvl", 835e12),  # 1,671 with sparsity
    ("h100", 989e12),  # H100 SXM
    ("h800", 989e12),
    ("b200", 2250e12),  # HGX B200: 36 PFLOP/s with sparsity for 8 GPUs
    ("b100", 1750e12),  # HGX B100: 28 PFLOP/s with sparsity for 8 GPUs
    ("a100", 312e12),  # SXM and PCIe have the same rate (624 with sparsity)
    ("a800", 312e12),
    ("a10", 125e12),  # 250 with sparsity
    ("a6000", 154.8e12),  # RTX A6000: 309.7 with sparsity
    ("l40s", 362e12),  # 733 with sparsity
    ("l40", 181e12),  # 362 with sparsity
    ("l4", 121e12),  # 242 with sparsity
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device named like torch.cuda.get_device_name(), or None if unknown."""
    name = device_name.lower()
    for key, flops in BF16_PEAK_FLOPS:
        if key in name:
            return flops
    return None


def mfu(n_params: int, tokens_per_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation 6 * N * tokens/s / peak, or None when a factor is unknown."""
    if not tokens_per_s or not peak_flops:
        return None
    return 6.0 * n_params * tokens_per_s / peak_flops


@dataclass(frozen=True)
class DeviceInfo:
    """The device a run trains on, as shown in the start line."""

    device: str  # 'cuda:0', 'cpu'
    name: str  # 'NVIDIA H200', or the CPU's model name
    total_memory: int | None  # bytes (GPU memory; None on CPU)
    peak_flops: float | None  # dense bf16 peak (None on CPU or an unknown GPU)


def device_info(device) -> DeviceInfo:
    """Name, memory and bf16 peak of a torch.device."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(str(device), props.name, int(props.total_memory), peak_bf16_flops(props.name))
    return DeviceInfo(str(device), cpu_name(), None, None)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else the platform's machine name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine() or "cpu"


def reset_peak_memory(device) -> None:
    """Start counting peak memory now (CUDA; a process's peak RSS cannot be reset)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> int:
    """Peak bytes: memory allocated by tensors on a CUDA device since the last reset, else the
    process's peak resident set size (which includes the Python interpreter and libraries)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


# CPU flags that change which vector kernels (and so which summation orders) torch and BLAS use.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_isa_flags() -> list[str]:
    """The ISA_FLAGS this CPU reports in /proc/cpuinfo (Linux; [] elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in present]
    except OSError:
        pass
    return []


def float_environment(threads: int | None = None) -> dict[str, object]:
    """What decides a CPU run's floating-point results beside its code, seed and data: torch's
    version, the BLAS it was built with, the intra-op thread count (`threads`, else torch's
    current one), the vector ISA torch dispatches to and the CPU's ISA flags.

    Two runs agree bit for bit only when all of these agree; a change in any of them reorders
    sums and moves the numbers by as much as the optimizer amplifies a rounding difference."""
    import re

    import torch

    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\S+)", config)
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return {
        "torch": torch.__version__,
        "blas": blas.group(1).rstrip(",") if blas else "unknown",
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "cpu": cpu_name(),
        "cpu_capability": capability() if capability else None,
        "isa_flags": cpu_isa_flags(),
        "python": platform.python_version(),
    }
