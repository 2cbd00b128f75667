"""`python -m merit_core.compare.worker CONFIG_JSON`: one run of a comparison, in its own process.

CONFIG_JSON is a resolved TrainConfig as a JSON object. Exit codes: 0 the run finished,
3 it diverged (non-finite loss), 2 a user error (its one-line message is the last line of
the output), 143 / 130 stopped by SIGTERM / SIGINT after a checkpoint (the comparison
forwards its signals), anything else a crash (a traceback).
"""

from __future__ import annotations

import json
import sys

from merit_core.compare.runner import EXIT_DIVERGED, EXIT_USER_ERROR
from merit_core.errors import MeritError, RunInterrupted, TrainingDiverged
from merit_core.train.config import from_dict
from merit_core.train.training_run import run_training


def main(argv: list[str]) -> int:

    try:
        run_training(from_dict(json.loads(argv[0])))
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
