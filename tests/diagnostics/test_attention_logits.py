"""The max-attention-logit probe equals a direct computation from the model's own weights."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from merit_core.models.attention_probe import chunked_max_logits, max_attention_logits
from tests.diagnostics.direct_attention import gpt2_direct, llama_direct, scaled

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, 256, (2, 37))


def test_gpt2_probe_matches_direct(ids):
    torch.manual_seed(1)
    m = scaled(
        GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0)
        )
    )
    with torch.no_grad():
        expected = gpt2_direct(m, ids)
        logits_before = m(ids).logits
    got = max_attention_logits(m, ids, query_chunk=5)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert expected.abs().max() > 1.0
    # the probe leaves the model as it was
    assert m.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, logits_before)


def test_llama_probe_matches_direct_after_rotary_with_gqa(ids):
    torch.manual_seed(2)
    m = scaled(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
        )
    )
    with torch.no_grad():
        expected = llama_direct(m, ids)
    got = max_attention_logits(m, ids, query_chunk=8)
    assert got.shape == (2, 4)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_chunking_never_changes_the_answer():
    torch.manual_seed(3)
    q, k = torch.randn(2, 3, 20, 8), torch.randn(2, 3, 20, 8)
    whole = chunked_max_logits(q, k, None, 0.5, query_chunk=20)
    for c in (1, 3, 7):
        torch.testing.assert_close(chunked_max_logits(q, k, None, 0.5, query_chunk=c), whole)


def test_causal_mask_excludes_future_keys():
    q = torch.zeros(1, 1, 4, 2)
    k = torch.zeros(1, 1, 4, 2)
    q[0, 0, 0] = torch.tensor([1.0, 0.0])
    k[0, 0, 3] = torch.tensor([100.0, 0.0])  # only visible to query 3, whose q is zero
    assert chunked_max_logits(q, k, None, 1.0, query_chunk=2).item() == 0.0


def test_padding_mask_is_respected():
    q = torch.ones(1, 1, 3, 1)
    k = torch.tensor([[[[5.0], [1.0], [2.0]]]])
    mask = (
        torch.tensor([False, True, True]).view(1, 1, 1, 3).expand(1, 1, 3, 3)
        & torch.ones(3, 3, dtype=torch.bool).tril()
    )
    assert chunked_max_logits(q, k, mask, 1.0).item() == 2.0


def test_probe_runs_without_tf32_and_restores_the_flags(ids):
    """Training leaves TF32 on for CUDA; the probe's products are full float32 and the flags come back."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    seen = []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.matmul.allow_tf32))
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        max_attention_logits(model, ids[:, :32] % 97)
        assert seen == [False]
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
