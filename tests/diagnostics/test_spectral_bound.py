"""The spectral logit bound (merit_core.diagnostics.weights.spectral_logit_bounds) holds, per head,
on every family's tiny model (GQA, rotary and partial rotary, QK-norm per head and over all heads,
Gemma's 1 + weight gain, soft-capping, biases) and on planted large-logit checkpoints; where no
QK-norm is in the way it is tighter than the max-norm bound on weights that are not random."""

import pytest
import torch

from merit_core.diagnostics.report import InspectOptions, inspect_paths
from merit_core.models import get_family
from tests.diagnostics.planted_models import diag_gpt2, diag_llama, plant
from tests.models.family_models import FAMILIES, scaled, tiny_model

SEQ = 37


def _check_holds(c) -> None:
    for layer in c.layers:
        assert layer.input_max_l2 is not None and 0 < layer.input_max_l2 <= layer.input_max_l1
        assert layer.spectral_logit_bound == max(h.spectral_logit_bound for h in layer.heads)
        for head in layer.heads:
            assert head.max_attention_logit <= head.spectral_logit_bound


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_spectral_bound_holds_on_every_family(model_type, tmp_path):
    model = scaled(tiny_model(model_type, seed=7), factor=3.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "attn" in name:
                p.normal_(0, 1.0)  # non-zero biases exercise the bias terms (gpt2, qwen2, pythia)
            if "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 3.0)  # gains far from 1, so a gain left out of the bound would show
    model.save_pretrained(tmp_path)
    (c,) = inspect_paths([tmp_path], InspectOptions(seq_len=SEQ)).checkpoints
    _check_holds(c)
    if get_family(model_type).qk_norm is None:
        # the max-norm bound holds too; on these weights the spectral one is the smaller
        for layer in c.layers:
            assert layer.spectral_logit_bound <= layer.logit_bound


@pytest.mark.parametrize("build", [diag_gpt2, diag_llama])
def test_the_spectral_bound_holds_on_planted_large_logits(build, tmp_path):
    model = plant(build(seed=1))
    with torch.no_grad():  # a rank-one direction shared by W_Q and W_K: logits far above the random ones
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    model.save_pretrained(tmp_path)
    (c,) = inspect_paths([tmp_path], InspectOptions(seq_len=SEQ)).checkpoints
    _check_holds(c)
    assert max(l.max_attention_logit for l in c.layers) > 10.0
