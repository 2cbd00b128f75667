"""The probe's instability statistics (attention entropy, residual-stream activations, output log Z)
equal direct computations written here in plain torch, for GPT-2, Llama (GQA, rotary), Qwen3
(QK-norm) and Gemma 2 (soft-capping); planted weights move the right number and only it."""

import pytest
import torch

from merit_core.models.attention_probe import probe_attention
from tests.models.family_models import VOCAB, direct_logits, tiny_model

FAMILIES = ["gpt2", "llama", "qwen3", "gemma2"]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _ids(batch: int = 2, length: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _final_norm(model) -> tuple[torch.nn.Module, str]:
    base = getattr(model, model.base_model_prefix)
    name = "ln_f" if model.config.model_type == "gpt2" else "norm"
    return base, name


def direct_entropy(model, ids) -> dict[str, torch.Tensor]:
    """Softmax of (soft-capped) scaled q.k under the causal / sliding mask; entropy sum(-p log p) per
    query position that sees >= 2 keys; mean and min over batch and positions, per layer and head."""
    cap = getattr(model.config, "attn_logit_softcapping", None)
    out = {"mean": [], "min": [], "normalized_mean": [], "normalized_min": []}
    for logits, allowed in direct_logits(model, ids):
        z = cap * torch.tanh(logits / cap) if cap else logits
        p = torch.softmax(z.masked_fill(~allowed, float("-inf")), dim=-1)
        h = torch.special.entr(p).sum(dim=-1)  # [B, H, T]
        n = allowed.sum(dim=-1)  # [T]
        keep = n >= 2
        e, norm = h[..., keep], (h / torch.log(n.float()))[..., keep]
        out["mean"].append(e.mean(dim=(0, 2)))
        out["min"].append(e.amin(dim=(0, 2)))
        out["normalized_mean"].append(norm.mean(dim=(0, 2)))
        out["normalized_min"].append(norm.amin(dim=(0, 2)))
    return {k: torch.stack(v) for k, v in out.items()}


def direct_hidden(model, ids) -> list[torch.Tensor]:
    """The residual stream after each layer, from output_hidden_states (the final norm made the
    identity, so the last entry is the last layer's output rather than its normed version)."""
    base, name = _final_norm(model)
    norm = getattr(base, name)
    setattr(base, name, torch.nn.Identity())
    try:
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        setattr(base, name, norm)
    return list(hs[1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_statistics_equal_direct_computation(family):
    model = tiny_model(family, seed=3)
    ids = _ids()
    got = probe_attention(model, ids, query_chunk=7, instability=True)  # several chunks, a ragged last one
    want = direct_entropy(model, ids)
    for key, value in want.items():
        torch.testing.assert_close(got.entropy[key], value, **TOL, msg=f"{family} entropy {key}")
    hidden = direct_hidden(model, ids)
    assert len(got.activations) == len(hidden)
    for stats, h in zip(got.activations, hidden):
        a = h.abs()
        assert stats.max_abs == pytest.approx(float(a.max()), rel=1e-5)
        assert stats.median_abs == pytest.approx(
            float(torch.quantile(a.flatten(), 0.5, interpolation="lower")), rel=1e-5
        )
        assert float(a[stats.batch_index, stats.position, stats.dim]) == stats.max_abs
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    assert got.output.log_z_mean == pytest.approx(float(log_z.mean()), rel=1e-5)
    assert got.output.log_z_max == pytest.approx(float(log_z.max()), rel=1e-5)
    assert got.output.log_z_std == pytest.approx(float(log_z.flatten().std(correction=0)), rel=1e-4, abs=1e-6)
    assert got.output.max_abs_logit == pytest.approx(float(logits.abs().max()), rel=1e-5)


def test_padding_is_left_out():
    """A padded batch row measures the same as the unpadded sequence alone (left padding)."""
    model = tiny_model("llama", seed=3)
    ids = _ids(1, 12)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    alone = probe_attention(model, ids, instability=True)
    pad = probe_attention(model, padded, attention_mask=mask, instability=True)
    torch.testing.assert_close(pad.entropy["min"], alone.entropy["min"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pad.entropy["mean"], alone.entropy["mean"], rtol=1e-4, atol=1e-5)
    assert pad.output.log_z_mean == pytest.approx(alone.output.log_z_mean, rel=1e-4)
    assert pad.activations[0].position == alone.activations[0].position + 4


def _probe(model, ids):
    return probe_attention(model, ids, instability=True)


def test_planted_query_key_scale_collapses_entropy_of_that_layer_only():
    model = tiny_model("llama", seed=3)
    ids = _ids()
    before = _probe(model, ids)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(30)
        attn.k_proj.weight.mul_(30)
    after = _probe(model, ids)
    # the planted layer: entropy collapses, max logit rises
    assert after.entropy["normalized_min"][1].min() < 0.05 < before.entropy["normalized_min"][1].min()
    assert after.entropy["normalized_mean"][1].mean() < 0.5 * before.entropy["normalized_mean"][1].mean()
    assert after.max_logits[1].max() > 100 * before.max_logits[1].max()
    assert float(after.entropy["min"].min()) >= 0.0  # no rounding below zero when one key takes all
    # the layer before it: unchanged, as are its activations
    for key in before.entropy:
        torch.testing.assert_close(after.entropy[key][0], before.entropy[key][0])
    torch.testing.assert_close(after.max_logits[0], before.max_logits[0])
    assert after.activations[0] == before.activations[0]


def test_planted_output_scale_raises_log_z_only():
    model = tiny_model("llama", seed=3)
    ids = _ids()
    before = _probe(model, ids)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    after = _probe(model, ids)
    assert after.output.log_z_mean > before.output.log_z_mean + 5  # log(vocab) = 5.5 at this init
    assert after.output.log_z_std > 50 * before.output.log_z_std
    assert after.output.max_abs_logit == pytest.approx(30 * before.output.max_abs_logit, rel=1e-4)
    for key in before.entropy:
        torch.testing.assert_close(after.entropy[key], before.entropy[key])
    torch.testing.assert_close(after.max_logits, before.max_logits)
    assert after.activations == before.activations


def test_planted_mlp_bias_makes_massive_activation_at_that_dim():
    model = tiny_model("gpt2", seed=3)
    ids = _ids()
    before = _probe(model, ids)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.bias[5] = 1000.0
    after = _probe(model, ids)
    assert before.activations[1].ratio < 30
    assert after.activations[1].ratio > 100
    assert after.activations[1].dim == 5
    assert after.activations[0] == before.activations[0]
    for key in before.entropy:
        torch.testing.assert_close(after.entropy[key], before.entropy[key])
