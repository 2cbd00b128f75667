"""Training throughput (tokens/s) of the tiny model with MERIT and with AdamW, measured in one run.

Each optimizer gets its own Trainer (same model init, same batches); after warm-up steps the
optimizers take turns, a few timed steps each, round after round (order alternating), so
machine-load drift hits both alike. The median and the best round are reported, each with its
ratio to the baseline (the first optimizer). The optimizer step alone is timed too (fastest of
several, on the gradients of one training step), to show where a difference comes from.

    python benchmarks/train_throughput.py                     # gpt2-tiny, batch 16 x 128, CPU
    python benchmarks/train_throughput.py --optimizers adamw,merit,lamb --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_trainer(optimizer: str, args, train_tokens, val_tokens):
    from merit_core.devices import resolve_device
    from merit_core.models import build_model, model_config
    from merit_core.optim import default_hparams
    from merit_core.train.config import TrainConfig, resolve
    from merit_core.train.distributed import Parallel
    from merit_core.train.trainer import build_trainer as trainer_for

    config = resolve(
        TrainConfig(
            model=args.model,
            optimizer=optimizer,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            seq_len=args.seq_len,
            steps=10_000,
            eval_batches=1,
            eval_batch_size=1,
            device=args.device,
            compile=args.compile,
            out="unused",
        ),
        optimizer_defaults=default_hparams(optimizer),
    )
    parallel = Parallel(resolve_device(args.device))
    model = build_model(model_config(args.model, vocab_size=args.vocab_size), seed=0).to(parallel.device)
    return trainer_for(config, model, parallel, train_tokens, val_tokens)


def timed_steps(trainer, n: int) -> float:
    import torch

    start = time.perf_counter()
    for _ in range(n):
        out = trainer.train_step()
    float(out.loss.item())  # one sync at the end, as on a log step
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def optimizer_step_time(trainer, n: int = 9) -> float:
    """Fastest seconds of optimizer.step() alone, on the gradients of one fresh training step
    (it changes the model and optimizer state: call it last)."""
    import torch

    c = trainer.config
    trainer.optimizer.zero_grad(set_to_none=True)
    x, y = next(trainer.batches.micro_batches(0, batch_size=c.batch_size, micro_batch_size=c.micro_batch_size))
    loss = trainer._loss(trainer.forward, x.to(trainer.device), y.to(trainer.device), 1.0 / y.numel())
    loss.backward()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.optimizer.step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--optimizers", default="adamw,merit", help="comma-separated; the first is the baseline")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per optimizer per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import numpy as np
    import torch
    from rich.console import Console
    from rich.table import Table

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    rng = np.random.default_rng(0)
    train_tokens = rng.integers(0, args.vocab_size, size=2_000_000, dtype=np.int64).astype(np.uint16)
    val_tokens = train_tokens[:10_000]
    trainers = {n: build_trainer(n, args, train_tokens, val_tokens) for n in names}
    tokens_per_step = args.batch_size * args.seq_len
    for trainer in trainers.values():
        timed_steps(trainer, args.warmup)

    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            rates[n].append(args.steps * tokens_per_step / timed_steps(trainers[n], args.steps))
    step_ms = {n: 1e3 * optimizer_step_time(trainers[n]) for n in names}

    base = statistics.median(rates[names[0]])
    table = Table(
        title=f"Training throughput: {args.model}, batch {args.batch_size} x {args.seq_len}, "
        f"{args.device}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps"
    )
    best_base = max(rates[names[0]])
    for col in (
        "optimizer",
        "tokens/s median",
        "tokens/s best",
        "optimizer step ms",
        f"median vs {names[0]}",
        f"best vs {names[0]}",
    ):
        table.add_column(col, justify="left" if col == "optimizer" else "right")
    for n in names:
        med, best = statistics.median(rates[n]), max(rates[n])
        table.add_row(
            n, f"{med:,.0f}", f"{best:,.0f}", f"{step_ms[n]:.2f}", f"{med / base:.3f}", f"{best / best_base:.3f}"
        )
    Console().print(table)
    Console().print("[dim]'best' is each optimizer's fastest round: the least disturbed by other load.[/]")


if __name__ == "__main__":
    main()
