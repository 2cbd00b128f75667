"""Param groups: roles by module type, decay / no-decay split, tied embeddings listed once."""

import pytest
import torch
from torch import nn

from merit_core.errors import ConfigError
from merit_core.optim.param_groups import build_param_groups, classify_parameters
from tests.tiny_models import tiny_gpt2, tiny_llama


def test_gpt2_roles_and_tied_head_listed_once():
    model = tiny_gpt2()
    items = classify_parameters(model)
    names = [i.name for i in items]
    roles = {i.name: i.role for i in items}
    assert len(names) == len(set(names))
    assert "lm_head.weight" not in names  # tied to wte: one tensor, first name kept
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(i.param is model.transformer.wte.weight for i in items) == 1
    assert roles["transformer.wte.weight"] == "embedding"
    assert roles["transformer.wpe.weight"] == "embedding"
    assert roles["transformer.h.0.attn.c_attn.weight"] == "hidden"
    assert roles["transformer.h.1.mlp.c_proj.weight"] == "hidden"
    assert roles["transformer.h.0.attn.c_attn.bias"] == "vector"
    assert roles["transformer.ln_f.weight"] == "vector"
    # 2 layers x (c_attn, c_proj, c_fc, mlp.c_proj) hidden matrices; 2 embeddings; everything else is 1-D
    assert sum(r == "hidden" for r in roles.values()) == 8
    assert sum(r == "embedding" for r in roles.values()) == 2
    assert sum(r == "vector" for r in roles.values()) == 18
    assert sum(i.param.numel() for i in items) == sum(p.numel() for p in model.parameters())


def test_gpt2_decay_groups_default_and_without_embedding_decay():
    model = tiny_gpt2()
    groups = build_param_groups(model, 0.1)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"decay", "no_decay"}
    assert by_name["decay"]["weight_decay"] == 0.1 and by_name["no_decay"]["weight_decay"] == 0.0
    assert len(by_name["decay"]["params"]) == 10  # 8 hidden matrices + wte + wpe
    assert len(by_name["no_decay"]["params"]) == 18
    assert all(p.ndim == 1 for p in by_name["no_decay"]["params"])
    assert "transformer.wte.weight" in by_name["decay"]["param_names"]
    assert len(by_name["decay"]["param_names"]) == len(by_name["decay"]["params"])

    groups = {g["name"]: g for g in build_param_groups(model, 0.1, decay_embeddings=False)}
    assert len(groups["decay"]["params"]) == 8
    assert len(groups["no_decay"]["params"]) == 20
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(groups["no_decay"]["param_names"])


def test_llama_untied_head_is_its_own_role():
    model = tiny_llama(tie_word_embeddings=False)
    roles = {i.name: i.role for i in classify_parameters(model)}
    assert roles["lm_head.weight"] == "head"
    assert roles["model.embed_tokens.weight"] == "embedding"
    assert roles["model.layers.0.self_attn.q_proj.weight"] == "hidden"
    assert roles["model.norm.weight"] == "vector"
    no_decay = {g["name"]: g for g in build_param_groups(model, 0.1, decay_embeddings=False)}["no_decay"]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(no_decay["param_names"])


def test_plain_module_embedding_detected_by_type_and_frozen_params_skipped():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    model[3].bias.requires_grad_(False)
    roles = {i.name: i.role for i in classify_parameters(model)}
    assert roles == {
        "0.weight": "embedding",
        "1.weight": "hidden",
        "1.bias": "vector",
        "2.weight": "vector",
        "2.bias": "vector",
        "3.weight": "hidden",
    }


def test_compiled_and_data_parallel_wrappers_are_looked_through():
    model = tiny_gpt2()
    plain = [(i.name, i.role) for i in classify_parameters(model)]
    assert [(i.name, i.role) for i in classify_parameters(nn.DataParallel(model))] == plain
    assert [(i.name, i.role) for i in classify_parameters(torch.compile(model))] == plain


def test_raw_and_named_iterables_dedupe_and_default_names():
    w = nn.Parameter(torch.zeros(3, 4))
    b = nn.Parameter(torch.zeros(4))
    items = classify_parameters([w, b, w])
    assert [(i.name, i.role) for i in items] == [("param_0", "hidden"), ("param_1", "vector")]
    items = classify_parameters([("enc.w", w), ("enc.b", b)])
    assert [(i.name, i.role) for i in items] == [("enc.w", "hidden"), ("enc.b", "vector")]
    groups = build_param_groups([("enc.w", w), ("enc.b", b)], 0.5)
    assert [(g["name"], g["param_names"], g["weight_decay"]) for g in groups] == [
        ("decay", ["enc.w"], 0.5),
        ("no_decay", ["enc.b"], 0.0),
    ]


def test_groups_feed_a_torch_optimizer_and_names_survive_state_dict():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(build_param_groups(model, 0.1), lr=1e-3)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"][0] == "transformer.wte.weight"
    assert sum(len(g["params"]) for g in sd["param_groups"]) == len(list(model.parameters()))


def test_empty_and_bad_inputs():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        classify_parameters(frozen)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        classify_parameters([])
    with pytest.raises(TypeError, match="param-group dicts"):
        classify_parameters([{"params": [nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(TypeError, match="single tensor"):
        classify_parameters(nn.Parameter(torch.zeros(2)))
