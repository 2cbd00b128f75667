"""Wall time of `merit eval --devices`: a run's checkpoints, and one checkpoint's requests, over workers.

Trains a gpt2-tiny run with 4 checkpoints on the built-in corpus (or takes `--run RUN`), then times,
each in a fresh process so that all pay the same imports, in one script run (the rounds alternate
baseline and candidate, so that load drift hits both alike):
- shared cores, whole checkpoints: `RUN --checkpoints all` with `--devices cpu` (one process, the
  checkpoints one after another, torch's threads on every core) and `--devices cpu,cpu` (two worker
  processes, each with half the cores, whole checkpoints each);
- device for device, on a CPU a device being a core: each process pinned to its cores (one core for
  one worker, two for two) with one torch thread per worker, which is what a node of N GPUs sees:
  `RUN --checkpoints all` on `cpu` vs `cpu,cpu`, and one checkpoint (`RUN`, its latest, with
  `--split-limit` documents per task) on `cpu` vs `cpu,cpu --share requests`;
- one checkpoint's requests split over two workers against one process on every core.
Each comparison checks that both wrote the same scores. Prints tables with the ratios and the load
average (os.getloadavg) before and after each timing: on a shared machine the load says how far to
trust it.

    python benchmarks/eval_workers.py [--limit 40] [--split-limit 160] [--repeats 1] [--run RUN]
                                      [--devices cuda:0,cuda:1] [--model gpt2-tiny]

`--devices` replaces the two-worker list (the one-worker runs take its first entry), e.g. on a GPU
node: python benchmarks/eval_workers.py --devices cuda:0,cuda:1 --limit 500 (a GPU is a device
already: nothing is pinned and the device-for-device rows are the shared-cores rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if threads is not None:  # torch's threads in a one-process run and in the parent of workers
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _merit(*args: str) -> list[str]:
    return [sys.executable, "-m", "merit_cli", *args]


def _largest_difference(a: object, b: object) -> float:
    """The largest relative difference between the numbers at the same place of two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return max((_largest_difference(a[k], b[k]) for k in a.keys() & b.keys()), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return max((_largest_difference(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != b:
        return abs(a - b) / max(abs(a), abs(b))
    return 0.0


def train_run(folder: Path, model: str) -> Path:
    """`model` on the built-in corpus, a checkpoint at each of 4 steps."""
    run = folder / "run"
    sets = {"batch_size": 8, "micro_batch_size": 8, "seq_len": 64, "save_every": 1, "eval_every": 4, "eval_batches": 1}
    args = ["train", "--model", model, "--steps", "4", "--out", str(run), "--device", "cpu", "--yes"]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    subprocess.run(_merit(*args), check=True, env=_env(), stdout=subprocess.DEVNULL)
    return run


@dataclass(frozen=True)
class Eval:
    """One timed `merit eval`: its --devices (and --share), the checkpoints, the cores it is pinned to
    (None: this process's) and the torch threads it is given (None: torch's default)."""

    devices: str
    all_checkpoints: bool
    limit: int
    split: str | None = None
    cores: tuple[int, ...] | None = None
    threads: int | None = None

    def label(self) -> str:
        return self.devices + (f" --share {self.split}" if self.split else "")

    def cores_text(self) -> str:
        return str(len(self.cores)) if self.cores else f"all ({len(_cores())})"


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def time_eval(run: Path, case: Eval, out: Path) -> tuple[float, tuple[float, float], dict]:
    """Seconds of one `merit eval` process, the 1-minute load average before and after, its JSON."""
    args = ["eval", str(run), *(["--checkpoints", "all"] if case.all_checkpoints else [])]
    args += ["--tasks", "builtin", "--limit", str(case.limit), "--bootstrap-iters", "0", "--devices", case.devices]
    args += [*(["--share", case.split] if case.split else []), "-o", str(out)]
    cores = case.cores

    def pin() -> None:  # the process and the workers it spawns run on these cores only
        if cores:
            os.sched_setaffinity(0, cores)

    before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(
        _merit(*args), check=True, env=_env(case.threads), stdout=subprocess.DEVNULL, preexec_fn=pin if cores else None
    )
    seconds = time.perf_counter() - started
    return seconds, (before, os.getloadavg()[0]), json.loads(out.read_text())


@dataclass
class Comparison:
    """A baseline and a candidate, timed in turn; their rows and scores."""

    name: str
    baseline: Eval
    candidate: Eval

    def __post_init__(self) -> None:
        self.rows: list[tuple[Eval, float, tuple[float, float]]] = []
        self.scores: dict[Eval, list] = {}

    def ratio_line(self) -> str:
        mean = {
            c: sum(s for e, s, _ in self.rows if e == c) / sum(1 for e, *_ in self.rows if e == c) for c in self.scores
        }
        a, b = self.scores[self.baseline], self.scores[self.candidate]
        same = a == b
        differ = "" if same else f" (largest relative difference {_largest_difference(a, b):.1e})"
        return (
            f"{self.name}: ratio ({self.baseline.label()} / {self.candidate.label()}): "
            f"{mean[self.baseline] / mean[self.candidate]:.2f}x; scores equal: {same}{differ}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limit", type=int, default=40, help="documents per task (merit eval --limit), all checkpoints"
    )
    parser.add_argument(
        "--split-limit", type=int, default=None, help="documents per task for one checkpoint (4 x --limit)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every comparison (baseline, then candidate)")
    parser.add_argument("--run", default=None, help="a run folder with several checkpoints (default: train one)")
    parser.add_argument("--devices", default="cpu,cpu", help="the two-worker --devices list")
    parser.add_argument("--model", default="gpt2-tiny", help="the model the script trains when --run is not given")
    opts = parser.parse_args()
    many = opts.devices
    one = many.split(",")[0]
    workers = len(many.split(","))
    split_limit = opts.split_limit or 4 * opts.limit
    cores = _cores()
    pinned = all(d.strip() == "cpu" for d in many.split(",")) and len(cores) >= workers
    shared = Comparison("shared cores", Eval(one, True, opts.limit), Eval(many, True, opts.limit))
    comparisons = [shared]
    if pinned:  # a device is a core: one core and one torch thread per worker
        mine, theirs = tuple(cores[:1]), tuple(cores[:workers])
        comparisons += [
            Comparison(
                "checkpoints, device for device",
                Eval(one, True, opts.limit, cores=mine, threads=1),
                Eval(many, True, opts.limit, cores=theirs, threads=1),
            ),
            Comparison(
                "requests, device for device",
                Eval(one, False, split_limit, cores=mine, threads=1),
                Eval(many, False, split_limit, "requests", cores=theirs, threads=1),
            ),
        ]
    comparisons.append(
        Comparison("requests vs one process", Eval(one, False, split_limit), Eval(many, False, split_limit, "requests"))
    )
    with tempfile.TemporaryDirectory(prefix="merit-eval-workers-") as tmp:
        folder = Path(tmp)
        run = Path(opts.run) if opts.run else train_run(folder, opts.model)
        for repeat in range(opts.repeats):
            for n, comparison in enumerate(comparisons):
                for case in (comparison.baseline, comparison.candidate):
                    out = folder / f"{repeat}-{n}-{len(comparison.rows)}.json"
                    seconds, load, data = time_eval(run, case, out)
                    comparison.rows.append((case, seconds, load))
                    comparison.scores[case] = [c["results"] for c in data["checkpoints"]]
    steps = len(shared.scores[shared.baseline])
    print(
        f"merit eval RUN --checkpoints all --tasks builtin --limit {opts.limit} ({steps} checkpoints), "
        f"{os.cpu_count()} CPUs, torch threads shared out per worker"
    )
    print("| --devices | wall time | load avg before -> after |")
    print("|---|---:|---:|")
    for case, seconds, (before, after) in shared.rows:
        print(f"| {case.devices} | {seconds:.1f} s | {before:.2f} -> {after:.2f} |")
    print(shared.ratio_line())
    print()
    print(
        f"checkpoints: RUN --checkpoints all --limit {opts.limit}; requests: one checkpoint, RUN (its latest) "
        f"--limit {split_limit}; device for device: each process pinned to its cores, one torch thread per worker"
    )
    print("| comparison | --devices | cores | wall time | load avg before -> after |")
    print("|---|---|---:|---:|---:|")
    for comparison in comparisons[1:]:
        for case, seconds, (before, after) in comparison.rows:
            text = f"| {comparison.name} | {case.label()} | {case.cores_text()} | {seconds:.1f} s "
            print(text + f"| {before:.2f} -> {after:.2f} |")
    for comparison in comparisons[1:]:
        print(comparison.ratio_line())


if __name__ == "__main__":
    main()
