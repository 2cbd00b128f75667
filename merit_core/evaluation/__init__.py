"""Zero-shot evaluation of checkpoints through lm-evaluation-harness.

    from merit_core.evaluation import EvalSettings, evaluate_checkpoints
    results = evaluate_checkpoints(["runs/a"], EvalSettings(tasks=["wikitext"]))

`tasks` names and expands task aliases, `checkpoint` finds and loads checkpoints, `harness` runs
lm-eval on them (`backends`: on one device, one model over several, or vLLM), `workers` shares a list
of checkpoints out to one worker process per device (`worker_processes`), or with `request_split` each
checkpoint's requests, and `results` holds the records and their JSON. Importing this package does not
import lm-eval, torch or transformers.
"""

from merit_core.evaluation.harness import EvalProgress, EvalSettings, evaluate_checkpoints

__all__ = ["EvalProgress", "EvalSettings", "evaluate_checkpoints"]
