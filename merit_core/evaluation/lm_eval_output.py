"""What lm-eval's own command line writes and reads, for `merit eval --output_path` / `--log_samples` / `--seed`.

`lm_eval --output_path DIR` writes `DIR/<model>/results_<time>.json` (and with `--log_samples`
`DIR/<model>/samples_<task>_<time>.jsonl`), where <model> is the `pretrained=` path with `/`
replaced by `__`; lm-eval's tools (its result readers, the leaderboard scripts) look for those
files. merit writes them with lm-eval's own `EvaluationTracker`, so the schema is lm-eval's by
construction, into a staging folder first, then renames each file into place.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from merit_core.errors import ConfigError
from merit_core.fileio import fsync_dir, fsync_file
from merit_core.values import parse_number

DEFAULT_SEED = (0, 1234, 1234, 1234)  # lm-eval's: python random, numpy, torch, few-shot sampler
SEED_SLOTS = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")


def parse_seed(text: str | int | Sequence[int | None]) -> tuple[int | None, ...]:
    """lm-eval's --seed: one integer for all four seeds, or 'python,numpy,torch,fewshot' ('None' leaves one unset)."""
    if isinstance(text, (tuple, list)):
        items = list(text)
    else:
        items = []
        for part in str(text).split(","):
            part = part.strip()
            if part.lower() == "none":
                items.append(None)
                continue
            try:
                items.append(parse_number(part, int, "--seed"))  # ASCII digits only
            except ConfigError:
                raise ConfigError(
                    f"--seed {text}: give one integer (all four seeds) or four, python,numpy,torch,fewshot "
                    "(None leaves one unset), as lm-eval takes them"
                ) from None
    if len(items) == 1:
        items *= len(SEED_SLOTS)
    if len(items) != len(SEED_SLOTS) or any(isinstance(i, bool) for i in items):
        raise ConfigError(
            f"--seed {text}: give one integer or four (python,numpy,torch,fewshot), as lm-eval takes them"
        )
    return tuple(items)


def seed_kwargs(seed: Sequence[int | None]) -> dict[str, int | None]:
    """The seeds as `lm_eval.simple_evaluate` keyword arguments."""
    return dict(zip(SEED_SLOTS, seed))


def write_lm_eval_results(
    output_path: str | os.PathLike, model_name: str, out: dict[str, Any], settings: dict[str, Any] | None = None
) -> list[Path]:
    """Write one checkpoint's `simple_evaluate` output where `lm_eval --output_path` would; return the files.

    `model_name` is what lm-eval's `pretrained=` would have been (the checkpoint's path or hub name);
    `settings` (`model_args`, `batch_size`, `device`) fill the entries of `config` that lm-eval's
    command line records and an in-memory model leaves empty.
    """
    from lm_eval.loggers import EvaluationTracker

    target = Path(output_path).expanduser()
    folder = target.parent if target.suffix == ".json" else target
    folder.mkdir(parents=True, exist_ok=True)
    results = copy.deepcopy({k: v for k, v in out.items() if k != "samples"})
    samples = out.get("samples") or {}
    config = results.setdefault("config", {})
    for key, value in (settings or {}).items():
        if config.get(key) in (None, [], ""):
            config[key] = value
    staging = Path(tempfile.mkdtemp(prefix=".tmp-lm-eval-", dir=folder))
    try:
        staged_target = staging / target.name if target.suffix == ".json" else staging
        tracker = EvaluationTracker(output_path=str(staged_target))
        tracker.general_config_tracker.log_experiment_args(
            model_source="hf",
            model_args=f"pretrained={model_name}",
            system_instruction=None,
            chat_template=None,
            fewshot_as_multiturn=False,
        )
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results.get("configs", {}):
            if task in samples:
                tracker.save_results_samples(task_name=task, samples=copy.deepcopy(samples[task]))
        written = sorted(p for p in staging.rglob("*") if p.is_file())
        if not any(p.name.endswith(".json") for p in written):  # lm-eval logs a failed save and goes on
            raise ConfigError(f"--output_path {output_path}: lm-eval could not write its results file there")
        moved = []
        for path in written:
            final = folder / path.relative_to(staging)
            final.parent.mkdir(parents=True, exist_ok=True)
            fsync_file(path)
            os.replace(path, final)
            fsync_dir(final.parent)
            moved.append(final)
        return moved
    finally:
        shutil.rmtree(staging, ignore_errors=True)
