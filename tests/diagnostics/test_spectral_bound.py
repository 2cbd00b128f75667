"""The spectral logit bound (merit_core.diagnostics.logit_bounds.spectral_logit_bounds) holds, per head,
on every family's tiny model (GQA, rotary and partial rotary, QK-norm per head and over all heads,
Gemma's 1 + weight gain, soft-capping, biases) and on planted large-logit checkpoints, and is in
inspect's JSON per layer and head; where no QK-norm is in the way it is tighter than the max-norm
bound, on scaled random weights and on trained checkpoints."""

import pytest
import torch

from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths
from merit_core.models import get_family
from tests.diagnostics.planted_models import diag_gpt2, diag_llama, plant
from tests.models.family_models import FAMILIES, scaled, tiny_model

SEQ = 37


def _check_holds(c) -> None:
    for layer, json_layer in zip(c.layers, c.to_dict()["layers"]):
        assert layer.input_max_l2 is not None and 0 < layer.input_max_l2 <= layer.input_max_l1
        assert layer.spectral_logit_bound == max(h.spectral_logit_bound for h in layer.heads)
        assert json_layer["spectral_logit_bound"] == layer.spectral_logit_bound
        assert json_layer["input_max_l2"] == layer.input_max_l2
        for head, json_head in zip(layer.heads, json_layer["heads"]):
            assert head.max_attention_logit <= head.spectral_logit_bound
            assert json_head["spectral_logit_bound"] == head.spectral_logit_bound


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


TRAIN_STEPS, TRAIN_LR, TRAIN_SEQ = 40, 1e-2, 32


def _progressions(generator: torch.Generator, batch: int = 8) -> torch.Tensor:
    """Arithmetic progressions mod 256, each with its own step (1-3): the next token needs the
    previous two, so attention has something to learn."""
    start = torch.randint(0, 256, (batch, 1), generator=generator)
    step = torch.randint(1, 4, (batch, 1), generator=generator)
    return (start + step * torch.arange(TRAIN_SEQ)) % 256


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT-2 and a tiny Llama (GQA, rotary) trained 40 AdamW steps on progressions, saved."""
    out = {}
    for build in (diag_gpt2, diag_llama):
        model = build(seed=3).train()
        opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
        generator = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(TRAIN_STEPS):
            ids = _progressions(generator)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        folder = tmp_path_factory.mktemp(model.config.model_type)
        model.eval().save_pretrained(folder)
        out[model.config.model_type] = (folder, losses)
    return out


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_the_spectral_bound_is_tighter_than_the_max_norm_bound_on_trained_checkpoints(trained, model_type):
    folder, losses = trained[model_type]
    assert losses[-1] < losses[0] - 2.0  # it learnt (from 5.5 nats): the weights are not the random ones
    (c,) = inspect_paths([folder], InspectOptions(seq_len=SEQ)).checkpoints
    _check_holds(c)
    for layer in c.layers:
        assert layer.spectral_logit_bound < layer.logit_bound
        for head in layer.heads:
            assert head.spectral_logit_bound < head.logit_bound
