"""The watcher's stop and rewind under `torchrun --nproc_per_node 2` (CPU, gloo), run by
tests/train/test_watch_ddp.py.

Usage: watch_decisions.py WORK_DIR, where WORK_DIR holds `data/` (a prepared folder) and
`model/config.json` (a tiny GPT-2). One launch does three runs under each of --parallel ddp and
fsdp (PARALLEL), since imports dominate, each with a planted divergence (from update PLANT_AT on,
the lr of a run whose configured lr is LR grows by GROWTH a step; a run at another lr is left alone):

1. `rewind-P/`: --on-instability rewind, to the end;
2. `stopped-P/`: --on-instability stop: it stops at the warning, naming the checkpoint from before it;
3. `stopped-P/` again: --resume-from that checkpoint with the lr the stop names (half of LR), to the end.

Rank 0 writes WORK_DIR/results.json: for each P the stop's message, the checkpoint it names, and
the checkpoints the stop left. Collectives time out after 120 s, so a hang fails.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from tests.train.planted_lr import raised_lr_for  # noqa: E402

LR, PLANT_AT, GROWTH, STEPS = 3e-3, 8, 1.6, 24
PARALLEL = ("ddp", "fsdp")
SETTINGS = {
    "optimizer": "adamw",
    "batch_size": 8,
    "micro_batch_size": 2,
    "seq_len": 32,
    "lr": LR,
    "warmup_steps": 0,  # no warmup: the watcher judges from the first records (it skips 2x the warmup)
    "steps": STEPS,
    "eval_every": 0,
    "save_every": 4,
    "log_every": 1,
    "eval_batches": 1,
    "eval_batch_size": 4,
    "watch_every": 2,
}


def plant() -> None:
    """The planted divergence: the lr of a run configured with LR grows by GROWTH a step from PLANT_AT on."""
    from merit_core.train.trainer import Trainer

    Trainer.lr_for = raised_lr_for(Trainer.lr_for, LR, PLANT_AT, GROWTH)  # type: ignore[method-assign]


def train(work: Path, out: str, **values) -> None:
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    paths = {"model": str(work / "model" / "config.json"), "data": str(work / "data"), "out": str(work / out)}
    run_training(load_config(values={**SETTINGS, **paths, **values}))


def stop_and_resume(work: Path, parallel: str) -> dict:
    """Runs 2 and 3 above: what the stop said and left."""
    from merit_core.errors import InstabilityStop

    try:
        train(work, f"stopped-{parallel}", parallel=parallel, on_instability="stop")
    except InstabilityStop as exc:
        assert exc.checkpoint is not None, str(exc)
        stop = {"message": str(exc), "checkpoint": str(exc.checkpoint)}
    else:
        raise AssertionError("the planted divergence was not stopped")
    left = sorted(p.name for p in (work / f"stopped-{parallel}").iterdir() if p.name.startswith("step_"))
    dist.barrier()  # every process has listed what the stop left before the resume writes
    resume_from = Path(stop["checkpoint"]).name
    train(work, f"stopped-{parallel}", parallel=parallel, resume_from=resume_from, lr=LR / 2, on_instability="rewind")
    return {**stop, "left": left}


def main() -> None:
    work = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    plant()
    results = {}
    for parallel in PARALLEL:
        train(work, f"rewind-{parallel}", parallel=parallel, on_instability="rewind")
        results[parallel] = stop_and_resume(work, parallel)
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
