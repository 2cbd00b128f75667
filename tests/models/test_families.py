"""Every model family: built from config, trained-model config files accepted, planted max-norms found
in the right layer and head (W_Q and W_K, grouped key heads), unknown families refused in one line."""

import json

import pytest
import torch

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
from tests.models.family_models import FAMILIES, H, shape, stored_entry, tiny_model

PLANT_Q, PLANT_K = 5.0, 7.0
Q_HEAD, KV_HEAD, FEATURE, INPUT = 2, 1, 3, 5


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


def _plant(model):
    """Plant W_Q[query head Q_HEAD] and W_K[key head KV_HEAD] entries in layer 1; check they are those heads'."""
    params = dict(model.named_parameters())
    x = torch.randn(1, 3, model.config.to_dict().get("hidden_size") or model.config.n_embd)
    with torch.no_grad():
        q0, k0 = (t.clone() for t in _project(model, x))
        for which, head, value in (("q", Q_HEAD, PLANT_Q), ("k", KV_HEAD, PLANT_K)):
            name, idx = stored_entry(model, 1, which, head, FEATURE, INPUT)
            params[name][idx] = value
        q1, k1 = _project(model, x)
    _, _, hd = shape(model)
    # the planted entries moved exactly the intended output feature of the projections
    for before, after, head in ((q0, q1, Q_HEAD), (k0, k1, KV_HEAD)):
        changed = (after != before).any(dim=(0, 1)).nonzero().flatten().tolist()
        assert changed == [head * hd + FEATURE]
    return model


def _project(model, x):
    from tests.models.family_models import project

    return project(model, 1, x)


def _check_planted(stats, model_type):
    heads, kv, hd = stats.n_heads, stats.n_kv_heads, stats.head_dim
    assert stats.architecture == model_type and stats.n_layers == 2 and heads == H
    l0, l1 = stats.layers
    assert (l1.q_max_norm, l1.k_max_norm) == (PLANT_Q, PLANT_K)
    assert l0.q_max_norm < 1.0 and l0.k_max_norm < 1.0
    assert l1.bound == PLANT_Q * PLANT_K
    for h in l1.heads:
        assert h.kv_head == h.head // (heads // kv)  # grouped query heads read key head h // group
        assert (h.q_max_norm == PLANT_Q) == (h.head == Q_HEAD)
        assert (h.k_max_norm == PLANT_K) == (h.kv_head == KV_HEAD)
        assert h.bound == h.q_max_norm * h.k_max_norm
    out_axis, in_axis = ("rows", "cols") if stats.row_axis == "output" else ("cols", "rows")
    q_out, k_out = getattr(l1, f"q_{out_axis}").outliers[0], getattr(l1, f"k_{out_axis}").outliers[0]
    assert (q_out.index, q_out.head, q_out.max_norm) == (Q_HEAD * hd + FEATURE, Q_HEAD, PLANT_Q)
    assert (k_out.index, k_out.head, k_out.max_norm) == (KV_HEAD * hd + FEATURE, KV_HEAD, PLANT_K)
    assert getattr(l1, f"k_{in_axis}").outliers[0].index == INPUT


@pytest.mark.parametrize("model_type", FAMILIES)
def test_planted_max_norm_found_in_layer_and_head(model_type, tmp_path):
    model = _plant(tiny_model(model_type, seed=1))
    model.save_pretrained(tmp_path)
    saved = weight_stats(tmp_path)
    _check_planted(saved, model_type)
    live = model_weight_stats(model)
    assert [l.to_dict() for l in live.layers] == [l.to_dict() for l in saved.layers]


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi3", "qwen3"])
def test_without_config_the_head_count_splits_fused_weights(model_type, tmp_path):
    import shutil

    model = _plant(tiny_model(model_type, seed=1))
    model.save_pretrained(tmp_path / "m")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tmp_path / "m" / "model.safetensors", alone / "w.safetensors")
    stats = weight_stats(alone / "w.safetensors", n_heads=H)
    assert (stats.layers[1].q_max_norm, stats.layers[1].k_max_norm) == (PLANT_Q, PLANT_K)
    heads = stats.layers[1].heads
    assert [h.head for h in heads if h.q_max_norm == PLANT_Q] == [Q_HEAD]
    assert {h.kv_head for h in heads if h.k_max_norm == PLANT_K} == {KV_HEAD}
