"""The model families merit builds, trains and inspects, checked against transformers 5.24's modeling files.

| model_type  | W_Q / W_K stored as                          | GQA | QK-norm | sliding window        | notes            |
|-------------|----------------------------------------------|-----|---------|-----------------------|------------------|
| gpt2        | h.i.attn.c_attn [in, 3d] Conv1D, Q|K|V cols   | no  | no      | no                    |                  |
| llama       | layers.i.self_attn.{q,k}_proj [out, in]      | yes | no      | no                    |                  |
| mistral     | as Llama                                     | yes | no      | every layer           |                  |
| qwen2       | as Llama (with biases)                       | yes | no      | use_sliding_window    |                  |
| qwen3       | as Llama                                     | yes | head    | use_sliding_window    |                  |
| gemma2      | as Llama                                     | yes | no      | layer_types           | softcap, scalar  |
| gemma3_text | as Llama                                     | yes | head    | layer_types           | scalar           |
| olmo2       | as Llama                                     | yes | full    | no                    |                  |
| phi3        | layers.i.self_attn.qkv_proj [(H+2Hkv)hd, in] | yes | no      | sliding_window (all)  |                  |
| gpt_neox    | layers.i.attention.query_key_value [3d, in], | no  | no      | no                    | partial rotary   |
|             | rows per head h: [q_h | k_h | v_h]           |     |         |                       |                  |

"scalar": logits are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5. "softcap":
Gemma 2 caps logits as cap * tanh(logit / cap) (attn_logit_softcapping, 50 by default); SDPA cannot
do that, so these models run with eager attention.
"""

from __future__ import annotations

from typing import Any

from merit_core.models.family import (
    CONV1D,
    FUSED_CONCAT,
    FUSED_PER_HEAD,
    AttentionWeights,
    FamilySpec,
    LigerKernels,
    register_family,
)


def _special(special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": special_ids.get("bos", 0),
        "eos_token_id": special_ids.get("eos", 0),
        "pad_token_id": special_ids.get("pad"),
    }


def _gpt2(size, vocab_size: int, context: int, special_ids: dict[str, int]) -> dict[str, Any]:
    special = _special(special_ids)
    special.pop("pad_token_id")
    return {
        "vocab_size": vocab_size,
        "n_positions": context,
        "n_embd": size.d_model,
        "n_layer": size.n_layer,
        "n_head": size.n_head,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        **special,
    }


def _sizes(size, vocab_size: int, context: int) -> dict[str, Any]:
    """The size keys that Llama-style and GPT-NeoX configs name alike."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": size.d_model,
        "intermediate_size": size.d_ff or 4 * size.d_model,
        "num_hidden_layers": size.n_layer,
        "num_attention_heads": size.n_head,
        "max_position_embeddings": context,
    }


def _decoder(size, vocab_size: int, context: int, special_ids: dict[str, int]) -> dict[str, Any]:
    """Llama-style decoders: the keys Llama, Mistral, Qwen, Gemma, OLMo 2 and Phi-3 configs share."""
    return {
        **_sizes(size, vocab_size, context),
        "num_key_value_heads": size.n_kv_head or size.n_head,
        "head_dim": size.head_dim or size.d_model // size.n_head,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        **_special(special_ids),
    }


def _gemma(size, vocab_size: int, context: int, special_ids: dict[str, int]) -> dict[str, Any]:
    kw = _decoder(size, vocab_size, context, special_ids)
    kw["query_pre_attn_scalar"] = kw["head_dim"]
    kw["tie_word_embeddings"] = True
    return kw


def _phi3(size, vocab_size: int, context: int, special_ids: dict[str, int]) -> dict[str, Any]:
    kw = _decoder(size, vocab_size, context, special_ids)
    kw["original_max_position_embeddings"] = context
    kw["resid_pdrop"] = kw["embd_pdrop"] = 0.0
    return kw


def _gpt_neox(size, vocab_size: int, context: int, special_ids: dict[str, int]) -> dict[str, Any]:
    special = _special(special_ids)
    special.pop("pad_token_id")
    return {
        **_sizes(size, vocab_size, context),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        **special,
    }


_SELF_ATTN = AttentionWeights(block="layers.{i}.self_attn")


def _liger(model_type: str, **kw) -> LigerKernels:
    return LigerKernels(
        modeling=f"transformers.models.{model_type.removesuffix('_text')}.modeling_{model_type.removesuffix('_text')}",
        **kw,
    )


_GEMMA_LIGER = {"rms_norm": "gemma", "rms_offset": 1.0, "mlp": "geglu"}


def _llama_like(model_type: str, label: str, builder=_decoder, liger: dict | None = None, **kw) -> FamilySpec:
    return FamilySpec(
        model_type,
        label,
        "model",
        "embed_tokens.weight",
        _SELF_ATTN,
        builder,
        liger=_liger(model_type, **(liger or {})),
        **kw,
    )


GPT2 = register_family(
    FamilySpec(
        "gpt2",
        "GPT-2",
        "transformer",
        "wte.weight",
        AttentionWeights(block="h.{i}.attn", o="c_proj", qkv="c_attn", fused=FUSED_CONCAT, orientation=CONV1D),
        _gpt2,
        context_key="n_positions",
        hidden_key="n_embd",
        layers_key="n_layer",
        heads_key="n_head",
        kv_heads_key=None,
    )
)
LLAMA = register_family(_llama_like("llama", "Llama"))
MISTRAL = register_family(_llama_like("mistral", "Mistral", sliding_window=True))
QWEN2 = register_family(_llama_like("qwen2", "Qwen2", sliding_window=True))
QWEN3 = register_family(_llama_like("qwen3", "Qwen3", qk_norm="head", sliding_window=True))
GEMMA2 = register_family(
    _llama_like(
        "gemma2",
        "Gemma 2",
        _gemma,
        sliding_window=True,
        query_scalar_key="query_pre_attn_scalar",
        softcap_key="attn_logit_softcapping",
        liger=_GEMMA_LIGER,
    )
)
GEMMA3 = register_family(
    _llama_like(
        "gemma3_text",
        "Gemma 3",
        _gemma,
        qk_norm="head",
        sliding_window=True,
        query_scalar_key="query_pre_attn_scalar",
        liger=_GEMMA_LIGER,
    )
)
OLMO2 = register_family(_llama_like("olmo2", "OLMo 2", qk_norm="full"))
PHI3 = register_family(
    FamilySpec(
        "phi3",
        "Phi-3",
        "model",
        "embed_tokens.weight",
        AttentionWeights(block="layers.{i}.self_attn", qkv="qkv_proj", fused=FUSED_CONCAT),
        _phi3,
        sliding_window=True,
        liger=_liger("phi3", mlp="phi3"),
    )
)
GPT_NEOX = register_family(
    FamilySpec(
        "gpt_neox",
        "GPT-NeoX",
        "gpt_neox",
        "embed_in.weight",
        AttentionWeights(block="layers.{i}.attention", o="dense", qkv="query_key_value", fused=FUSED_PER_HEAD),
        _gpt_neox,
        kv_heads_key=None,
        saved_as=(("lm_head.weight", "embed_out.weight"),),
    )
)
