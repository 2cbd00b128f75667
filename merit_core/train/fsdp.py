"""FSDP2 under torchrun: every transformer block and the root sharded with `fully_shard`.

Parameters, gradients and optimizer state become `DTensor`s sharded along dim 0 over a 1-D
device mesh of all processes (gloo on CPU, nccl on GPU). On GPU with bf16 (dtype 'auto' or
'bfloat16') the forward/backward run with bf16 parameters and gradients are reduced in fp32
(`MixedPrecisionPolicy`); the sharded master weights and the optimizer state stay fp32.

Choices:
- Gradient accumulation: non-final micro-steps run with `set_requires_gradient_sync(False)`,
  so gradients accumulate unsharded and are reduce-scattered once per update (one reduction
  per step, as with DDP's `no_sync`; the price is one full-size gradient per process between
  micro-steps). Parameters are still resharded after every forward and backward.
- Gradient clipping: the norm of the sharded gradients is completed over processes (a full
  norm, equal to the unsharded one) and the clip factor is applied to the local shards.
- Checkpoints: rank 0 writes the Hugging Face folder from a gathered full state dict
  (`cpu_offload`, so the full model never sits on an accelerator; a tied LM head is saved once,
  as transformers does), and every rank writes its optimizer shards with
  `torch.distributed.checkpoint` into `<checkpoint>/optimizer/`. The folder needs a file
  system all ranks see (one machine, or a shared file system across nodes). Because DCP stores
  global shapes and offsets, a run may resume under another world size (the shards are
  redistributed); a single-process or DDP checkpoint cannot be resumed under fsdp, and the
  other way round, since the optimizer states are stored differently.
- The model is built whole and moved to the device before it is sharded, so one process must
  hold it once (meta-device initialisation for larger models is not done).

Optimizers under fsdp (each checked against a single process fed the same gradients, see
tests/dist_scripts/fsdp_checks.py; the others are refused, each with the reason its registry
spec gives in `fsdp_refused`):
- MERIT and its ablations: exact on the shards through `merit_core.optim.merit.dtensor_step`, with
  one small all-reduce per param group per step (the row/column/tensor max-norm statistics of
  all its parameters in one buffer).
- AdamW (foreach; the fused kernel takes no DTensors), Lion, Sophia-G (and its Hessian
  refresh): element-wise, so the shards need nothing; exact.
- Muon: correct, but not cheap: DTensor gathers each matrix for the Newton-Schulz iteration
  (many collectives per matrix per step), and every process computes the full bf16
  orthogonalisation; results match a single process up to bf16 rounding.
- pytorch_optimizer's Lamb: refused (its in-place clamp of a cross-shard norm fails on DTensor).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from merit_core.checkpoint.optimizer_shards import METADATA_FILE, load_sharded
from merit_core.checkpoint.tensors import DCP_FORMAT, is_sharded_optimizer_state
from merit_core.errors import CheckpointError, ConfigError
from merit_core.optim.registry import OptimizerSpec, get_spec
from merit_core.train.compiling import compile_blocks, transformer_blocks
from merit_core.train.distributed import DDPParallel

OPTIMIZER_DIR = "optimizer"


def check_fsdp_optimizer(optimizer: str | OptimizerSpec) -> None:
    """ConfigError when registry optimizer `optimizer` (a name or its spec) cannot run under fsdp
    (its spec's `fsdp_refused`)."""
    spec = get_spec(optimizer)
    if spec.fsdp_refused is not None:
        raise ConfigError(f"optimizer '{spec.name}' does not support --parallel fsdp: {spec.fsdp_refused}")


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class FSDPParallel(DDPParallel):
    """FSDP2 (`fully_shard` per transformer block and at the root) over all processes."""

    name = "fsdp"
    sharded_state = True  # every process writes its optimizer shards into the checkpoint folder
    lockstep_forward = True  # every forward all-gathers: all processes run the same forwards

    def __init__(
        self, device: torch.device, rank: int, local_rank: int, world_size: int, owns_group: bool, dtype: str = "auto"
    ):
        super().__init__(device, rank, local_rank, world_size, owns_group)
        self.bf16 = dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")
        self.module: torch.nn.Module | None = None

    def wrap(self, model, compile=False):
        """Shard `model` in place (each transformer block, then the root); `model` keeps working for
        evaluation and saving (its forward gathers the weights), the optimizer sees the shards."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.bf16
            else MixedPrecisionPolicy()
        )
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.module = model
        if compile:  # each block's forward, inside FSDP2's per-block all-gather / reshard hooks
            compile_blocks(model)
        return model

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm(self, model, max_norm):
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if _is_dtensor(norm):
            norm = norm.full_tensor()  # the per-shard norms completed over processes
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def reshard(self) -> None:
        """Put the sharded parameters back on every module: the root keeps its weights gathered after
        a forward without backward (evaluation), and state dicts must see the sharded ones."""
        from torch.distributed.fsdp import FSDPModule

        if self.module is None:  # not wrapped yet: nothing is sharded
            return
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_model_state_dict(self, model):
        """The unsharded weights on rank 0 (CPU tensors), {} elsewhere; collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.reshard()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if getattr(model.config, "tie_word_embeddings", False) and head is not None:
            full.pop(_prefix(model, head) + "weight", None)  # tied head: re-tied from the input embedding on load
        return full

    def weights_loader(self, model):
        """Full weights into the sharded model: every process reads them whole and keeps its shard
        (collective: all processes load the same checkpoint together)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        def load(weights: dict[str, Any]):
            self.reshard()
            options = StateDictOptions(full_state_dict=True, strict=False)
            return set_model_state_dict(model, weights, options=options)

        return load

    def optimizer_state_dict(self, model, optimizer, checkpoint_dir: Path | None = None) -> dict[str, Any]:
        """Write the sharded optimizer state into `checkpoint_dir/optimizer/` (collective) and
        return the marker that trainer_state.pt keeps in its place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if checkpoint_dir is None:
            raise ValueError("under fsdp the optimizer state is written into a checkpoint folder")
        self.reshard()
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=Path(checkpoint_dir) / OPTIMIZER_DIR)
        return {"format": DCP_FORMAT, "path": OPTIMIZER_DIR, "world_size": self.world_size}

    def load_optimizer_state_dict(self, model, optimizer, state, checkpoint_dir: Path | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if checkpoint_dir is None:
            raise ValueError("under fsdp the optimizer state is read from a checkpoint folder")
        if not is_sharded_optimizer_state(state):
            raise CheckpointError(
                f"{checkpoint_dir} was written by a single-process or DDP run; resume it with --parallel ddp"
            )
        if state.get("path") != OPTIMIZER_DIR:  # the marker comes from the run folder: never a path out of it
            raise CheckpointError(
                f"{checkpoint_dir}: its trainer state puts the optimizer shards at {state.get('path')!r}, "
                f"not {OPTIMIZER_DIR!r}; this checkpoint cannot be resumed"
            )
        folder = Path(checkpoint_dir) / OPTIMIZER_DIR
        if folder.is_symlink() or not (folder / METADATA_FILE).is_file():
            raise CheckpointError(
                f"{folder} is missing, a link or incomplete (no {METADATA_FILE}); this checkpoint cannot be resumed"
            )
        self.reshard()
        target = get_optimizer_state_dict(model, optimizer)  # initialises the state (zero-lr step)
        load_sharded(target, folder)  # a mismatch or an unreadable shard: its one-line CheckpointError
        set_optimizer_state_dict(model, optimizer, target)


def _prefix(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """`module`'s qualified name in `model` followed by a dot."""
    return next(name for name, m in model.named_modules() if m is module) + "."
