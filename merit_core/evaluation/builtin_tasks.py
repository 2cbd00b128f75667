"""Offline evaluation tasks on the built-in corpus's held-out text: `merit eval RUN --tasks builtin`.

The hub's tasks (LAMBADA, WikiText, SuperGLUE) need their datasets downloaded once; these two need
nothing but the Python standard library whose docstrings are the built-in corpus
(merit_core.data.builtin):

- `builtin_perplexity`: rolling log-likelihood of each held-out document (word and byte perplexity,
  bits per byte), as lm-eval's `wikitext` task scores WikiText;
- `builtin_lastword`: each held-out document cut at its last word, the model scoring that word
  (perplexity, and accuracy: whether greedy decoding gives exactly that word), as LAMBADA does.

Held out means: documents the built-in corpus's validation split always contains. `prepare_builtin`
holds out whole documents in the order of a permutation seeded with 0 until it has
BUILTIN_VAL_FRACTION of the tokens; the tasks take the first documents of that same order up to
half that fraction of the characters, so they stay inside the validation split whatever tokenizer a
run used (a tokenizer would need twice the average tokens per character on exactly these documents
to push one of them out).

The tasks are ordinary lm-eval task YAMLs with their data as JSON lines, written once per Python
version into merit's cache folder and passed to lm-eval like an --include-path folder.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from merit_core.durable_writes import atomic_write
from merit_core.paths import cache_dir

ALIAS = "builtin"
PERPLEXITY_TASK = "builtin_perplexity"
LASTWORD_TASK = "builtin_lastword"
TASK_NAMES = (PERPLEXITY_TASK, LASTWORD_TASK)
TASK_SHARE = 0.5  # of BUILTIN_VAL_FRACTION, counted in characters; see the module docstring
FORMAT = "v1"  # bump when the tasks' text or YAML change, so that a stale cache is not reused

# A last word: letters only (LAMBADA's targets are words), at least 3 of them, after whitespace.
_LAST_WORD = re.compile(r"^(?P<context>.*\S)\s+(?P<word>[A-Za-z]{3,})[^\w\s]*\s*$", re.DOTALL)


def held_out_documents(seed: int = 0) -> list[str]:
    """The held-out documents of the built-in corpus the tasks score, in a fixed order."""
    import numpy as np

    from merit_core.data.builtin import BUILTIN_VAL_FRACTION, builtin_corpus_documents  # numpy: not at eval --help

    docs = builtin_corpus_documents()
    order = np.random.default_rng(seed).permutation(len(docs))
    budget = TASK_SHARE * BUILTIN_VAL_FRACTION * sum(map(len, docs))
    chosen: list[str] = []
    used = 0
    for index in order:
        if chosen and used + len(docs[index]) > budget:
            break
        chosen.append(docs[index])
        used += len(docs[index])
    return chosen


def last_word_items(documents: list[str]) -> list[dict[str, str]]:
    """{'context', 'target'} per document that ends in a word: the text before it, and ' word'."""
    items = []
    for doc in documents:
        match = _LAST_WORD.match(doc)
        if match:
            items.append({"context": match.group("context"), "target": " " + match.group("word")})
    return items


class _Task(NamedTuple):
    """One built-in task: its JSON-lines file and the rows it holds, how lm-eval scores a row (the
    output type and the prompt fields) and its metrics as (name, aggregation, higher is better)."""

    data: str
    rows: Callable[[list[str]], list[dict[str, str]]]
    output_type: str
    fields: dict[str, str]
    metrics: tuple[tuple[str, str, bool], ...]


_TASKS = {
    PERPLEXITY_TASK: _Task(
        "documents.jsonl",
        lambda docs: [{"text": d} for d in docs],
        "loglikelihood_rolling",
        {"doc_to_text": "", "doc_to_target": "{{text}}"},
        (
            ("word_perplexity", "weighted_perplexity", False),
            ("byte_perplexity", "weighted_perplexity", False),
            ("bits_per_byte", "bits_per_byte", False),
        ),
    ),
    LASTWORD_TASK: _Task(
        "lastword.jsonl",
        last_word_items,
        "loglikelihood",
        {"doc_to_text": "{{context}}", "doc_to_target": "{{target}}"},
        (("perplexity", "perplexity", False), ("acc", "mean", True)),
    ),
}


def _task_yaml(name: str, task: _Task, data: Path) -> str:
    """An lm-eval task YAML (JSON is YAML), reading its test split from the JSON-lines file `data`."""
    spec = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "output_type": task.output_type,
        "test_split": "test",
        **task.fields,
        "metric_list": [
            {"metric": metric, "aggregation": aggregation, "higher_is_better": higher}
            for metric, aggregation, higher in task.metrics
        ],
        "metadata": {"version": 1.0, "source": "merit: built-in corpus, held-out documents"},
    }
    return json.dumps(spec, indent=2) + "\n"


def builtin_task_dir() -> Path:
    """The folder of the two task YAMLs and their data, written on first use and then reused."""
    version = ".".join(map(str, sys.version_info[:3]))
    folder = cache_dir("eval", f"builtin-tasks-py{version}-{FORMAT}")
    yamls = {name: folder / f"{name}.yaml" for name in _TASKS}
    if all(path.is_file() for path in yamls.values()):
        return folder
    docs = held_out_documents()
    for task in _TASKS.values():  # the data first: a YAML that exists says its task is complete
        atomic_write(folder / task.data, "".join(json.dumps(row) + "\n" for row in task.rows(docs)))
    for name, task in _TASKS.items():
        atomic_write(yamls[name], _task_yaml(name, task, folder / task.data))
    return folder


def builtin_task_paths(names: list[str]) -> list[Path]:
    """[the built-in tasks' folder] when `names` asks for one of them, else []."""
    return [builtin_task_dir().resolve()] if any(n in TASK_NAMES for n in names) else []
