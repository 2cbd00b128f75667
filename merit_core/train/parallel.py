"""Which `Parallel` this process uses: one process, or DDP / FSDP2 when launched by torchrun.

The schemes live in `merit_core.train.distributed` (single process, DDP) and
`merit_core.train.fsdp` (FSDP2, built on DDP's process group handling); this module sits above
both so that neither has to import the other's subclass.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from merit_core.devices import resolve_device
from merit_core.train.distributed import DDPParallel, Parallel
from merit_core.train.fsdp import FSDPParallel


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_parallel(kind: str, device: str, dtype: str = "auto") -> Parallel:
    """The Parallel for this process: single, or `kind` ('ddp' or 'fsdp') when launched with WORLD_SIZE > 1.

    `dtype` is the run's dtype setting (fsdp computes in bf16 when it resolves to bf16)."""
    world = launched_world_size()
    if world <= 1:
        return Parallel(resolve_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        # Always, also when the caller created the process group: nccl collectives and every
        # tensor created without an explicit device go to the current device, which is cuda:0
        # in every process until it is set (all ranks on one GPU, collectives that hang).
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(minutes=30), device_id=dev if dev.type == "cuda" else None
        )
    if kind == "fsdp":
        return FSDPParallel(dev, dist.get_rank(), local_rank, dist.get_world_size(), owns, dtype)
    return DDPParallel(dev, dist.get_rank(), local_rank, dist.get_world_size(), owns)
