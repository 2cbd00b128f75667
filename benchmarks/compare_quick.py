"""How long `merit compare --quick` takes, on a first run and with merit's cache warm, and where a run's time goes.

    python benchmarks/compare_quick.py [--repeats 1] [COMPARE_ARGS ...]
    python benchmarks/compare_quick.py --phases

The first form runs `merit compare --quick COMPARE_ARGS` with an empty merit cache (the built-in corpus
prepared, the CPU kernel built and checked: a first run) and then again into another folder with that
cache (every run trained again), each in a fresh process with piped (plain) output; it prints each
one's wall time, its CPU time (the comparison's process and its workers), the CPU time every other
process of the machine used meanwhile (a measurement with much of that is not one of a quiet machine)
and the estimate the comparison printed.

`--phases` trains the six runs of the default `--quick` one after another in this process, one
intra-op thread (as a compare worker on 2 cores), and prints each run's process CPU time by part:
imports (the first run only), evaluations (of which the attention probe), training steps, the
instability watcher, checkpoints, the run's plot, and the rest.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (all processes), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def end_to_end(args: list[str], repeats: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory(prefix="merit-quick-") as tmp:
            env.update(MERIT_CACHE_DIR=f"{tmp}/cache", HF_HOME=f"{tmp}/hf")
            for label in ("first run", "cache warm"):
                out = Path(tmp, label.replace(" ", "-"))
                command = [sys.executable, "-m", "merit_cli", "compare", "--quick", "--out", str(out), *args]
                load = Path("/proc/loadavg").read_text().split()[:3]
                busy, cpu, start = _busy_seconds(), _children_cpu(), time.perf_counter()
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - start
                mine = _children_cpu() - cpu
                others = _busy_seconds() - busy - mine
                if done.returncode != 0:
                    raise SystemExit(f"{label}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                estimate = next((line for line in done.stdout.splitlines() if line.startswith("estimate")), "-")
                print(
                    f"[{repeat + 1}] {label}: {wall:.1f} s wall, {mine:.1f} s CPU, other processes {others:.1f} s CPU, "
                    f"load average at the start {' '.join(load)}; {estimate}",
                    flush=True,
                )


def phases() -> None:
    start = time.process_time()
    from merit_core.compare.grid import plan_runs
    from merit_core.compare.spec import load_spec
    from merit_core.compare.worker import run_one
    from merit_core.train import run_watch, trainer, training_run

    imports = time.process_time() - start
    import torch

    torch.set_num_threads(1)
    parts: dict[str, float] = collections.defaultdict(float)

    def timed(owner: Any, name: str, part: str) -> None:
        real: Callable[..., Any] = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begin = time.process_time()
            try:
                return real(*args, **kwargs)
            finally:
                parts[part] += time.process_time() - begin

        setattr(owner, name, wrapper)

    timed(training_run.TrainingRun, "_eval", "evaluations")
    timed(trainer, "probe_attention", "of which the probe")
    timed(trainer.Trainer, "train_step", "training steps")
    timed(run_watch.RunWatch, "after_step", "watcher")
    timed(training_run.TrainingRun, "_save", "checkpoints")
    timed(training_run.TrainingRun, "_plot", "plot")
    with tempfile.TemporaryDirectory(prefix="merit-phases-") as tmp:
        for index, run in enumerate(plan_runs(load_spec(quick=True, out=tmp))):
            parts.clear()
            begin = time.process_time()
            code = run_one(dataclasses.asdict(run.config))
            total = time.process_time() - begin
            rest = total - sum(v for k, v in parts.items() if k != "of which the probe")
            shown = {**({"imports": imports} if index == 0 else {}), **parts, "rest": rest, "run": total}
            print(f"{run.name} (exit {code}): " + ", ".join(f"{k} {v:.2f} s" for k, v in shown.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--phases", action="store_true", help="Per-part CPU time of the six runs, in this process.")
    known, rest = parser.parse_known_args()
    if known.phases:
        phases()
    else:
        end_to_end(rest, known.repeats)


if __name__ == "__main__":
    main()
