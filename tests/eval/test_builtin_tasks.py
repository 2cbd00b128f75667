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


@pytest.mark.slow
def test_eval_builtin_scores_a_fresh_run_offline(model_cfg, data_dir, tmp_path):
    run, out = tmp_path / "run", tmp_path / "scores.json"
    sets = {"batch_size": 4, "micro_batch_size": 4, "seq_len": 16, "eval_every": 1, "eval_batches": 1}
    args = ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(run), "--steps", "1"]
    trained = CliRunner().invoke(cli, args + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    assert trained.exit_code == 0, trained.output
    assert "--tasks builtin" in trained.output  # the hub is offline in tests: Next offers the offline tasks

    result = CliRunner().invoke(cli, ["eval", str(run), "--tasks", "builtin", "--limit", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())["checkpoints"][0]
    assert record["meta"]["eval"]["tasks"] == list(TASK_NAMES)
    perplexity, lastword = (record["results"][name] for name in TASK_NAMES)
    assert perplexity["byte_perplexity,none"] > 1 and perplexity["word_perplexity,none"] > 1
    assert perplexity["bits_per_byte,none"] == pytest.approx(math.log2(perplexity["byte_perplexity,none"]), rel=1e-9)
    assert 0 <= lastword["acc,none"] <= 1 and lastword["perplexity,none"] > 1
    assert record["meta"]["eval"]["n-samples"] == {name: {"original": n, "effective": 4} for name, n in _sizes()}


def _sizes():
    docs = held_out_documents()
    return [(TASK_NAMES[0], len(docs)), (TASK_NAMES[1], len(last_word_items(docs)))]
