"""The max-attention-logit probe equals a direct q.k computation for every model family (after
rotary, QK-norm and grouped-query expansion, within sliding windows), in float32 under autocast too."""

import pytest
import torch

from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths
from merit_core.diagnostics.probe_batch import make_probe_batch
from merit_core.models.attention_probe import chunked_max_logits, max_attention_logits
from tests.models.family_models import FAMILIES, VOCAB, direct_max_logits, scaled, tiny_model

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare

SEQ = 37  # longer than the tiny models' sliding window (8)


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (2, SEQ))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_probe_equals_direct_computation(model_type, ids):
    model = scaled(tiny_model(model_type, seed=3))
    impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(input_ids=ids).logits
    expected = direct_max_logits(model, ids)
    got = max_attention_logits(model, ids, query_chunk=5)
    assert got.shape == expected.shape == (2, 4)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert expected.abs().max() > 1.0
    # the probe leaves the model as it was, and did not change what it computes
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    # where a layer has a sliding window, it decides the answer (so the test would catch ignoring it)
    unwindowed = direct_max_logits(model, ids, ignore_window=True)
    windowed = [i for i, w in enumerate(_windows(model)) if w]
    for i in windowed:
        assert not torch.allclose(unwindowed[i], got[i], rtol=1e-4, atol=1e-4)
    if model_type in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"):
        assert windowed, f"{model_type}'s tiny model should have a sliding-window layer"


def _windows(model):
    from merit_core.models import family_spec

    return family_spec(model.config).sliding_windows(model.config)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_probe_is_float32_under_bf16_autocast(model_type, ids):
    """Inside a bf16 autocast region (as the training loop calls it) the probe still
    measures float32 logits: equal to the float32 direct computation to 1e-4 relative."""
    model = scaled(tiny_model(model_type, seed=4))  # llama: 4 query heads on 2 key heads
    expected = direct_max_logits(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = max_attention_logits(model, ids)
        leaked = direct_max_logits(model, ids)  # what a probe inside autocast would see without the guard
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0.0)
    assert got.dtype == torch.float32
    assert not torch.allclose(leaked.float(), expected, rtol=1e-4, atol=0.0)  # autocast does change the numbers


def test_chunked_logits_ignore_autocast():
    torch.manual_seed(5)
    q, k = torch.randn(1, 4, 16, 8) * 4, torch.randn(1, 2, 16, 8) * 4
    expected = chunked_max_logits(q, k, None, 8**-0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_max_logits(q, k, None, 8**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_inspect_logits_per_family(model_type, tmp_path):
    """`merit inspect` on a saved checkpoint of each family: per-layer max logits equal the direct computation."""
    model = scaled(tiny_model(model_type, seed=6))
    model.save_pretrained(tmp_path)
    (c,) = inspect_paths([tmp_path], InspectOptions(seq_len=SEQ, query_chunk=16)).checkpoints
    assert c.architecture == model_type and c.probe.source == "random-ids"
    ids = make_probe_batch(tmp_path, model.config.vocab_size, SEQ).input_ids  # the same seeded ids
    expected = direct_max_logits(model, ids)
    got = torch.tensor([[h.max_attention_logit for h in layer.heads] for layer in c.layers])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert [l.max_attention_logit for l in c.layers] == pytest.approx(expected.amax(1).tolist(), rel=1e-4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logit_bound_holds_on_the_probe_batch(model_type, tmp_path):
    """The reported logit bound (max-norms x measured input norms, plus biases) is >= every measured logit;
    families with QK-norm get none (the norm, not W_Q / W_K, sets the scale)."""
    from merit_core.models import get_family

    model = scaled(tiny_model(model_type, seed=7), factor=3.0)
    if model_type == "gpt2":  # non-zero biases, so the bias terms of the bound are exercised
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.bias.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    (c,) = inspect_paths([tmp_path], InspectOptions(seq_len=SEQ)).checkpoints
    assert all(l.input_max_l1 and l.input_max_l1 > 0 for l in c.layers)
    if get_family(model_type).qk_norm:
        assert all(l.logit_bound is None for l in c.layers) and any("QK-norm" in n for n in c.notes)
        return
    for layer in c.layers:
        assert layer.logit_bound == max(h.logit_bound for h in layer.heads)
        for head in layer.heads:
            assert head.max_attention_logit <= head.logit_bound
        assert layer.max_attention_logit <= layer.logit_bound
