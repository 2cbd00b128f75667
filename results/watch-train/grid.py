"""The watch-train grid: `merit train --watch` on runs shaped like training, with late planted faults.

    nice -n 10 python results/watch-train/grid.py OUT_DIR [K N]   # every run into OUT_DIR/<label>/

With K N, this process does runs K, K+N, K+2N, ... of the list (N processes share the grid; each
uses one torch thread). `python results/watch-train/analyze.py OUT_DIR` then labels the runs and
makes the tables.

Every run: gpt2-tiny or llama-tiny on the built-in corpus, batch 8 x 128 tokens (1,024 tokens a
step), 260 steps, 13 warmup steps (5%), then the cosine decay of `merit train` to a tenth, grad
clip 1, CPU float32, seeds 0-2, the watcher probing every 2 steps and warning only (a replay at a
coarser cadence takes every k-th record: the probe changes nothing in the run). Per model,
optimizer (AdamW, MERIT, LAMB) and seed, four runs:

- `base`: the optimizer's measured best lr at this model and batch (merit_core/optim/lr_table.py);
- `edge`: 4x that lr, past the stable edge (where the runs of the issue's probe spiked);
- `ramp100` and `ramp130`: the base lr, and from update 100 (130) on the lr grows by 5% (7%) a
  step on top of the schedule: a planted fault whose cause and start are known, that makes the
  loss diverge late and gradually, as the lr sweeps past the edge.

The planted fault is put into the real training loop (merit_core.train.training_run.run_training)
by replacing `Trainer.lr_for` in this process; everything else is what `merit train --watch`
does. A run is stopped (as on SIGTERM) 10 steps after it meets the divergence rule
(merit_core.instability_rules.divergence_step), to keep the grid affordable.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from merit_core.errors import MeritError, RunInterrupted  # noqa: E402
from merit_core.instability_rules import divergence_step  # noqa: E402
from merit_core.train.callbacks import TrainCallbacks  # noqa: E402
from merit_core.train.config import load_config  # noqa: E402
from merit_core.train.trainer import Trainer  # noqa: E402
from merit_core.train.training_run import run_training  # noqa: E402

MODELS = ("gpt2-tiny", "llama-tiny")
OPTIMIZERS = ("adamw", "merit", "lamb")
SEEDS = (0, 1, 2)
STEPS, WARMUP, BATCH, SEQ = 260, 13, 8, 128
EDGE = 4.0  # the edge runs' lr, in units of the base lr
# the planted faults: the update the lr starts growing at, and its growth per step
RAMPS = {"ramp100": (100, 1.05), "ramp130": (130, 1.07)}
KINDS = ("base", "edge", *RAMPS)
COMMON = dict(
    batch_size=BATCH,
    seq_len=SEQ,
    steps=STEPS,
    warmup_steps=WARMUP,
    log_every=1,
    eval_every=0,
    save_every=0,
    device="cpu",
    watch=True,
    watch_every=2,
    on_instability="warn",
)
SCHEDULE = Trainer.lr_for  # merit train's own schedule, which the planted fault multiplies
AFTER = 10  # steps a diverged run goes on before it is stopped (the rule looks 5 steps ahead)


def label(model: str, optimizer: str, kind: str, seed: int) -> str:
    return f"{model}-{optimizer}-{kind}-s{seed}"


def base_lr(model: str, optimizer: str) -> float:
    """The optimizer's measured default lr for `model` at this batch, as `merit train` picks it."""
    from merit_core.train.config import resolve

    return float(resolve(load_config(values=dict(COMMON, model=model, optimizer=optimizer))).config.lr)


def planted(plant_at: int | None, growth: float):
    """`Trainer.lr_for` with the lr growing by `growth` a step from update `plant_at` on (None: as is)."""

    def lr_for(self: Trainer, index: int) -> float:
        value = SCHEDULE(self, index)
        if plant_at is not None and index >= plant_at:
            value *= growth ** (index - plant_at + 1)
        return value

    return lr_for


class StopAfterDivergence(TrainCallbacks):
    """Asks the run to stop AFTER steps after the loss met the divergence rule."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_log(self, record: dict[str, Any]) -> None:
        self.losses.append((int(record["step"]), float(record["loss"])))

    def stop_requested(self) -> str | None:
        d = divergence_step(self.losses)
        return "SIGTERM" if d is not None and self.losses[-1][0] >= d + AFTER else None


def plan() -> list[tuple[str, str, str, int]]:
    """(model, optimizer, kind, seed) of every run, seed by seed, so a grid cut short stays balanced."""
    return [(m, o, k, s) for s in SEEDS for m in MODELS for o in OPTIMIZERS for k in KINDS]


def main(out: Path, part: int = 0, parts: int = 1) -> None:
    import torch

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    for model, optimizer, kind, seed in plan()[part::parts]:
        name = label(model, optimizer, kind, seed)
        run_dir = out / name
        if (run_dir / "done.json").exists():
            continue
        lr = base_lr(model, optimizer) * (EDGE if kind == "edge" else 1.0)
        plant_at, growth = RAMPS.get(kind, (None, 1.0))
        values = dict(COMMON, model=model, optimizer=optimizer, lr=lr, seed=seed, out=str(run_dir))
        Trainer.lr_for = planted(plant_at, growth)  # type: ignore[method-assign]
        run_one(name, values, {"kind": kind, "plant_at": plant_at, "ramp_growth": growth})


def run_one(name: str, values: dict[str, Any], about: dict[str, Any]) -> None:
    """Train one run of a grid with `values` (stopped AFTER steps past a divergence), then write its
    done.json (its label, `about`, how it ended, its seconds and `values`) and print one line."""
    start, ended = time.perf_counter(), "finished"
    try:
        run_training(load_config(values=values), StopAfterDivergence())
    except RunInterrupted:
        ended = "stopped after divergence"
    except MeritError as exc:
        ended = f"error: {str(exc).splitlines()[0][:200]}"
    seconds = time.perf_counter() - start
    done = {"label": name, **about, "ended": ended, "seconds": round(seconds, 1), **values}
    (Path(values["out"]) / "done.json").write_text(json.dumps(done) + "\n")
    print(f"{name}: {ended} in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:4]))
