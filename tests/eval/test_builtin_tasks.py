"""`merit eval RUN --tasks builtin`: the offline tasks on the built-in corpus's held-out text."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.data.builtin import BUILTIN_VAL_FRACTION, builtin_corpus_documents
from merit_core.data.prepare import choose_validation
from merit_core.evaluation.builtin_tasks import TASK_NAMES, held_out_documents, last_word_items


def test_last_word_items_cut_at_the_last_word():
    items = last_word_items(["Return the number of items.", "ends in a symbol ->", "x = 1", "Two\nlines here"])
    assert items == [
        {"context": "Return the number of", "target": " items"},
        {"context": "Two\nlines", "target": " here"},
    ]


@pytest.mark.parametrize("chars_per_token", [1.0, 3.0, 5.0])
def test_task_documents_lie_in_the_validation_split(chars_per_token):
    """Whatever the tokenizer's rate, the documents scored are among those `prepare_builtin` holds out."""
    docs = builtin_corpus_documents()
    lengths = np.array([math.ceil(len(d) / chars_per_token) + 1 for d in docs])  # + the end-of-text token
    held_out = {docs[i] for i in np.flatnonzero(choose_validation(lengths, BUILTIN_VAL_FRACTION, 0, "builtin"))}
    scored = held_out_documents()
    assert len(scored) >= 20 and all(doc in held_out for doc in scored)


@pytest.fixture(scope="module")
def fresh_run(model_cfg, data_dir, tmp_path_factory):
    """A `merit train` run of one step, and its output (the hub is offline in tests)."""
    run = tmp_path_factory.mktemp("fresh") / "run"
    sets = {"batch_size": 4, "micro_batch_size": 4, "seq_len": 16, "eval_every": 1, "eval_batches": 1}
    args = ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(run), "--steps", "1"]
    trained = CliRunner().invoke(cli, args + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    assert trained.exit_code == 0, trained.output
    return run, trained.output


@pytest.mark.slow
def test_eval_builtin_scores_a_fresh_run_offline(fresh_run, tmp_path):
    run, train_output = fresh_run
    assert "--tasks builtin" in train_output  # the hub is unreachable: Next offers the offline tasks
    assert "1 step on" in train_output
    out = tmp_path / "scores.json"
    result = CliRunner().invoke(cli, ["eval", str(run), "--tasks", "builtin", "--limit", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())["checkpoints"][0]
    assert record["meta"]["eval"]["tasks"] == list(TASK_NAMES)
    perplexity, lastword = (record["results"][name] for name in TASK_NAMES)
    assert perplexity["byte_perplexity,none"] > 1 and perplexity["word_perplexity,none"] > 1
    assert perplexity["bits_per_byte,none"] == pytest.approx(math.log2(perplexity["byte_perplexity,none"]), rel=1e-9)
    assert 0 <= lastword["acc,none"] <= 1 and lastword["perplexity,none"] > 1
    assert record["meta"]["eval"]["n-samples"] == {name: {"original": n, "effective": 4} for name, n in _sizes()}


@pytest.mark.slow
def test_output_path_writes_lm_eval_layout_its_readers_accept(fresh_run, tmp_path, monkeypatch):
    from dataclasses import fields

    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.result_schema import EvalResults
    from lm_eval.utils import (
        get_file_datetime,
        get_latest_filename,
        get_results_filenames,
        get_sample_results_filenames,
        sanitize_model_name,
    )

    run, _ = fresh_run
    monkeypatch.chdir(run.parent)
    args = ["eval", "--model", "hf", "--model_args", "pretrained=run/step_1,dtype=float32", "--tasks", "builtin"]
    args += ["--limit", "3", "--output_path", "evals", "--log_samples", "--seed", "5"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    files = sorted(str(p.relative_to(run.parent)) for p in (run.parent / "evals").rglob("*") if p.is_file())
    results_files = get_results_filenames(files)  # lm-eval's own readers of an --output_path folder
    assert len(results_files) == 1 and results_files[0].startswith(f"evals/{sanitize_model_name('run/step_1')}/")
    assert get_latest_filename(results_files) == results_files[0]
    samples = get_sample_results_filenames(files)
    assert sorted(f.split("/samples_")[1].rsplit("_", 1)[0] for f in samples) == sorted(TASK_NAMES)
    assert {get_file_datetime(f) for f in samples} == {get_file_datetime(results_files[0]).replace(".json", "")}

    data = json.loads((run.parent / results_files[0]).read_text())
    schema = set(EvalResults.__annotations__) | {f.name for f in fields(GeneralConfigTracker)} | {"task_hashes"}
    assert set(data) <= schema  # key by key: every key is one lm-eval's schema and tracker define
    assert {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config"} <= set(data)
    assert data["model_name"] == "run/step_1" and data["model_source"] == "hf"
    assert set(data["task_hashes"]) == set(TASK_NAMES)  # computed from the logged samples
    config = data["config"]
    assert config["model_args"] == {"pretrained": "run/step_1", "dtype": "float32"} and config["limit"] == 3
    assert [config[k] for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")] == [5, 5, 5, 5]
    merit_json = json.loads(next((run.parent / "evals").glob("results-*.json")).read_text())
    assert data["results"] == merit_json["checkpoints"][0]["results"]
    lines = (run.parent / next(f for f in samples if "lastword" in f)).read_text().splitlines()
    assert len(lines) == 3 and {"doc_id", "doc", "target", "arguments", "resps", "metrics"} <= set(json.loads(lines[0]))


@pytest.mark.parametrize(
    "args, says",
    [
        (["--write_out"], "--log_samples --output_path"),
        (["--apply_chat_template"], "lm_eval itself"),
        (["--model_args", "pretrained=x,trust_remote_code=True"], "--trust-remote-code"),
        (["--log_samples"], "needs --output_path"),
        (["--seed", "1,2"], "one integer or four"),
    ],
)
def test_lm_eval_options_without_equivalent_say_what_to_use(args, says, tmp_path):
    result = CliRunner().invoke(cli, ["eval", str(tmp_path), "--tasks", "builtin", *args])
    assert result.exit_code == 2 and says in result.output, result.output


def _sizes():
    docs = held_out_documents()
    return [(TASK_NAMES[0], len(docs)), (TASK_NAMES[1], len(last_word_items(docs)))]
