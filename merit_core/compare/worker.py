"""`python -m merit_core.compare.worker CONFIG_JSON`: one run of a comparison, in its own process;
`python -m merit_core.compare.worker --serve FD`: runs one after another in one process.

CONFIG_JSON is a resolved TrainConfig as a JSON object. Exit codes: 0 the run finished,
3 it diverged (non-finite loss), 2 a user error (its one-line message is the last line of
the output), 143 / 130 stopped by SIGTERM / SIGINT after a checkpoint (the comparison
forwards its signals), anything else a crash (a traceback).

`--serve FD` (merit_core.compare.runner's pool of CPU workers): each line of stdin is a job,
`{"config": CONFIG, "log": PATH}`; the run's output goes to PATH (created or emptied, never
through a link; null: the output the process was started with) and its exit code, when it is
0, 2 or 3, is written as one line to descriptor FD, and the next job is read. Any other outcome
(a stop signal, a crash) ends the process with the code a one-run worker would exit with, so
the comparison sees the same thing either way. End of stdin: exit 0. The point is to import
torch and transformers once per worker rather than once per run (benchmarks/README.md).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

from merit_core.compare.runner import EXIT_DIVERGED, EXIT_USER_ERROR
from merit_core.durable_writes import open_truncated
from merit_core.errors import MeritError, RunInterrupted, TrainingDiverged
from merit_core.train.config import from_dict
from merit_core.train.training_run import run_training

SERVE = "--serve"
REUSABLE_EXITS = (0, EXIT_DIVERGED, EXIT_USER_ERROR)  # a run that ended so leaves the process fit for the next


def run_one(config: dict[str, Any]) -> int:
    """Train one run; its exit code (see the module docstring)."""
    try:
        run_training(from_dict(config))
    except TrainingDiverged as exc:
        print(str(exc), flush=True)
        return EXIT_DIVERGED
    except MeritError as exc:
        print(str(exc), flush=True)
        return EXIT_USER_ERROR
    except RunInterrupted as exc:
        print(str(exc), flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def _output_to(log: str | None) -> None:
    """Send this process's stdout and stderr (and its children's) to `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    if log is None:
        return
    fd = open_truncated(log)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def serve(results_fd: int) -> int:
    """Run the jobs of stdin one after another (see the module docstring)."""
    os.set_inheritable(results_fd, False)  # a compiler or tokenizer process started by a run never holds it
    with os.fdopen(results_fd, "w") as results:
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            _output_to(job.get("log"))
            code = run_one(job["config"])
            gc.collect()  # the run's model and optimizer go before the next run's are built
            sys.stdout.flush()
            sys.stderr.flush()
            if code not in REUSABLE_EXITS:
                return code
            results.write(f"{code}\n")
            results.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == SERVE:
        return serve(int(argv[1]))
    return run_one(json.loads(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
