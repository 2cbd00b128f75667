"""FSDP2 checks run by tests/test_fsdp.py under `torchrun --nproc_per_node 2` (CPU, gloo).

Usage: fsdp_checks.py WORK_DIR, where WORK_DIR holds `data/` (a prepared folder) and
`model/config.json` (a tiny GPT-2). One launch does everything, since imports dominate:

1. `run_training` with parallel='fsdp' for MERIT (checkpoints at steps 2 and 4) and AdamW;
   the test compares their metrics with single-process runs of the same global batch.
2. Resume: a copy of the MERIT run without step_4 is resumed from step_2.
3. Every registry optimizer on a sharded tiny GPT-2 against a plain copy fed the very same
   gradients (gradient accumulation with no_sync, clipping, Sophia-G's Hessian refresh):
   the largest weight difference, the gradient norms, and the error of those that fail. A
   second plain copy gets the gradients perturbed at the resolution the optimizer computes in
   (1e-7 relative for fp32; 2^-8 for Muon, whose Newton-Schulz iteration runs in bf16 and so
   depends on the summation order of its sharded matmuls): how far it drifts is the noise floor.
4. Empty shards: MERIT on a toy model with parameters whose dim 0 is below the world size.
5. Mixed precision: dtype 'bfloat16' gives bf16 compute over fp32 sharded weights; 'auto' on CPU fp32.

Rank 0 writes WORK_DIR/results.json. Collectives time out after 60 s, so a hang fails.
"""

from __future__ import annotations

import copy
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS = 3
COMMON = {
    "batch_size": 8,
    "micro_batch_size": 2,
    "seq_len": 32,
    "steps": 4,
    "eval_every": 2,
    "save_every": 2,
    "log_every": 1,
    "eval_batches": 3,
    "eval_batch_size": 4,
}  # 3 eval batches: uneven over 2 ranks
LRS = {"merit": 2e-2, "adamw": 3e-3}


def train_runs(work: Path) -> None:
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    model, data = str(work / "model" / "config.json"), str(work / "data")
    for name in ("merit", "adamw"):
        values = {
            **COMMON,
            "optimizer": name,
            "lr": LRS[name],
            "model": model,
            "data": data,
            "out": str(work / f"fsdp_{name}"),
            "parallel": "fsdp",
        }
        run_training(load_config(values=values))
    resumed = work / "resumed"
    if dist.get_rank() == 0:
        shutil.copytree(work / "fsdp_merit", resumed, ignore=shutil.ignore_patterns("step_4"))
    dist.barrier()
    values = {
        **COMMON,
        "optimizer": "merit",
        "lr": LRS["merit"],
        "model": model,
        "data": data,
        "out": str(resumed),
        "parallel": "fsdp",
        "resume": True,
    }
    run_training(load_config(values=values))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _copy_grads(
    sharded: torch.nn.Module, plain: torch.nn.Module, noise: torch.Generator | None = None, scale: float = 0.0
) -> None:
    for p, q in zip(sharded.parameters(), plain.parameters()):
        q.grad = _full(p.grad).clone()
        if noise is not None:
            q.grad.mul_(1 + scale * torch.randn(q.shape, generator=noise))


def _weight_diff(sharded: torch.nn.Module, plain: torch.nn.Module) -> float:
    return max(
        (_full(p.detach()) - q.detach()).abs().max().item() for p, q in zip(sharded.parameters(), plain.parameters())
    )


