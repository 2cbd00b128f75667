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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from merit_core.durable_writes import fsync_dir, fsync_file, refuse_link, rename_new
from merit_core.errors import ConfigError, UnsafePath
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


EVAL_SECONDS = "merit_evaluation_seconds"  # in simple_evaluate's output (harness): the model load and scoring


def _as_given(source: str, include_path: str | None) -> str:
    """A task YAML's path under the resolved --include-path as lm-eval records it: under the folder as typed."""
    if not include_path:
        return source
    root = Path(include_path).expanduser().resolve()
    try:
        rest = Path(source).relative_to(root)
    except ValueError:
        return source
    return os.path.join(include_path, str(rest))


def check_model_folders(output_path: str | os.PathLike, model_names: Sequence[str]) -> None:
    """Before any scoring: UnsafePath when `DIR/<model>` for one of `model_names` (the `pretrained=`
    values as typed) is a symbolic link, dangling or not; ConfigError when it is there but no folder.
    `write_lm_eval_results` checks again as it writes."""
    from lm_eval.utils import sanitize_model_name

    target = Path(output_path).expanduser()
    if target.suffix == ".json":  # lm-eval writes DIR/<name>_<time>.json beside it, in no model folder
        return
    for name in model_names:
        place = target / sanitize_model_name(name)
        refuse_link(place, "inside --output_path")
        if os.path.lexists(place) and not place.is_dir():
            raise ConfigError(
                f"--output_path {output_path}: {place} is not a folder; lm-eval writes into DIR/<model>/: "
                "move it or give another DIR"
            )


def _refuse_taken(folder: Path, final: Path) -> None:
    """UnsafePath when a folder on the way from `folder` to `final` is a link, or `final` is taken."""
    for parent in reversed(final.relative_to(folder).parents[:-1]):  # DIR/<model>, ... (never DIR itself)
        refuse_link(folder / parent, "inside --output_path")
    refuse_link(final, "inside --output_path")
    if os.path.lexists(final):
        raise UnsafePath(f"{final} already exists and merit did not just make it; remove it")


def write_lm_eval_results(
    output_path: str | os.PathLike, model_name: str, out: dict[str, Any], settings: dict[str, Any] | None = None
) -> list[Path]:
    """Write one checkpoint's `simple_evaluate` output where `lm_eval --output_path` would; return the files.

    The file is the one `lm_eval --model hf --model_args ... --output_path DIR` writes for the same run,
    field for field: `model_name` is the `pretrained=` value as typed (also the folder name), `config`
    holds `model: "hf"` and `model_args` as lm-eval parses them (a dict), the tasks' metadata carry the
    model arguments as lm-eval merges them in, a task YAML's `config_source` is under the
    `--include-path` as typed, and `total_evaluation_time_seconds` is the model load and scoring time
    (`out[EVAL_SECONDS]`). `settings`: `model` (lm-eval's --model, hf by default), `model_args` (the
    string), `batch_size`, `device` (the one that scored this checkpoint), `include_path`. A symbolic link inside DIR (a planted `DIR/<model>`) is refused, never written through.
    """
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import simple_parse_args_string

    settings = dict(settings or {})
    model_source = settings.pop("model", None) or "hf"
    include_path = settings.pop("include_path", None)
    model_args = simple_parse_args_string(settings.pop("model_args", None) or f"pretrained={model_name}")
    target = Path(output_path).expanduser()
    folder = target.parent if target.suffix == ".json" else target
    folder.mkdir(parents=True, exist_ok=True)
    results = copy.deepcopy({k: v for k, v in out.items() if k not in ("samples", EVAL_SECONDS)})
    samples = out.get("samples") or {}
    config = results.setdefault("config", {})
    config["model"], config["model_args"] = model_source, model_args
    for key, value in settings.items():
        if config.get(key) in (None, [], "") or key == "batch_size":
            config[key] = value
    if config.get("gen_kwargs") is None:
        config["gen_kwargs"] = {}  # lm-eval's command line passes an empty dict
    for task_config in results.get("configs", {}).values():
        metadata = task_config.setdefault("metadata", {})
        if isinstance(metadata, dict):  # lm-eval merges the model arguments into every task's metadata
            task_config["metadata"] = {**metadata, **{k: v for k, v in model_args.items() if k not in metadata}}
            if "config_source" in metadata:
                task_config["metadata"]["config_source"] = _as_given(metadata["config_source"], include_path)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-lm-eval-", dir=folder))
    try:
        staged_target = staging / target.name if target.suffix == ".json" else staging
        tracker = EvaluationTracker(output_path=str(staged_target))
        seconds = out.get(EVAL_SECONDS)
        if isinstance(seconds, (int, float)):  # the tracker times from its creation; lm-eval's CLI creates it first
            tracker.general_config_tracker.start_time = time.perf_counter() - seconds
        tracker.general_config_tracker.log_experiment_args(
            model_source=model_source,
            model_args=model_args,
            system_instruction=None,
            chat_template=None,
            fewshot_as_multiturn=None,
        )
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results.get("configs", {}):
            if task in samples:
                tracker.save_results_samples(task_name=task, samples=copy.deepcopy(samples[task]))
        written = sorted(p for p in staging.rglob("*") if p.is_file())
        if not any(p.name.endswith(".json") for p in written):  # lm-eval logs a failed save and goes on
            raise ConfigError(f"--output_path {output_path}: lm-eval could not write its results file there")
        finals = [(path, folder / path.relative_to(staging)) for path in written]
        for _, final in finals:  # every name checked before the first file is moved in: all or none
            _refuse_taken(folder, final)
        moved = []
        for path, final in finals:
            _refuse_taken(folder, final)
            final.parent.mkdir(parents=True, exist_ok=True)
            fsync_file(path)
            rename_new(path, final)  # a file, folder or link put there meanwhile is never replaced
            fsync_dir(final.parent)
            moved.append(final)
        return moved
    finally:
        shutil.rmtree(staging, ignore_errors=True)
