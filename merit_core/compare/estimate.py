"""How long a CPU comparison's planned runs will take, said before they start.

On a CPU a sequence's forward + backward and its forward alone are timed in this process, at a
worker's intra-op thread count, on a model built as the runs build theirs (the fastest of
TIMED_PASSES passes over PROBE_SEQUENCES sequences, after WARM_PASSES untimed ones). Every run's
steps and evaluations are scaled from those times; the runs are then laid out over the jobs as the
runner hands them out (each to the first free slot, in order), with a fixed cost for each worker's
start (importing torch and transformers: `WORKER_START_S`) and for each run (building, optimizer
steps, checkpoints, the watcher's probes, its plot: `RUN_OVERHEAD_S`), and a slowdown for runs that
share the machine (`SHARED_SLOWDOWN`); those three are fitted to `merit compare --quick` on the
project's 2-core CPU (benchmarks/README.md). Nothing is estimated on GPUs, where first passes are
dominated by kernel loading, nor for runs with their own environment (the environment check's re-runs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from merit_core.checkpoint.resolve import latest_checkpoint
from merit_core.compare.grid import PlannedRun
from merit_core.data.meta import DataMeta
from merit_core.models import build_model, model_config

PROBE_SEQUENCES = 2  # timed passes are on this many sequences: a sequence costs about alike at any micro-batch
WARM_PASSES, TIMED_PASSES = 3, 5  # single passes vary; the fastest of several is steady
WORKER_START_S = 7.0  # a worker's imports (torch, transformers), once per slot on CPU
RUN_OVERHEAD_S = 2.0  # per run: building, optimizer steps, checkpoints, the watcher's probes, the plot
SHARED_SLOWDOWN = 1.15  # runs side by side (each on its share of the cores), against one alone


@dataclasses.dataclass(frozen=True)
class CompareEstimate:
    """The planned runs' expected duration: `seconds` in all, `runs` of them to train, `jobs` at once;
    `more`: later rounds may add runs it does not count (grid edges, best-seed top-ups, the environment
    check)."""

    seconds: float
    runs: int
    jobs: int
    more: bool = False


def _fastest(work: Callable[[], object]) -> float:
    """The fastest of TIMED_PASSES calls of `work`, after WARM_PASSES untimed ones (allocations, caches)."""
    for _ in range(WARM_PASSES):
        work()
    times = []
    for _ in range(TIMED_PASSES):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The next-token loss of `x` (the training loss up to its chunking, merit_core.train.lm_loss)."""
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _steps_left(run: PlannedRun, state: str) -> int:
    if state != "partial":
        return run.steps
    found = latest_checkpoint(run.run_dir)
    return run.steps - (found[0] if found is not None else 0)


def _evaluations(run: PlannedRun, steps_left: int) -> int:
    every, start = run.config.eval_every, run.steps - steps_left
    if not every:
        return 1
    # as TrainingRun does: at step 0, every `every` steps, and at the last step
    return (start == 0) + run.steps // every - start // every + (run.steps % every != 0)


def estimate_runs(
    runs: list[PlannedRun], states: dict[str, str], jobs: int, threads: int | None, meta: DataMeta
) -> CompareEstimate | None:
    """The expected duration of the runs still to train (states 'new' or 'partial'), or None when they
    do not all train on this CPU alike (a GPU, a run with its own environment) or nothing is left."""
    todo = [run for run in runs if states[run.name] in ("new", "partial")]
    if not todo or threads is None or any(run.env or run.threads for run in todo):
        return None
    if any(run.config.device not in ("cpu", "auto") for run in todo):
        return None
    first = todo[0].config
    eos = meta.eos_token_id
    config = model_config(first.model, vocab_size=meta.vocab_size, special_ids={"bos": eos, "eos": eos})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            model = build_model(config, seed=0)
            x = torch.randint(0, meta.vocab_size, (PROBE_SEQUENCES, first.seq_len), generator=torch.Generator())

            def train_pass() -> None:
                _loss(model, x).backward()
                model.zero_grad(set_to_none=True)

            train_s = _fastest(train_pass) / PROBE_SEQUENCES  # a sequence's forward + backward
            with torch.no_grad():
                eval_s = _fastest(lambda: _loss(model, x)) / PROBE_SEQUENCES  # and its forward alone
    finally:
        torch.set_num_threads(before)
    shared = SHARED_SLOWDOWN if min(jobs, len(todo)) > 1 else 1.0
    slots = [WORKER_START_S] * min(jobs, len(todo)) if jobs > 1 else [0.0]
    for run in todo:
        left = _steps_left(run, states[run.name])
        # an evaluation: the validation batches and the probe pass on the first (about one more batch)
        evals = _evaluations(run, left) * (run.config.eval_batches + 1) * run.config.eval_batch_size * eval_s
        seconds = (left * run.batch_size * train_s + evals) * shared + RUN_OVERHEAD_S
        slot = slots.index(min(slots))
        slots[slot] += seconds
    return CompareEstimate(max(slots), len(todo), min(jobs, len(todo)))
