"""The max-attention-logit probe equals a direct computation from the model's own weights."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from merit_core.models.attention_probe import chunked_max_logits, max_attention_logits

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare


def _causal_max(q, k):
    """q, k: [H, T, D] -> per-head max of q.k/sqrt(D) over key <= query."""
    t, d = q.shape[1], q.shape[2]
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # on the model's device
    return logits.masked_fill(~mask, float("-inf")).amax(dim=(1, 2))


def _gpt2_direct(model, ids):
    hs = model(ids, output_hidden_states=True).hidden_states
    cfg = model.config
    d, h = cfg.n_embd, cfg.n_head
    out = []
    for i, block in enumerate(model.transformer.h):
        x = block.ln_1(hs[i])
        q, k, _ = block.attn.c_attn(x).split(d, dim=2)
        per_seq = []
        for b in range(ids.shape[0]):
            qh = q[b].view(-1, h, d // h).transpose(0, 1)
            kh = k[b].view(-1, h, d // h).transpose(0, 1)
            per_seq.append(_causal_max(qh, kh))
        out.append(torch.stack(per_seq).amax(0))
    return torch.stack(out)


def _llama_direct(model, ids):
    hs = model(ids, output_hidden_states=True).hidden_states
    cfg = model.config
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // h
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    out = []
    for i, layer in enumerate(model.model.layers):
        x = layer.input_layernorm(hs[i])
        cos, sin = model.model.rotary_emb(x, pos)
        q = layer.self_attn.q_proj(x).view(ids.shape[0], -1, h, hd).transpose(1, 2)
        k = layer.self_attn.k_proj(x).view(ids.shape[0], -1, hkv, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(h // hkv, dim=1)
        out.append(torch.stack([_causal_max(q[b], k[b]) for b in range(ids.shape[0])]).amax(0))
    return torch.stack(out)


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, 256, (2, 37))


def _scaled(model, factor=8.0):
    # make logits large and distinct so the comparison is meaningful
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(factor)
    return model.eval()


def test_gpt2_probe_matches_direct(ids):
    torch.manual_seed(1)
    m = _scaled(
        GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0)
        )
    )
    with torch.no_grad():
        expected = _gpt2_direct(m, ids)
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
    m = _scaled(
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
        expected = _llama_direct(m, ids)
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
