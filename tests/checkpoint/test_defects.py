"""What a diverged run or an edited config.json leaves: NaN in W_Q is reported by `merit inspect`, which
goes on; weights with more layers than config.json says are refused by `merit eval` as by inspect."""

import json
import math

import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.errors import CheckpointError
from merit_core.evaluation.checkpoint import check_layers, check_weight_files
from tests.tiny_models import tiny_gpt2, tiny_llama


def test_nan_in_w_q_is_named_and_inspect_goes_on(tmp_path):
    model = tiny_llama()
    with torch.no_grad():  # in the last layer: layer 0's input stays finite
        model.model.layers[1].self_attn.q_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "diverged")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        cli, ["inspect", str(tmp_path / "diverged"), "--json", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "layer 1: W_Q holds non-finite values (NaN or infinite): no spectral bound for it" in result.output
    (ckpt,) = json.loads(out.read_text())["checkpoints"]
    layers = ckpt["layers"]
    assert layers[1]["spectral_logit_bound"] is None  # NaN: no bound holds, null in the JSON
    assert layers[0]["spectral_logit_bound"] is not None and math.isfinite(layers[0]["spectral_logit_bound"])


def test_eval_refuses_weights_with_more_layers_than_the_config_says(tmp_path):
    folder = tmp_path / "three"
    tiny_gpt2(n_layer=3).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 2}))
    files = check_weight_files(folder)
    try:
        check_layers(folder, files)
    except CheckpointError as exc:
        said = str(exc)
    else:
        raise AssertionError("a config that says 2 layers of 3 was accepted")
    assert said.endswith("does not match the weights: n_layer=2 but the weights have 3 layers")
    inspected = CliRunner().invoke(cli, ["inspect", str(folder), "--no-logits"])
    assert inspected.exit_code == 2 and "n_layer=2 but the weights have 3 layers" in inspected.output  # as inspect


def test_eval_takes_weights_that_match_their_config(tmp_path):
    tiny_gpt2(n_layer=3).save_pretrained(tmp_path / "ok")
    check_layers(tmp_path / "ok", check_weight_files(tmp_path / "ok"))  # no error
