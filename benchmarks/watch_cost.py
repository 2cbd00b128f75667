"""The instability watcher's cost per training step, CPU or CUDA.

    python benchmarks/watch_cost.py [--model gpt2-tiny] [--optimizer merit] [--seq-len 128] [--steps 40]
        [--watch-every N]

One `merit train` run (watch on, at the default cadence or --watch-every) of the given shape; every update and every
watch call is timed (CUDA synchronised around each), and the watcher's share of a step is
(median watch call) / (watch_every x median update): what the default cadence adds to the run.
The watch call and the update it follows are timed in the same step, so load drift on a shared
machine hits both alike; the first 5 updates (warmup, allocator) are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from merit_core.train import run_watch  # noqa: E402
from merit_core.train.config import load_config  # noqa: E402
from merit_core.train.trainer import Trainer  # noqa: E402
from merit_core.train.training_run import run_training  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--optimizer", default="merit")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--watch-every", type=int, default=None, help="probe cadence (default: merit train's)")
    args = parser.parse_args()
    steps: list[float] = []
    watches: list[float] = []
    train_step, after_step = Trainer.train_step, run_watch.RunWatch.after_step

    def timed_step(self):
        _sync()
        start = time.perf_counter()
        out = train_step(self)
        _sync()
        steps.append(time.perf_counter() - start)
        return out

    def timed_watch(self, out, checkpoints):
        if self.trainer.step % self.every:
            return after_step(self, out, checkpoints)
        _sync()
        start = time.perf_counter()
        decision = after_step(self, out, checkpoints)
        _sync()
        watches.append(time.perf_counter() - start)
        return decision

    Trainer.train_step, run_watch.RunWatch.after_step = timed_step, timed_watch
    with tempfile.TemporaryDirectory() as out:
        config = load_config(
            values=dict(
                model=args.model,
                optimizer=args.optimizer,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                steps=args.steps,
                eval_every=0,
                save_every=0,
                device=args.device,
                out=str(Path(out) / "run"),
                **({} if args.watch_every is None else {"watch_every": args.watch_every}),
            )
        )
        run_training(config)
    every = config.watch_every
    step, watch = statistics.median(steps[5:]), statistics.median(watches[2:])
    print(
        f"{args.model} {args.optimizer} batch {args.batch_size} x {args.seq_len} on {config.device}: "
        f"update {step * 1e3:.1f} ms, watch call {watch * 1e3:.2f} ms every {every} steps: "
        f"{watch / (every * step):.2%} of a step"
    )


if __name__ == "__main__":
    main()
