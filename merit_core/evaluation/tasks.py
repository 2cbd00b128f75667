"""Evaluation task names: merit's aliases, lookup in lm-eval's task index, and dataset loading.

Indexing all of lm-eval's built-in task YAMLs is slow (benchmarks/README.md has the figures). The
tasks the paper uses live in a few known folders of that tree, so when only those (or
`--include-path` tasks) are asked for, only those folders are indexed. Other names are first looked
for in the raw YAML text (much faster, and enough to reject a misspelt name) and only then in the
full index.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core.errors import ConfigError, DataError
from merit_core.evaluation import builtin_tasks


@dataclass(frozen=True)
class TaskAlias:
    """A merit shorthand that stands for one or more lm-eval tasks."""

    name: str
    tasks: tuple[str, ...]
    description: str


# lm-eval names SuperGLUE's RTE `sglue_rte`; its plain `rte` is the GLUE copy (another dataset).
ALIASES: dict[str, TaskAlias] = {
    a.name: a
    for a in (
        TaskAlias(
            "lambada",
            ("lambada_openai", "lambada_standard"),
            "LAMBADA last-word prediction, OpenAI and standard versions: perplexity, accuracy",
        ),
        TaskAlias(
            "wikitext",
            ("wikitext",),
            "WikiText-2 documents, rolling log-likelihood: word/byte perplexity, bits per byte",
        ),
        TaskAlias(
            "superglue",
            ("boolq", "cb", "copa", "multirc", "record", "sglue_rte", "wic", "wsc"),
            "SuperGLUE, the paper's zero-shot suite: accuracy (plus F1 for cb, F1/EM for record)",
        ),
        TaskAlias(
            builtin_tasks.ALIAS,
            builtin_tasks.TASK_NAMES,
            "offline: perplexity and last-word prediction on the built-in corpus's held-out text",
        ),
    )
}

# Built-in task name -> folder of lm_eval/tasks that defines it (indexing that folder alone is far
# cheaper than lm-eval's full index; benchmarks/README.md has the timings).
_BUILTIN_FOLDERS: dict[str, str] = {
    "lambada": "lambada",
    "lambada_openai": "lambada",
    "lambada_standard": "lambada",
    "wikitext": "wikitext",
    "super-glue-lm-eval-v1": "super_glue",
    **{name: "super_glue" for name in ALIASES["superglue"].tasks},
}


@dataclass
class ResolvedTasks:
    """Task names after alias expansion, and the lm-eval TaskManager that knows all of them."""

    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager
    index: str  # "include-path", "known-folders" or "full": which task YAMLs were indexed


def split_task_list(tasks: str | Iterable[str]) -> list[str]:
    """Split 'a,b' / ['a', 'b,c'] into clean names, keeping order and dropping duplicates."""
    parts = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for p in parts for n in p.split(",")]
    return list(dict.fromkeys(n for n in names if n))


def expand_aliases(names: Iterable[str]) -> list[str]:
    """Replace merit aliases by their lm-eval task names, keeping order and dropping duplicates."""
    out: list[str] = []
    for name in names:
        alias = ALIASES.get(name.lower())
        out.extend(alias.tasks if alias else (name,))
    return list(dict.fromkeys(out))


def _builtin_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _task_manager(paths: Sequence[Path], include_defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in paths] or None, include_defaults=include_defaults)


def _suggest(name: str, candidates: Iterable[str]) -> list[str]:
    pool = {c.lower(): c for c in candidates}
    return [pool[m] for m in difflib.get_close_matches(name.lower(), list(pool), n=4, cutoff=0.6)]


def unknown_task_error(unknown: Sequence[str], candidates: Iterable[str]) -> ConfigError:
    """A one-line ConfigError naming the unknown tasks and, for each, the closest known names."""
    candidates = list(candidates)
    described = []
    for name in unknown:
        close = _suggest(name, candidates)
        described.append(f"{name!r} (did you mean {', '.join(close)}?)" if close else repr(name))
    plural = "s" if len(unknown) > 1 else ""
    return ConfigError(
        f"unknown task{plural} {', '.join(described)}: `merit eval --list-tasks` shows the aliases; "
        "any lm-eval task name works, and --include-path DIR adds local task YAMLs"
    )


def resolve_tasks(tasks: str | Iterable[str], include_path: str | os.PathLike | None = None) -> ResolvedTasks:
    """Expand aliases and build the smallest TaskManager that knows every requested task.

    Raises ConfigError for an empty list, a bad include path, or an unknown task name.
    """
    requested = split_task_list(tasks)
    if not requested:
        raise ConfigError("no task given: pass --tasks, e.g. --tasks lambada,wikitext")
    names = expand_aliases(requested)

    user_paths: list[Path] = []
    local: set[str] = set()
    if include_path is not None:
        path = Path(include_path).expanduser()
        _check_include_folder(include_path)
        user_paths.append(path.resolve())
        manager = _task_manager(user_paths, include_defaults=False)
        local = set(manager.all_tasks)
        if not local:
            raise ConfigError(f"--include-path {include_path}: {_why_no_tasks(path)}")
    shipped = builtin_tasks.builtin_task_paths(names)
    if shipped:
        user_paths += shipped
        manager = _task_manager(user_paths, include_defaults=False)
        local = set(manager.all_tasks)
    if user_paths and all(n in local for n in names):
        return ResolvedTasks(names, manager, "include-path")

    rest = [n for n in names if n not in local]
    builtin_root = _builtin_tasks_dir()
    folders = [builtin_root / _BUILTIN_FOLDERS[n] for n in rest if n in _BUILTIN_FOLDERS]
    if len(folders) == len(rest) and all(f.is_dir() for f in folders):
        # Built-ins first, the user's folder last: later paths override earlier ones, as in lm-eval.
        manager = _task_manager(list(dict.fromkeys(folders)) + user_paths, include_defaults=False)
        if all(n in manager.all_tasks for n in names):
            return ResolvedTasks(names, manager, "known-folders")

    # A built-in task name is written literally in some YAML under lm_eval/tasks: a name found in
    # none of them is unknown, which a text scan decides without building the full index (the far
    # slower step; timings in benchmarks/README.md).
    mentioned, candidates = _scan_builtin_yamls(builtin_root, rest)
    unknown = [n for n in rest if n not in mentioned]
    if unknown:
        raise unknown_task_error(unknown, [*ALIASES, *local, *candidates])
    manager = _task_manager(user_paths, include_defaults=True)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise unknown_task_error(unknown, [*ALIASES, *known])
    return ResolvedTasks(names, manager, "full")


_DECLARED_NAME = re.compile(r"^(?:task|group):\s*[\"']?([^\s\"'#]+)", re.MULTILINE)


def _scan_builtin_yamls(root: Path, names: Sequence[str]) -> tuple[set[str], set[str]]:
    """Which of `names` occur in the text of lm-eval's built-in YAMLs, and the task/group names declared there."""
    mentioned: set[str] = set()
    declared: set[str] = set()
    for folder, _, files in os.walk(root):
        for file in files:
            if not file.endswith((".yaml", ".yml")):
                continue
            try:
                text = Path(folder, file).read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            mentioned.update(n for n in names if n not in mentioned and n in text)
            declared.update(_DECLARED_NAME.findall(text))
    return mentioned, declared


