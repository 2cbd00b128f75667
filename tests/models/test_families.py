"""Every model family: built from config, trained-model config files accepted, planted max-norms found
in the right layer and head (W_Q and W_K, grouped key heads), unknown families refused in one line."""

import json

import pytest

from merit_core.diagnostics.weights import model_weight_stats, weight_stats
from merit_core.errors import ConfigError
from merit_core.models import (
    NAMED_MODELS,
    build_model,
    context_length,
    family,
    family_names,
    family_spec,
    get_family,
    model_config,
)
from tests.models.family_models import (
    FAMILIES,
    KV_HEAD,
    PLANT_K,
    PLANT_Q,
    Q_HEAD,
    H,
    check_planted,
    plant_heads,
    shape,
    tiny_model,
)


def test_every_required_family_is_registered_with_a_tiny_named_model():
    assert set(FAMILIES) <= set(family_names())
    tiny = {NAMED_MODELS[n].family for n in NAMED_MODELS if n.endswith("-tiny")}
    assert tiny == set(family_names())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_config_file_round_trip(model_type, tmp_path):
    model = tiny_model(model_type)
    model.config.save_pretrained(tmp_path)
    again = model_config(str(tmp_path), context=32, vocab_size=300)
    assert family(again) == model_type and context_length(again) == 32 and again.vocab_size == 300
    rebuilt = build_model(again, seed=0)
    assert family_spec(rebuilt.config).attn_implementation(again) == rebuilt.config._attn_implementation
    # every family's GQA, QK-norm and sliding-window facts agree with the built model
    spec = get_family(model_type)
    heads, kv, hd = shape(model)
    assert (spec.n_heads(model.config), spec.n_kv_heads(model.config), spec.head_dim(model.config)) == (heads, kv, hd)
    attn = dict(model.named_modules())
    assert any(n.endswith("q_norm") for n in attn) == (spec.qk_norm is not None)


def test_gemma2_soft_capping_runs_eager_and_is_reported():
    model = tiny_model("gemma2")
    assert model.config._attn_implementation == "eager"
    assert get_family("gemma2").softcap(model.config) == 50.0
    assert any("before the cap" in n for n in model_weight_stats(model).notes)


def test_unknown_family_is_one_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(ConfigError) as err:
        model_config(str(tmp_path))
    assert "'mamba' is not supported" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="mamba"):
        get_family("mamba")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_planted_max_norm_found_in_layer_and_head(model_type, tmp_path):
    model = plant_heads(tiny_model(model_type, seed=1))
    model.save_pretrained(tmp_path)
    saved = weight_stats(tmp_path)
    check_planted(saved, model_type)
    live = model_weight_stats(model)
    assert [l.to_dict() for l in live.layers] == [l.to_dict() for l in saved.layers]


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi3", "qwen3"])
def test_without_config_the_head_count_splits_fused_weights(model_type, tmp_path):
    import shutil

    model = plant_heads(tiny_model(model_type, seed=1))
    model.save_pretrained(tmp_path / "m")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tmp_path / "m" / "model.safetensors", alone / "w.safetensors")
    stats = weight_stats(alone / "w.safetensors", n_heads=H)
    assert (stats.layers[1].q_max_norm, stats.layers[1].k_max_norm) == (PLANT_Q, PLANT_K)
    heads = stats.layers[1].heads
    assert [h.head for h in heads if h.q_max_norm == PLANT_Q] == [Q_HEAD]
    assert {h.kv_head for h in heads if h.k_max_norm == PLANT_K} == {KV_HEAD}
