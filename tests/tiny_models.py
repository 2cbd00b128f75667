"""Tiny Hugging Face models built from config in memory (a few k parameters), seeded: one definition
for the tests that build a GPT-2 or a Llama and vary a field or two."""

import torch

GPT2 = dict(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def tiny_gpt2(seed: int = 0, **changes):
    """A GPT2LMHeadModel of :data:`GPT2` with ``changes``, its weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**{**GPT2, **changes}))


def tiny_llama(seed: int = 0, **changes):
    """A LlamaForCausalLM of :data:`LLAMA` with ``changes``, seeded likewise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **changes}))