_HUB_NAME = re.compile(r"'([^']+)' on the Hub")


def _dataset_of(manager: Any, name: str, exc: BaseException) -> str:
    match = _HUB_NAME.search(str(exc))
    if match:
        return match.group(1)
    entry = manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None) or {}
    return str(cfg.get("dataset_path") or f"the dataset of {name}")


def load_tasks(resolved: ResolvedTasks) -> list[Any]:
    """Build the lm-eval Task/Group objects (downloading or reading their datasets), in request order.

    Raises DataError when a dataset is neither cached nor reachable, or a local data file is missing.
    """
    manager = resolved.manager
    objects: list[Any] = []
    seen: set[str] = set()
    for name in resolved.names:
        if name in seen:
            continue
        try:
            loaded = manager.load([name])
        except ConnectionError as exc:
            dataset = _dataset_of(manager, name, exc)
            raise DataError(
                f"task {name!r} needs the dataset {dataset!r}, which is not in the local cache and the "
                "Hugging Face hub is unreachable: run once online to cache it, set HF_DATASETS_CACHE to a "
                "cache that holds it, or use --include-path with local task YAMLs"
            ) from None
        except FileNotFoundError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"task {name!r}: data not found ({first}); use absolute data_files paths") from None
        groups, tasks = loaded.get("groups", {}), loaded["tasks"]
        if name in groups:
            objects.append(groups[name])
            seen.update(tasks)
        elif name in tasks:
            objects.append(tasks[name])
        else:  # a tag: it stands for several tasks
            objects.extend(t for n, t in tasks.items() if n not in seen)
            seen.update(tasks)
        seen.add(name)
    return objects


def _why_no_tasks(folder: Path) -> str:
    """Why lm-eval found no task under `folder` (it skips a YAML it cannot read with a log line only)."""
    import yaml

    class _Loader(yaml.SafeLoader):  # lm-eval's own tags (!function ...) are not this check's business
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    files = sorted(f for f in folder.rglob("*") if f.suffix in (".yaml", ".yml") and f.is_file())
    if not files:
        return "no lm-eval task YAML found in it"
    for file in files:
        try:
            doc = yaml.load(file.read_text(errors="replace"), Loader=_Loader)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            return f"{file.name} is not valid YAML{line}: {problem}"
        if not isinstance(doc, dict) or not ({"task", "group"} & set(doc)):
            return f"{file.name} is not an lm-eval task (no 'task:' key)"
    return f"lm-eval found no task in its {len(files)} YAML file(s); check their 'task:' and dataset keys"


def _check_include_folder(include_path: str | os.PathLike) -> None:
    """ConfigError when --include-path is missing (saying where a relative one was looked for) or a file."""
    path = Path(include_path).expanduser()
    if not path.exists():
        where = f" (looked for in {Path.cwd()})" if not path.is_absolute() else ""
        raise ConfigError(f"--include-path {include_path} does not exist{where}")
    if not path.is_dir():
        raise ConfigError(f"--include-path {include_path}: not a folder of lm-eval task YAML files")