def optimizer_check(name: str, parallel, config) -> dict:
    """`name` on a sharded model and on a plain copy given identical gradients, STEPS steps."""
    from transformers import GPT2LMHeadModel

    from merit_core.optim import build_optimizer
    from merit_core.optim.sophia import sampled_label_loss
    from merit_core.train.distributed import Parallel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(config)
    plain, twin, sharded = copy.deepcopy(base), copy.deepcopy(base), parallel.wrap(copy.deepcopy(base))
    single = Parallel(torch.device("cpu"))
    noise = torch.Generator().manual_seed(3)
    scale = 2.0**-8 if name == "muon" else 1e-7
    lr = 1e-2
    opt_s, opt_p, opt_t = (build_optimizer(name, m, lr=lr) for m in (sharded, plain, twin))
    out = {
        "optimizer": type(opt_s).__name__,
        "weight_diff": 0.0,
        "noise_floor": 0.0,
        "norm_diff": 0.0,
        "update": 0.0,
        "kernel": {k: opt_s.defaults.get(k) for k in ("foreach", "fused")},
    }
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    calls = []
    real_all_reduce = dist.all_reduce
    try:
        for step in range(STEPS):
            x = torch.randint(0, config.vocab_size, (8, 17), generator=gen)
            mine = x[rank::world]
            for k in range(2):  # two micro-batches per rank: the first without gradient sync
                xb = mine[2 * k : 2 * k + 2]
                ctx = parallel.no_sync() if k == 0 else torch.enable_grad()
                with ctx:
                    logits = sharded(input_ids=xb[:, :-1]).logits
                    loss = F.cross_entropy(logits.flatten(0, 1), xb[:, 1:].flatten(), reduction="sum") / (4 * 16)
                    loss.backward()
            _copy_grads(sharded, plain)
            _copy_grads(sharded, twin, noise, scale)
            norm_s = parallel.clip_grad_norm(sharded, 0.5)
            norm_p = single.clip_grad_norm(plain, 0.5)
            single.clip_grad_norm(twin, 0.5)
            out["norm_diff"] = max(out["norm_diff"], abs(float(norm_s) - float(norm_p)) / float(norm_p))
            before = [q.detach().clone() for q in plain.parameters()]
            dist.all_reduce = lambda *a, **kw: calls.append(a[0].numel()) or real_all_reduce(*a, **kw)
            opt_s.step()
            dist.all_reduce = real_all_reduce
            opt_p.step()
            opt_t.step()
            out["update"] = max(
                out["update"], max((q.detach() - b).abs().max().item() for q, b in zip(plain.parameters(), before))
            )
            for opt in (opt_s, opt_p, opt_t):
                opt.zero_grad(set_to_none=True)
            if hasattr(opt_s, "update_hessian") and step == 1:  # Sophia-G's refresh, same sampled labels
                logits = sharded(input_ids=mine[:, :-1]).logits
                g = torch.Generator().manual_seed(7 + rank)
                h_loss, n = sampled_label_loss(logits, generator=g)
                h_loss.backward()
                _copy_grads(sharded, plain)
                _copy_grads(sharded, twin, noise, scale)
                for opt in (opt_s, opt_p, opt_t):
                    opt.update_hessian(n * world)
                    opt.zero_grad(set_to_none=True)
            out["weight_diff"] = max(out["weight_diff"], _weight_diff(sharded, plain))
            out["noise_floor"] = max(out["noise_floor"], _weight_diff(twin, plain))
    except Exception as exc:  # noqa: BLE001 - recorded for the support table
        dist.all_reduce = real_all_reduce
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    out["all_reduces_per_step"] = len(calls) / STEPS
    out["dtensor_params"] = all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    return out


class Toy(torch.nn.Module):
    """Parameters of shapes [1, 5], [1] (an empty shard on rank 1), [3, 1] and [3] (uneven)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 1)
        self.b = torch.nn.Linear(1, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def empty_shard_check(parallel) -> dict:
    from merit_core.optim import MERIT

    torch.manual_seed(0)
    base = Toy()
    plain, sharded = copy.deepcopy(base), parallel.wrap(copy.deepcopy(base))
    local_rows = [p.to_local().shape[0] for p in sharded.parameters()]
    opt_s, opt_p = (
        MERIT(sharded.parameters(), lr=0.05, weight_decay=0.1),
        MERIT(plain.parameters(), lr=0.05, weight_decay=0.1),
    )
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    diff = 0.0
    for _ in range(STEPS):
        sharded(x).square().mean().backward()
        _copy_grads(sharded, plain)
        opt_s.step()
        opt_p.step()
        opt_s.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
        diff = max(diff, _weight_diff(sharded, plain))
    moved = max((q.detach() - b.detach()).abs().max().item() for q, b in zip(plain.parameters(), base.parameters()))
    return {"local_rows": local_rows, "weight_diff": diff, "moved": moved, "steps": STEPS}


def mixed_precision_check(config) -> dict:
    from transformers import GPT2LMHeadModel

    from merit_core.train.parallel import setup_parallel

    out = {}
    for dtype in ("auto", "bfloat16"):
        torch.manual_seed(0)
        model = setup_parallel("fsdp", "cpu", dtype).wrap(GPT2LMHeadModel(config))
        x = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        logits = model(input_ids=x).logits
        logits.float().mean().backward()
        params = list(model.parameters())
        out[dtype] = {
            "compute": str(logits.dtype),
            "weights": sorted({str(p.dtype) for p in params}),
            "grads": sorted({str(p.grad.dtype) for p in params}),
        }
    return out


def main() -> None:
    work = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    from transformers import GPT2Config

    from merit_core.optim import OPTIMIZER_NAMES
    from merit_core.train.parallel import setup_parallel

    start = time.perf_counter()
    train_runs(work)
    timings = {"training_runs_s": time.perf_counter() - start}
    parallel = setup_parallel("fsdp", "cpu")
    config = GPT2Config(**json.loads((work / "model" / "config.json").read_text()))
    results = {
        "world_size": dist.get_world_size(),
        "optimizers": {name: optimizer_check(name, parallel, config) for name in OPTIMIZER_NAMES},
    }
    timings["optimizer_checks_s"] = time.perf_counter() - start - timings["training_runs_s"]
    results["empty_shard"] = [None] * dist.get_world_size()  # one entry per rank
    dist.all_gather_object(results["empty_shard"], empty_shard_check(parallel))
    results["mixed_precision"] = mixed_precision_check(config)
    results["timings"] = timings
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
