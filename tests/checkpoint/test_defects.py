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


def test_a_safetensors_header_that_starts_like_a_pickle_is_read(tmp_path):
    """A header length whose low byte is 0x80 and next byte 2..5 (a pickle's protocol mark) is still a
    safetensors file: the JSON header that follows says so. A real pickle is refused."""
    import pickle

    from safetensors.torch import save_file

    from merit_core.checkpoint.safe import validate_safetensors

    path = tmp_path / "w.safetensors"
    for pad in range(0, 2000):  # a metadata string sized so that the header is 0x280 + 0x100*k bytes long
        save_file({"w": torch.zeros(2, 3)}, str(path), metadata={"pad": "x" * pad})
        head = path.read_bytes()[:9]
        if head[0] == 0x80 and 2 <= head[1] <= 5:
            break
    else:
        raise AssertionError("no header length of the pickle-like form was reached")
    assert head[8:9] == b"{"
    assert list(validate_safetensors(path)) == ["w"]
    fake = tmp_path / "p.safetensors"
    fake.write_bytes(pickle.dumps({"w": [1.0] * 4}, protocol=4))
    try:
        validate_safetensors(fake)
    except CheckpointError as exc:
        assert "a pickle file" in str(exc)
    else:
        raise AssertionError("a pickle was not refused")
