"""`resolve_device`: the one reading of a `--device` setting (train, eval, inspect, compare).

'auto' (or nothing) means this process's GPU when CUDA sees one, else the CPU; 'cuda' means this
process's GPU (`cuda:<local_rank>` under torchrun); an explicit device is checked to exist, so a
missing GPU is one line (ConfigError) before any work starts, not a CUDA error mid-run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from merit_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

AUTO = ("", "auto")


def resolve_device(device: str | None = "auto", local_rank: int = 0) -> torch.device:
    """The torch device a `--device` value names on this machine (ConfigError when it is not usable)."""
    import torch

    text = (device or "").strip().lower()
    if text in AUTO:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device}: not a torch device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)  # torchrun gives each process its GPU
        elif dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {device}: MPS is not available; use --device cpu")
    return dev


def measurement_device(device: str | None) -> str:
    """Where to measure runs that trained with `device` (compare's eval and Hessian): that device
    when it is usable here, else the CPU. Never raises: the runs already exist."""
    try:
        return str(resolve_device(device))
    except ConfigError:
        return "cpu"


def available_host_memory() -> int | None:
    """Bytes of host memory available to new allocations (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
