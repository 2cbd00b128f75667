"""`merit train` takes a config.json of any supported family; runs resume and inspect (GPT-NeoX's renamed
output head, Gemma 2's soft-capped eager attention)."""

import json

import pytest

from tests.cli_runs import invoke
from tests.models.family_models import tiny_config

SETS = dict(batch_size=4, seq_len=32, eval_every=2, save_every=2, log_every=1, eval_batches=1, eval_batch_size=2)


@pytest.mark.parametrize("model_type", ["gpt_neox", "gemma2"])
def test_train_resume_and_inspect_a_family_config(model_type, data_dir, tmp_path):
    tiny_config(model_type).save_pretrained(tmp_path / "cfg")
    out = tmp_path / "run"
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    args = ["train", "--model", str(tmp_path / "cfg" / "config.json"), "--data", str(data_dir), "--out", str(out)]
    res = invoke([*args, *sets, "--steps", "2"])
    assert res.exit_code == 0, res.output
    res = invoke(["train", "--resume", "--out", str(out), "--steps", "4"])
    assert res.exit_code == 0, res.output
    assert (out / "step_4" / "model.safetensors").is_file()
    report = tmp_path / "inspect.json"
    res = invoke(["inspect", str(out / "step_4"), "--seq-len", "16", "--json", str(report)])
    assert res.exit_code == 0, res.output
    (c,) = json.loads(report.read_text())["checkpoints"]
    assert c["architecture"] == model_type and c["probe"]["n_tokens"] == 16
    assert all(isinstance(layer["max_attention_logit"], float) for layer in c["layers"])
