"""Named model configs build the sizes the paper uses, without downloads."""

import json

import pytest

from merit_core.errors import ConfigError
from merit_core.models import NAMED_MODELS, build_model, context_length, count_parameters, family, model_config


@pytest.mark.parametrize("name,millions", [("gpt2-tiny", (1, 5)), ("llama-tiny", (1, 5))])
def test_tiny_models_are_tiny(name, millions):
    model = build_model(model_config(name), seed=0)
    n = count_parameters(model) / 1e6
    assert millions[0] <= n <= millions[1]


def test_paper_sizes_from_config_alone():
    # counted from the config without allocating: embeddings + blocks
    cfg = model_config("gpt2-small")
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.n_positions
    n = V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d
    assert round(n / 1e6) == 124
    cfg = model_config("llama-130m")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (
        12,
        768,
        12,
        2048,
    )
    assert context_length(cfg) == 256 and cfg.vocab_size == 32000
    assert context_length(model_config("gpt2-medium")) == 1024


def test_overrides_and_config_file(tmp_path):
    cfg = model_config("gpt2-tiny", vocab_size=300, context=64)
    assert cfg.vocab_size == 300 and context_length(cfg) == 64
    model = build_model(cfg, seed=0)
    model.config.save_pretrained(tmp_path)
    again = model_config(str(tmp_path / "config.json"))
    assert family(again) == "gpt2" and again.vocab_size == 300 and again.n_embd == cfg.n_embd
    assert model_config(str(tmp_path), context=32).n_positions == 32


def test_bad_model_names_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="gpt2-small"):
        model_config("gpt2-smal")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="'bert' is not supported; merit handles gpt2, llama, .*gpt_neox"):
        model_config(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        model_config(str(bad))
    with pytest.raises(ConfigError, match="not found"):
        model_config(str(tmp_path / "nope" / "config.json"))


def test_every_named_model_has_a_config():
    for name, spec in NAMED_MODELS.items():
        cfg = model_config(name)
        assert family(cfg) == cfg.model_type == spec.family
        assert context_length(cfg) == spec.context and cfg.vocab_size == spec.vocab
