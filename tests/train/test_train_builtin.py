"""`merit train` without --data: the built-in corpus is prepared, cached, and trained on."""

import json

from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.metrics import read_metrics
from tests.prepared_data import write_tiny_model_config


def test_train_on_the_builtin_corpus(tmp_path):
    from transformers import AutoTokenizer

    from merit_core.data import load_meta, resolve_data

    model = write_tiny_model_config(tmp_path / "model")
    out = tmp_path / "run"
    args = [
        "train",
        "--model",
        str(model),
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--set",
        "eval_batches=1",
        "--set",
        "eval_batch_size=2",
        "--set",
        "log_every=1",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + result.stderr + repr(result.exception)
    meta = load_meta(resolve_data(None))  # cached now: the same folder
    assert meta.vocab_size == 4096 and meta.train_tokens > 100_000 and "stdlib" in meta.source
    assert str(meta.path) in result.output.replace("\n", "")
    # no --lr: the registry's measured lr for the nearest measured model, and the start line says so
    start = " ".join(result.output.split())
    # a model given as a config.json has no lr-table entry of its own: extrapolated, and under the cap
    # (the start line's short account, merit_cli.train_cmd.lr_source: the entry it scaled, under its cap)
    assert "with merit, lr 0.00707 (extrapolated from the lr measured for gpt2-tiny at batch 2 x 128, 0.01; " in start
    assert "run: results/compare-cpu)" in start
    ckpt = out / "step_3"
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == meta.vocab_size
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.decode(tok("Return the sum of the arguments.")["input_ids"]) == "Return the sum of the arguments."
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 3 and all(8.0 < x < 8.6 for x in losses)  # ~ln(4096) = 8.32 at initialisation
