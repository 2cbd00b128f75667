"""Pieces of merit eval that need no model: aliases, checkpoint folders, request chunks, result rows, JSON."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from merit_core.checkpoint.state import NOT_VERIFIED
from merit_core.errors import CheckpointError, ConfigError
from merit_core.evaluation.checkpoint import resolve_checkpoint
from merit_core.evaluation.results import CheckpointResult, format_value, metric_rows, write_results_json
from merit_core.evaluation.tasks import ALIASES, expand_aliases, split_task_list, unknown_task_error


def test_aliases_expand_in_order_without_duplicates():
    assert split_task_list(["lambada, wikitext", "lambada", " "]) == ["lambada", "wikitext"]
    assert expand_aliases(["lambada", "wikitext", "superglue", "lambada_openai", "hellaswag"]) == [
        "lambada_openai",
        "lambada_standard",
        "wikitext",
        "boolq",
        "cb",
        "copa",
        "multirc",
        "record",
        "sglue_rte",
        "wic",
        "wsc",
        "hellaswag",
    ]
    assert ALIASES["superglue"].tasks == ("boolq", "cb", "copa", "multirc", "record", "sglue_rte", "wic", "wsc")
    message = str(unknown_task_error(["wikitxt"], [*ALIASES, "wikitext_local"]))
    assert "'wikitxt' (did you mean wikitext" in message and "\n" not in message


def _model_folder(path: Path, state: dict | str | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (path / name).write_text("{}")
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))  # eval checks the weights are complete
    if state is not None:
        (path / "trainer_state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    return path


def test_run_folder_means_its_latest_complete_step(tmp_path):
    run = tmp_path / "run"
    _model_folder(run / "step_90", {"step": 90, "optimizer": "merit", "global_batch_size": 4096})
    _model_folder(run / "step_100", {"step": 100, "optimizer": "merit", "global_batch_size": 4096, "seq_len": 1024})
    (run / "step_200").mkdir()  # no config.json yet: an unfinished save
    _model_folder(run / "step_300.tmp")
    ref = resolve_checkpoint(run)
    assert ref.location == str((run / "step_100").resolve()) and ref.label == "run/step_100"
    assert ref.meta == {
        "source": "merit-train",
        "optimizer": "merit",
        "step": 100,
        "global_batch_size": 4096,
        "seq_len": 1024,
    }


def test_trainer_state_is_read_defensively(tmp_path):
    """A trainer_state.json that is not JSON, not an object, or holds fields of the wrong type cannot be
    verified: refused in one line; with verify=False (--no-verify) it is no metadata, and eval goes on."""
    assert resolve_checkpoint(_model_folder(tmp_path / "plain")).meta == {"source": "hf-folder"}
    odd = {"step": "7", "optimizer": "lamb", "global_batch_size": True, "tokens": 5}
    for name, state in (("corrupt", "{not json"), ("list", "[1, 2]"), ("odd", odd)):
        folder = _model_folder(tmp_path / name, state)
        with pytest.raises(CheckpointError, match="trainer_state.json"):
            resolve_checkpoint(folder)
        ref = resolve_checkpoint(folder, verify=False)
        assert ref.meta == {"source": "hf-folder"} and ref.notes == ["checksums not verified (--no-verify)"]
    old = _model_folder(tmp_path / "old", {"step": 7, "optimizer": "lamb", "tokens": 5})  # before checksums
    ref = resolve_checkpoint(old)
    assert ref.meta == {"source": "merit-train", "optimizer": "lamb", "step": 7, "tokens": 5}
    assert ref.notes == [NOT_VERIFIED]


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        resolve_checkpoint(tmp_path / "missing")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_checkpoint(tmp_path / "weights.safetensors")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        resolve_checkpoint(tmp_path / "notok")
    with pytest.raises(CheckpointError, match="org/model is not in the hub cache"):  # a hub model, offline
        resolve_checkpoint("org/model")
    assert resolve_checkpoint("gpt2").is_local is False  # a bare hub name passes to transformers


def test_request_chunks_give_the_results_of_one_call():
    from merit_core.evaluation.harness import report_request_progress

    class Req:
        def __init__(self, text):
            self.args = (text, "x")

    class FakeLM:
        def loglikelihood(self, requests, disable_tqdm=False):
            return [(float(len(r.args[0])), False) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            self.rolling_batches.append([len(r.args[0]) for r in requests])
            return [float(len(r.args[0])) for r in requests]

    lm, seen = FakeLM(), []
    lm.rolling_batches = []
    report_request_progress(lm, lambda e: seen.append((e.stage.split()[0], e.done, e.total)), min_chunk=4)
    sizes = (3, 9, 1, 7, 5, 2, 8, 6, 4, 10)
    requests = [Req("a" * n) for n in sizes]
    assert lm.loglikelihood(requests) == [(float(n), False) for n in sizes]
    assert seen == [
        ("loglikelihood", 0, 10),
        ("loglikelihood", 4, 10),
        ("loglikelihood", 8, 10),
        ("loglikelihood", 10, 10),
    ]
    assert lm.loglikelihood_rolling(requests[:6]) == [3.0, 9.0, 1.0, 7.0, 5.0, 2.0]
    assert lm.rolling_batches == [[3, 9, 1, 7], [5, 2]]  # rolling requests keep their order


def _record(label, results, hib=None):
    return CheckpointResult(
        path=f"/runs/{label}", label=label, results=results, meta={"eval": {"higher_is_better": hib or {}}}
    )


def test_metric_rows_align_checkpoints():
    a = _record(
        "a",
        {
            "lam": {
                "alias": "lam",
                "sample_len": 3,
                "acc,none": 0.5,
                "acc_stderr,none": 0.1,
                "perplexity,none": 12.0,
                "perplexity_stderr,none": "N/A",
            }
        },
        {"lam": {"acc": True, "perplexity": False}},
    )
    b = _record(
        "b",
        {
            "lam": {"acc,none": 0.75, "acc_stderr,none": 0.05},
            "gen": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01},
        },
    )
    rows = metric_rows([a, b])
    assert [(r.task, r.metric, r.higher_is_better) for r in rows] == [
        ("lam", "acc", True),
        ("lam", "perplexity", False),
        ("gen", "exact_match (strict-match)", None),
    ]
    assert rows[0].values == (0.5, 0.75) and rows[0].stderrs == (0.1, 0.05)
    assert rows[1].values == (12.0, None) and rows[1].stderrs == (None, None)
    assert rows[2].values == (None, 0.25)
    assert format_value(0.5, 0.1) == "0.5000 ± 0.1000"
    assert format_value(2208149.12) == "2.208e+06" and format_value(None) == "-"


def test_json_is_written_atomically(tmp_path, monkeypatch):
    import numpy as np

    out = tmp_path / "deep" / "er" / "results.json"
    record = _record("a", {"lam": {"acc,none": np.float32(0.5), "acc_stderr,none": "N/A"}})
    write_results_json(out, [record])
    assert json.loads(out.read_text()) == {
        "checkpoints": [
            {
                "path": "/runs/a",
                "results": {"lam": {"acc,none": 0.5, "acc_stderr,none": "N/A"}},
                "meta": {"eval": {"higher_is_better": {}}},
            }
        ]
    }

    # A failure half-way leaves the previous file and no temp file behind.
    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_results_json(out, [_record("b", {})])
    assert json.loads(out.read_text())["checkpoints"][0]["path"] == "/runs/a"
    assert sorted(p.name for p in out.parent.iterdir()) == ["results.json"]
    monkeypatch.undo()
    # A folder gets a new results-<time>.json, never the file another writer took in the same second.
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    first = write_results_json(tmp_path, [record], now)
    second = write_results_json(tmp_path, [_record("b", {})], now)
    assert (first.name, second.name) == ("results-20260102T030405.json", "results-20260102T030405-2.json")
    assert json.loads(first.read_text())["checkpoints"][0]["path"] == "/runs/a"


def test_settings_are_validated():
    from merit_core.evaluation.harness import EvalSettings, parse_batch_size

    assert parse_batch_size("auto") == "auto" and parse_batch_size("16") == 16
    for bad in (
        {"limit": 0},
        {"limit": -3},
        {"num_fewshot": -1},
        {"batch_size": "0"},
        {"batch_size": "big"},
        {"bootstrap_iters": -1},
        {"dtype": "float64"},
    ):
        with pytest.raises(ConfigError):
            EvalSettings(tasks=["x"], **bad).validated()


def test_cli_import_stays_light():
    code = textwrap.dedent("""
        import sys
        from click.testing import CliRunner
        from merit_cli.main import cli
        assert CliRunner().invoke(cli, ["--help"]).exit_code == 0
        assert CliRunner().invoke(cli, ["eval", "--help"]).exit_code == 0
        import merit_core.evaluation
        print(sorted(m for m in ("lm_eval", "torch", "transformers", "datasets") if m in sys.modules))
    """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("task: broken\ndataset_path: [unclosed\n", r"broken\.yaml is not valid YAML \(line \d+\)"),
        ("dataset_path: json\noutput_type: loglikelihood\n", r"broken\.yaml is not an lm-eval task \(no 'task:' key\)"),
    ],
)
def test_a_broken_task_yaml_is_named_with_what_is_wrong(tmp_path, text, expected):
    from merit_core.evaluation.tasks import resolve_tasks

    (tmp_path / "broken.yaml").write_text(text)
    with pytest.raises(ConfigError, match=expected) as err:
        resolve_tasks(["broken"], str(tmp_path))
    assert "\n" not in str(err.value)


def test_an_include_path_without_yaml_says_so(tmp_path):
    from merit_core.evaluation.tasks import resolve_tasks

    (tmp_path / "notes.txt").write_text("no tasks here")
    with pytest.raises(ConfigError, match="no lm-eval task YAML found in it"):
        resolve_tasks(["x"], str(tmp_path))
