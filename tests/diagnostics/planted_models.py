"""Tiny GPT-2 and Llama models of one geometry (width D, H heads of HD) with an outlier planted in
a known layer, head, row and column of W_K: what the weight-statistics, inspect and Hessian tests
read back."""

import torch

from tests.tiny_models import NO_DROPOUT, tiny_gpt2, tiny_llama

D, H, HD = 32, 4, 8
PLANT = 7.0


def diag_gpt2(seed=0, n_layer=2):
    """A tiny GPT-2 of this geometry (D wide, H heads of HD), no dropout."""
    return tiny_gpt2(seed, vocab_size=256, n_positions=64, n_embd=D, n_layer=n_layer, n_head=H, **NO_DROPOUT)


def diag_llama(seed=0, n_layer=2, kv_heads=2):
    """A tiny Llama of this geometry with ``kv_heads`` key heads."""
    return tiny_llama(
        seed,
        vocab_size=256,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=H,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )


# Planted entries: (stored row, stored column) of W_K in layer 1, and the head that owns them.
# GPT-2 c_attn is [in, 3*out]: K occupies columns D..2D, head h owns K columns h*HD..(h+1)*HD.
GPT2_K_ROW, GPT2_K_COL, GPT2_K_HEAD = 5, 2 * HD + 3, 2  # column 19 within K -> head 2
# Llama k_proj is [Hkv*HD, in]: kv head h owns rows h*HD..(h+1)*HD.
LLAMA_K_ROW, LLAMA_K_COL, LLAMA_KV_HEAD = 1 * HD + 3, 20, 1  # row 11 -> kv head 1 -> query heads 2, 3


def plant(model):
    """Write PLANT into W_K of layer 1 at the entries above (head GPT2_K_HEAD / LLAMA_KV_HEAD)."""
    with torch.no_grad():
        if model.config.model_type == "gpt2":
            model.transformer.h[1].attn.c_attn.weight[GPT2_K_ROW, D + GPT2_K_COL] = PLANT
        else:
            model.model.layers[1].self_attn.k_proj.weight[LLAMA_K_ROW, LLAMA_K_COL] = PLANT
    return model
