"""The CONTRIBUTING recipe "add a model family", followed once: StarCoder2, a transformers
model_type merit does not ship, registered in a test with one `register_family` call and one named
size. Nothing else is edited, and then `merit train --model`, the weight statistics of `merit
inspect` (a planted max-norm in the right layer and head) and the attention-logit probe (equal to a
direct q.k computation, within the sliding window) all work on it."""

import importlib

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.diagnostics.weights import weight_stats
from merit_core.errors import ConfigError
from merit_core.models import NAMED_MODELS, FamilySpec, ModelSpec, build_model, get_family, model_config
from merit_core.models.attention_probe import max_attention_logits
from merit_core.models.families import _decoder
from merit_core.models.family import AttentionWeights, register_family
from tests.models.family_models import check_planted, direct_max_logits, plant_heads, scaled

TOY = "starcoder2"


@pytest.fixture
def toy_family(monkeypatch):
    """The recipe's two steps, undone after the test (the registry and the named sizes are copied)."""
    registry = importlib.import_module("merit_core.models.family")  # (merit_core.models.family is also a function)
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    with pytest.raises(ConfigError, match=f"'{TOY}' is not supported"):  # unknown before the recipe
        get_family(TOY)
    spec = register_family(
        FamilySpec(
            TOY,
            "StarCoder2",
            "model",
            "embed_tokens.weight",
            AttentionWeights(block="layers.{i}.self_attn"),
            _decoder,
            sliding_window=True,
        )
    )
    tiny = ModelSpec(TOY, 2, 32, 4, 64, 256, d_ff=64, n_kv_head=2, extra={"sliding_window": 8})
    monkeypatch.setitem(NAMED_MODELS, f"{TOY}-tiny", tiny)
    return spec


def test_planted_max_norm_is_found_in_the_right_layer_and_head(toy_family, tmp_path):
    model = plant_heads(build_model(model_config(f"{TOY}-tiny"), seed=1).eval())
    model.save_pretrained(tmp_path)
    check_planted(weight_stats(tmp_path), TOY)


def test_probe_equals_direct_computation_within_the_window(toy_family):
    model = scaled(build_model(model_config(f"{TOY}-tiny"), seed=3))
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    expected = direct_max_logits(model, ids)
    torch.testing.assert_close(max_attention_logits(model, ids, query_chunk=5), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(direct_max_logits(model, ids, ignore_window=True), expected)  # the window matters


def test_merit_train_takes_the_new_named_size(toy_family, data_dir, tmp_path):
    out = tmp_path / "run"
    sets = dict(batch_size=4, seq_len=32, eval_every=0, save_every=0, eval_batches=1, eval_batch_size=2)
    args = ["train", "--model", f"{TOY}-tiny", "--data", str(data_dir), "--out", str(out), "--steps", "2"]
    result = CliRunner().invoke(cli, [*args, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
    assert result.exit_code == 0, result.output
    assert (out / "step_2" / "model.safetensors").is_file()
    assert weight_stats(out / "step_2").architecture == TOY