# A Jinja expression that only reads a field: `{{text}}`, `{{doc.question}}`, `{{choices[0]}}`
_PLAIN_FIELD = re.compile(r"""\s*[A-Za-z_][\w.]*(\[\s*(\d+|'[^']*'|"[^"]*")\s*\])*\s*""")
_CODE_KEYS = re.compile(r"(^|[\s{,])(include|trust_remote_code)\s*:", re.M)
_MAX_YAML_BYTES = 1 << 20


def task_code(include_path: str | os.PathLike) -> str | None:
    """Why the task folder runs code, or None for plain YAML (fields read, nothing called): a Python
    file, a `!function` tag, an `include:` of another file, `trust_remote_code`, a Jinja statement
    (`{% ... %}`) or an expression that does more than read a field (a call, a filter, arithmetic)."""
    root = Path(include_path).expanduser()
    if any(root.rglob("*.py")):
        return "it holds Python files"
    for file in sorted(p for pattern in ("*.yaml", "*.yml") for p in root.rglob(pattern)):
        with file.open("rb") as f:
            text = f.read(_MAX_YAML_BYTES + 1).decode("utf-8", errors="replace")
        name = file.relative_to(root)
        if len(text) > _MAX_YAML_BYTES:
            return f"{name} is larger than a task file reads"
        if "!function" in text:
            return f"{name} imports Python (!function)"
        if re.search(r"(^|[\s:\[{,-])!\S", text, re.M):
            return f"{name} has a YAML tag"
        if match := _CODE_KEYS.search(text):
            return f"{name} has {match.group(2)}:"
        if "{%" in text:
            return f"{name} has a Jinja statement"
        for expression in re.findall(r"\{\{(.*?)\}\}", text, re.S):
            if not _PLAIN_FIELD.fullmatch(expression) or "__" in expression:
                return f"{name} has a Jinja template that computes ({{{{{expression.strip()[:40]}}}}})"
    return None


def check_task_code_trusted(include_path: str | os.PathLike | None, trusted: bool) -> None:
    """ConfigError unless `include_path` is None, is plain YAML (:func:`task_code`), or the user said
    they trust it (--trust-task-code).

    A task folder can be code, not data: a YAML `!function` tag imports the folder's Python, and
    lm-eval renders prompt templates with Jinja, which can reach os.system from a YAML file. Like a
    checkpoint's auto_map it runs only on request; plain YAML and the shipped aliases need no flag."""
    if include_path is None:
        return
    _check_include_folder(include_path)  # a missing folder is said at once, trusted or not
    if trusted:
        return
    why = task_code(include_path)
    if why is not None:
        raise ConfigError(
            f"--include-path {include_path}: the task folder is code ({why}; Jinja templates can run commands); "
            "pass --trust-task-code to use it, only for folders you trust"
        )


MAX_LIMIT = 10**9  # documents per task: far beyond any task, far below what overflows lm-eval's arithmetic
MAX_FEWSHOT = 10_000


def check_counts(limit: int | None, num_fewshot: int) -> None:
    """ConfigError for a --limit or --num-fewshot too large to mean anything (2**63 overflows later)."""
    if isinstance(limit, int) and limit > MAX_LIMIT:
        raise ConfigError(f"--limit {limit}: at most {MAX_LIMIT:,} documents per task (leave it out to score all)")
    if isinstance(num_fewshot, int) and num_fewshot > MAX_FEWSHOT:
        raise ConfigError(f"--num-fewshot {num_fewshot}: at most {MAX_FEWSHOT:,} examples per prompt")


def check_fewshot_docs(task_objects: Sequence[Any], num_fewshot: int) -> None:
    """ConfigError when a task has fewer documents to draw --num-fewshot examples from than asked
    (lm-eval would fail mid-run sampling them; one more is needed when they come from the scored split)."""
    if num_fewshot <= 0:
        return
    for task in task_objects:
        fewshot_docs = getattr(task, "fewshot_docs", None)
        if not callable(fewshot_docs):
            continue  # a group: its tasks are checked by lm-eval
        try:
            docs = fewshot_docs()
            available = len(docs) if docs is not None else None
        except Exception:  # noqa: BLE001 - a task without countable documents is lm-eval's to judge
            continue
        if available is not None and available <= num_fewshot:
            name = getattr(task, "task_name", None) or getattr(getattr(task, "config", None), "task", "?")
            raise ConfigError(
                f"--num-fewshot {num_fewshot}: task {name!r} has only {available} documents to draw "
                f"examples from; use at most {max(available - 1, 0)}"
            )


def list_local_tasks(include_path: str | os.PathLike) -> list[str]:
    """Task names defined by the YAML files under `include_path` (for --list-tasks)."""
    path = Path(include_path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--include-path {include_path}: not a folder of lm-eval task YAML files")
    return list(_task_manager([path.resolve()], include_defaults=False).all_tasks)
