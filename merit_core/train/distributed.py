"""How a model is spread over processes: one process, DDP, or FSDP2 under torchrun.

The training loop talks only to the `Parallel` interface (place or shard the model, wrap it,
skip gradient sync on accumulation micro-steps, reduce metrics, clip, produce full state dicts
and optimizer state for saving); FSDP2 lives in `merit_core.train.fsdp`, and
`merit_core.train.parallel` picks the scheme for this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from merit_core.checkpoint import runs
from merit_core.checkpoint.tensors import check_optimizer_state, is_sharded_optimizer_state
from merit_core.errors import CheckpointError, MeritError
from merit_core.train.compiling import compile_blocks


class Parallel:
    """A single process; the base class of the multi-process schemes."""

    name = "single"
    sharded_state = False  # True: every process writes part of the optimizer state into the checkpoint
    # True when every process must run the same forward passes (sharded weights are gathered
    # collectively); evaluation then pads its share of batches instead of skipping.
    lockstep_forward = False

    def __init__(self, device: torch.device):
        self.device = device
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module, compile: bool = False) -> torch.nn.Module:
        """The module the training forward/backward goes through. Call it before building the
        optimizer (a sharding scheme replaces the parameters); `model` itself stays usable for
        evaluation and saving. `compile`: compile each transformer block in place (regional
        compilation, merit_core.train.compiling), which `model` then runs too."""
        if compile:
            compile_blocks(model)
        return model

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for accumulation micro-steps whose gradients need no synchronisation yet."""
        return contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A new tensor reduced over processes with op 'sum', 'mean', 'min' or 'max'."""
        return tensor.clone()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Total gradient norm (a 0-d tensor, no host sync); clips to `max_norm` when it is > 0."""
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def full_model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Full weights for saving on the main process; None means 'the module's own state dict'."""
        return None

    def weights_loader(self, model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], Any] | None:
        """How full weights (a checkpoint's) go into `model` once it is wrapped: None means the
        module's own `load_state_dict` (its parameters are whole on every process)."""
        return None

    def optimizer_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path | None = None
    ) -> dict[str, Any]:
        """What trainer_state.pt keeps as the optimizer state; a sharded scheme writes its shards into
        `checkpoint_dir` (the checkpoint being staged) and returns a marker instead."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model, optimizer: torch.optim.Optimizer, state: dict[str, Any], checkpoint_dir: Path | None = None
    ) -> None:
        if is_sharded_optimizer_state(state):
            raise CheckpointError(
                f"{checkpoint_dir} was written under --parallel fsdp (sharded optimizer state); "
                "resume it with --parallel fsdp under torchrun"
            )

        check_optimizer_state(optimizer, state, checkpoint_dir / runs.STATE_PT if checkpoint_dir else "trainer state")
        optimizer.load_state_dict(state)

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's value of `obj`, on every process."""
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DDPParallel(Parallel):
    """torch DistributedDataParallel: replicated weights, gradients averaged over processes."""

    name = "ddp"

    def __init__(self, device: torch.device, rank: int, local_rank: int, world_size: int, owns_group: bool):
        super().__init__(device)
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self._owns_group = owns_group

    def wrap(self, model, compile=False):
        ids = [self.device.index] if self.device.type == "cuda" else None
        super().wrap(model, compile)  # compiled blocks inside DDP: its bucket hooks stay outside the graphs
        self._ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        return self._ddp

    def no_sync(self):
        return self._ddp.no_sync()

    def all_reduce(self, tensor, op="sum"):
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        out = tensor.clone()
        dist.all_reduce(out, op=ops[op])
        return out / self.world_size if op == "mean" else out

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self):
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def close(self):
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def shared(parallel: Parallel, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the main process and give its result (or its MeritError) to every process."""
    result: Any = None
    if parallel.is_main:
        try:
            result = ("ok", fn())
        except MeritError as exc:
            result = ("error", exc)
    result = parallel.broadcast_object(result)
    if result[0] == "error":
        raise result[1]
    return result[1]
