"""Wall time of `merit eval RUN --checkpoints all --tasks builtin` with one worker and with two.

Trains a gpt2-tiny run with 4 checkpoints on the built-in corpus (or takes `--run RUN`), then times,
each in a fresh process so both pay the same imports, in one script run:
- `--devices cpu` (one process: the checkpoints one after another),
- `--devices cpu,cpu` (two worker processes, each with half the cores, whole checkpoints each),
and checks that both wrote the same scores. Prints a table with the ratio and the load average
(os.getloadavg) before and after each timing: on a shared machine the load says how far to trust it.

    python benchmarks/eval_workers.py [--limit 40] [--repeats 1] [--run RUN] [--devices cuda:0,cuda:1]

`--devices` replaces the two-worker list (the one-worker run takes its first entry), e.g. on a GPU
node: python benchmarks/eval_workers.py --devices cuda:0,cuda:1 --limit 500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
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


def time_eval(run: Path, devices: str, limit: int, out: Path) -> tuple[float, tuple[float, float], dict]:
    """Seconds of one `merit eval` process, the 1-minute load average before and after, its JSON."""
    args = ["eval", str(run), "--checkpoints", "all", "--tasks", "builtin", "--limit", str(limit)]
    args += ["--bootstrap-iters", "0", "--devices", devices, "-o", str(out)]
    before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(_merit(*args), check=True, env=_env(), stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    return seconds, (before, os.getloadavg()[0]), json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=40, help="documents per task (merit eval --limit)")
    parser.add_argument("--repeats", type=int, default=1, help="timings of each (one then two workers, in turn)")
    parser.add_argument("--run", default=None, help="a run folder with several checkpoints (default: train one)")
    parser.add_argument("--devices", default="cpu,cpu", help="the two-worker --devices list")
    parser.add_argument("--model", default="gpt2-tiny", help="the model the script trains when --run is not given")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="merit-eval-workers-") as tmp:
        folder = Path(tmp)
        run = Path(opts.run) if opts.run else train_run(folder, opts.model)
        many = opts.devices
        one = many.split(",")[0]
        rows = []
        scores = {}
        for repeat in range(opts.repeats):
            for devices in (one, many):
                seconds, load, data = time_eval(run, devices, opts.limit, folder / f"{repeat}-{len(rows)}.json")
                rows.append((devices, seconds, load))
                scores[devices] = [c["results"] for c in data["checkpoints"]]
        same = scores[one] == scores[many]
        differ = _largest_difference(scores[one], scores[many])
        steps = len(next(iter(scores.values())))
        print(
            f"merit eval RUN --checkpoints all --tasks builtin --limit {opts.limit} ({steps} checkpoints), "
            f"{os.cpu_count()} CPUs, torch threads shared out per worker"
        )
        print("| --devices | wall time | load avg before -> after |")
        print("|---|---:|---:|")
        for devices, seconds, (before, after) in rows:
            print(f"| {devices} | {seconds:.1f} s | {before:.2f} -> {after:.2f} |")
        mean = {d: sum(s for dd, s, _ in rows if dd == d) / opts.repeats for d in (one, many)}
        print(
            f"ratio (one worker / {len(many.split(','))} workers): {mean[one] / mean[many]:.2f}x; scores equal: {same}"
            + ("" if same else f" (largest relative difference {differ:.1e}: the workers' torch thread counts differ)")
        )


if __name__ == "__main__":
    main()
