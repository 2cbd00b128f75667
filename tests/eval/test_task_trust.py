"""Which --include-path folders need --trust-task-code (merit_core.evaluation.tasks.task_code): plain YAML
that only reads fields does not; Python, !function, YAML tags, includes, Jinja statements and templates
that compute do. A missing folder says it does not exist, and where a relative one was looked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from merit_core.errors import ConfigError
from merit_core.evaluation.tasks import check_task_code_trusted, resolve_tasks, task_code

ROOT = Path(__file__).resolve().parents[2]
PLAIN = 'task: t\ndataset_path: json\noutput_type: loglikelihood\ndoc_to_text: "{{question}}"\n'


def _folder(tmp_path: Path, yaml: str, extra: dict[str, str] | None = None) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text(yaml)
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize(
    "target", ['"{{text}}"', '"{{doc.answer}}"', '"{{choices[0]}}"', "\"{{ choices['a'] }}\"", "answer"]
)
def test_plain_yaml_reading_fields_needs_no_trust(tmp_path, target):
    folder = _folder(tmp_path, PLAIN + f"doc_to_target: {target}\n")
    assert task_code(folder) is None
    check_task_code_trusted(folder, trusted=False)  # no error


@pytest.mark.parametrize(
    ("yaml", "extra", "why"),
    [
        (PLAIN, {"utils.py": "print(1)\n"}, "Python files"),
        (PLAIN + "process_docs: !function utils.process\n", None, "!function"),
        (PLAIN + "doc_to_target: !!python/name:os.system\n", None, "YAML tag"),
        (PLAIN + "include: ../other.yaml\n", None, "include:"),
        (PLAIN + "dataset_kwargs: {trust_remote_code: true}\n", None, "trust_remote_code:"),
        (PLAIN + 'doc_to_target: "{% for x in y %}{{x}}{% endfor %}"\n', None, "Jinja statement"),
        (PLAIN + "doc_to_target: \"{{ text.rsplit(' ', 1)[1] }}\"\n", None, "computes"),
        (PLAIN + 'doc_to_target: "{{ text | upper }}"\n', None, "computes"),
        (PLAIN + 'doc_to_target: "{{ cycler.__init__.__globals__.os }}"\n', None, "computes"),
    ],
)
def test_code_in_a_task_folder_needs_trust(tmp_path, yaml, extra, why):
    folder = _folder(tmp_path, yaml, extra)
    assert why in (task_code(folder) or "")
    with pytest.raises(ConfigError, match=r"--trust-task-code") as refused:
        check_task_code_trusted(folder, trusted=False)
    assert why in str(refused.value) and "\n" not in str(refused.value)
    check_task_code_trusted(folder, trusted=True)


def test_the_shipped_examples_last_word_computes_and_perplexity_is_plain():
    assert "computes" in (task_code(ROOT / "examples" / "eval-task") or "")
    assert task_code(ROOT / "examples" / "eval-perplexity") is None


def test_a_missing_include_path_says_it_does_not_exist_and_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for check in (lambda: check_task_code_trusted("examples/eval-task", False), lambda: resolve_tasks("t", "nope")):
        with pytest.raises(ConfigError, match=rf"does not exist \(looked for in {tmp_path}\)$"):
            check()
