"""Weight statistics from safetensors: planted outliers land in the right layer, head, row and column."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from merit_core.checkpoint.resolve import find_checkpoints
from merit_core.diagnostics.weights import model_weight_stats, weight_stats
from tests.diagnostics.planted_models import (
    GPT2_K_COL,
    GPT2_K_HEAD,
    GPT2_K_ROW,
    HD,
    LLAMA_K_COL,
    LLAMA_K_ROW,
    LLAMA_KV_HEAD,
    PLANT,
    D,
    H,
    diag_gpt2,
    diag_llama,
    plant,
)

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare


def saved(model, folder, **kw):
    model.save_pretrained(folder, **kw)
    return folder


def test_gpt2_planted_key_entry(tmp_path):
    model = plant(diag_gpt2())
    stats = weight_stats(saved(model, tmp_path / "g")).to_dict()
    assert stats["architecture"] == "gpt2" and stats["n_layers"] == 2 and stats["n_heads"] == H
    assert stats["row_axis"] == "input"
    l0, l1 = stats["layers"]
    assert l1["layer"] == 1 and l1["k_max_norm"] == PLANT and l0["k_max_norm"] < 1.0
    heads = {h["head"]: h for h in l1["heads"]}
    assert heads[GPT2_K_HEAD]["k_max_norm"] == PLANT
    assert all(h["k_max_norm"] < 1.0 for i, h in heads.items() if i != GPT2_K_HEAD)
    assert l1["k_rows"]["outliers"][0]["index"] == GPT2_K_ROW
    top_col = l1["k_cols"]["outliers"][0]
    assert (top_col["index"], top_col["head"], top_col["max_norm"]) == (GPT2_K_COL, GPT2_K_HEAD, PLANT)
    assert top_col["x_median"] > 20
    assert l1["k_cols"]["max"] == PLANT and l1["k_cols"]["p50"] < 1.0
    # the bound term and Q are untouched by the plant
    c_attn = model.transformer.h[1].attn.c_attn.weight.detach()
    q = c_attn[:, :D]
    assert l1["q_max_norm"] == pytest.approx(q.abs().max().item())
    assert l1["bound"] == pytest.approx(l1["q_max_norm"] * PLANT)
    assert l1["q_l2_norm"] == pytest.approx(torch.linalg.norm(q).item(), rel=1e-6)
    assert l1["k_l2_norm"] == pytest.approx(torch.linalg.norm(c_attn[:, D : 2 * D]).item(), rel=1e-6)
    assert l1["heads"][1]["q_l2_norm"] == pytest.approx(torch.linalg.norm(q[:, HD : 2 * HD]).item(), rel=1e-6)
    assert l1["k_max_over_l2"] == pytest.approx(PLANT / l1["k_l2_norm"])


def test_llama_planted_key_entry_with_grouped_heads(tmp_path):
    model = plant(diag_llama(kv_heads=2))
    stats = weight_stats(saved(model, tmp_path / "l")).to_dict()
    assert (stats["architecture"], stats["n_heads"], stats["n_kv_heads"], stats["head_dim"]) == ("llama", H, 2, HD)
    assert stats["row_axis"] == "output"
    l0, l1 = stats["layers"]
    assert l1["k_max_norm"] == PLANT and l0["k_max_norm"] < 1.0
    for h in l1["heads"]:  # query heads 2 and 3 read kv head 1
        assert h["kv_head"] == h["head"] // 2
        assert (h["k_max_norm"] == PLANT) == (h["kv_head"] == LLAMA_KV_HEAD)
    top_row = l1["k_rows"]["outliers"][0]
    assert (top_row["index"], top_row["head"], top_row["max_norm"]) == (LLAMA_K_ROW, LLAMA_KV_HEAD, PLANT)
    assert l1["k_cols"]["outliers"][0]["index"] == LLAMA_K_COL
    q = model.model.layers[1].self_attn.q_proj.weight.detach()
    assert l1["heads"][3]["q_max_norm"] == pytest.approx(q[3 * HD : 4 * HD].abs().max().item())


def test_other_weights_are_all_2d_tensors(tmp_path):
    folder = saved(diag_gpt2(), tmp_path / "g")
    stats = weight_stats(folder).to_dict()
    tensors = load_file(folder / "model.safetensors")
    names = sorted(k for k, v in tensors.items() if v.ndim == 2)
    assert [w["name"] for w in stats["weights"]] == names
    wte = next(w for w in stats["weights"] if w["name"] == "transformer.wte.weight")
    assert wte["shape"] == [256, D]
    assert wte["max_norm"] == pytest.approx(tensors["transformer.wte.weight"].abs().max().item())


def test_sharded_and_live_model_agree_with_single_file(tmp_path):
    model = plant(diag_llama())
    single = weight_stats(saved(model, tmp_path / "one")).to_dict()
    sharded_dir = saved(model, tmp_path / "many", max_shard_size="20KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(find_checkpoints(sharded_dir)[0].files) > 1
    for source in (sharded_dir, sharded_dir / "model.safetensors.index.json"):
        assert weight_stats(source).to_dict()["layers"] == single["layers"]
    assert model_weight_stats(model).to_dict()["layers"] == single["layers"]


def test_without_config_heads_come_from_the_caller(tmp_path):
    folder = saved(plant(diag_gpt2()), tmp_path / "g")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(folder / "model.safetensors", alone / "weights.safetensors")
    stats = weight_stats(alone / "weights.safetensors").to_dict()
    assert stats["n_heads"] is None and stats["layers"][1]["heads"] == []
    assert stats["layers"][1]["k_max_norm"] == PLANT and "--heads" in stats["notes"][0]
    stats = weight_stats(alone / "weights.safetensors", n_heads=H).to_dict()
    assert stats["layers"][1]["heads"][GPT2_K_HEAD]["k_max_norm"] == PLANT


def test_half_precision_and_unprefixed_gpt2_names(tmp_path):
    model = plant(diag_gpt2())
    tensors = {
        k.removeprefix("transformer."): v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(tensors, tmp_path / "old.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    stats = weight_stats(tmp_path / "old.safetensors").to_dict()
    assert stats["layers"][1]["k_max_norm"] == PLANT  # exactly representable in bf16
    assert stats["layers"][1]["heads"][GPT2_K_HEAD]["k_max_norm"] == PLANT
