"""Max attention logits computed directly from a model's own weights (q and k per head, causal
max of q.k/sqrt(d)): what the probe's tests, inspect's tests and the GPU tests compare against."""

import math

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def _causal_max(q, k):
    """q, k: [H, T, D] -> per-head max of q.k/sqrt(D) over key <= query."""
    t, d = q.shape[1], q.shape[2]
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # on the model's device
    return logits.masked_fill(~mask, float("-inf")).amax(dim=(1, 2))


def gpt2_direct(model, ids):
    """[layers, heads] max logits of a GPT-2 over the sequences of ``ids``."""
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


def llama_direct(model, ids):
    """The same for a Llama (after rotary embeddings; key heads shared by GQA groups)."""
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


def scaled(model, factor=8.0):
    """``model`` with its 2-D weights x ``factor``, in eval mode: large, distinct logits make the
    comparison meaningful."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(factor)
    return model.eval()
