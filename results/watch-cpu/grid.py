"""The watch-cpu grid: tiny runs of `merit train --watch` from healthy to diverging lrs.

    nice -n 10 python results/watch-cpu/grid.py OUT_DIR [K N]   # every run into OUT_DIR/<label>/

With K N, this process does runs K, K+N, K+2N, ... of the list (N processes share the grid; each
uses one thread: the tiny models gain nothing from a second one).

Each run is the training loop behind `merit train` (merit_core.train.training_run.run_training)
with the settings below and the watcher on every 2 steps (watch_every 2; the default is 20) and on_instability warn,
so that the warnings in each run's metrics.jsonl are the ones `merit train --watch` gives. One
addition, to keep the grid affordable on a shared 2-core CPU: a run is stopped (as on SIGTERM)
10 steps after it meets the divergence rule (merit_core.instability_rules.divergence_step). Runs go seed by seed, so that a grid cut
short is still balanced. `python results/watch-cpu/analyze.py OUT_DIR` then makes the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

sys.path.insert(0, str(HERE.parent / "watch-train"))
import grid as watch_train  # noqa: E402  (results/watch-train/grid.py: one run and its stop after a divergence)

MODELS = ("gpt2-tiny", "llama-tiny")
# lrs a factor 2 apart around each optimizer's stable edge at gpt2-tiny batch 16 (merit_core/optim/lr_table.py)
LRS = {"adamw": (8e-3, 1.6e-2, 3.2e-2), "merit": (0.06, 0.12, 0.24), "lamb": (0.12, 0.24, 0.48)}
SEEDS = (0, 1, 2)
COMMON = dict(
    batch_size=16,
    seq_len=32,
    vocab_size=1024,
    steps=80,
    warmup_steps=10,
    log_every=1,
    eval_every=0,
    save_every=0,
    device="cpu",
    watch=True,
    watch_every=2,  # a probe every 2 steps: these runs are 80 steps (merit train's default cadence is 20)
    on_instability="warn",
)


def label(model: str, optimizer: str, lr: float, seed: int) -> str:
    return f"{model}-{optimizer}-lr{lr:g}-s{seed}"


def plan() -> list[tuple[str, str, float, int]]:
    """(model, optimizer, lr, seed) of every run, seed by seed: every lr for the first seed, the two
    largest of each optimizer for the others (the smallest are the healthy references; the budget
    of a shared 2-core machine goes to the runs near and past the stable edge)."""
    return [
        (model, optimizer, lr, seed)
        for seed in SEEDS
        for model in MODELS
        for optimizer, lrs in LRS.items()
        for lr in (lrs if seed == SEEDS[0] else lrs[1:])
    ]


def main(out: Path, part: int = 0, parts: int = 1) -> None:
    import torch

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    for model, optimizer, lr, seed in plan()[part::parts]:
        name = label(model, optimizer, lr, seed)
        run_dir = out / name
        if (run_dir / "done.json").exists():
            continue
        values = dict(COMMON, model=model, optimizer=optimizer, lr=lr, seed=seed, out=str(run_dir))
        watch_train.run_one(name, values, {})


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:4]))
