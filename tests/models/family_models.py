"""Tiny models of every supported family (2 layers, hidden 32), and references written from the
transformers modeling code, independent of merit's family specs: where a head's W_Q / W_K entries
are stored, and the max attention logit computed directly as scaled q.k."""

from __future__ import annotations

import sys

import torch

from merit_core.models import ModelSpec, build_model, model_config

D, H, LAYERS, VOCAB, CONTEXT = 32, 4, 2, 256, 64
WINDOW = 8  # sliding window of the tiny models that have one (sequences in the tests are longer)
PLANT_Q, PLANT_K = 5.0, 7.0  # what plant_heads writes into W_Q and W_K
Q_HEAD, KV_HEAD, FEATURE, INPUT = 2, 1, 3, 5  # where

# model_type -> (key heads, extra config keys)
TINY: dict[str, tuple[int | None, dict]] = {
    "gpt2": (None, {}),
    "llama": (2, {}),
    "mistral": (2, {"sliding_window": WINDOW}),
    "qwen2": (2, {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": (2, {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": (2, {"sliding_window": WINDOW, "attn_logit_softcapping": 50.0}),
    "gemma3_text": (2, {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo2": (2, {}),
    "phi3": (2, {"sliding_window": WINDOW}),
    "gpt_neox": (None, {}),
}
FAMILIES = list(TINY)


def tiny_config(model_type: str, **extra):
    kv, more = TINY[model_type]
    spec = ModelSpec(model_type, LAYERS, D, H, CONTEXT, VOCAB, d_ff=64, n_kv_head=kv, extra={**more, **extra})
    return model_config(spec)


def tiny_model(model_type: str, seed: int = 0, **extra):
    return build_model(tiny_config(model_type, **extra), seed=seed).eval()


def shape(model) -> tuple[int, int, int]:
    """(query heads, key heads, head size) read from the config as transformers does."""
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    return heads, kv, getattr(cfg, "head_dim", None) or hidden // heads


def attention_module(model, layer: int):
    mt = model.config.model_type
    if mt == "gpt2":
        return model.transformer.h[layer].attn
    if mt == "gpt_neox":
        return model.gpt_neox.layers[layer].attention
    return model.model.layers[layer].self_attn


def project(model, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [B, T, H*hd] and keys [B, T, Hkv*hd] of a layer, as its forward computes them (no norm, no rotary)."""
    attn, mt = attention_module(model, layer), model.config.model_type
    heads, kv, hd = shape(model)
    if mt == "gpt2":
        q, k, _ = attn.c_attn(x).split(heads * hd, dim=2)
        return q, k
    if mt == "gpt_neox":  # [B, T, H, 3*hd], each head's slice is q | k | v
        qkv = attn.query_key_value(x).view(*x.shape[:2], heads, 3 * hd)
        q, k, _ = qkv.chunk(3, dim=-1)
        return q.reshape(*x.shape[:2], -1), k.reshape(*x.shape[:2], -1)
    if mt == "phi3":
        qkv = attn.qkv_proj(x)
        return qkv[..., : heads * hd], qkv[..., heads * hd : (heads + kv) * hd]
    return attn.q_proj(x), attn.k_proj(x)


def stored_entry(model, layer: int, which: str, head: int, feature: int, inp: int) -> tuple[str, tuple[int, int]]:
    """(parameter name, stored index) of W_Q (which='q') or W_K ('k') entry: output feature `feature`
    of query head / key head `head`, input feature `inp`."""
    mt = model.config.model_type
    heads, kv, hd = shape(model)
    out = head * hd + feature
    if mt == "gpt2":  # Conv1D [in, 3d]: Q | K | V columns
        return f"transformer.h.{layer}.attn.c_attn.weight", (inp, out + (D if which == "k" else 0))
    if mt == "gpt_neox":  # rows per head [q_h | k_h | v_h]
        row = head * 3 * hd + (hd if which == "k" else 0) + feature
        return f"gpt_neox.layers.{layer}.attention.query_key_value.weight", (row, inp)
    if mt == "phi3":  # rows Q | K | V
        return f"model.layers.{layer}.self_attn.qkv_proj.weight", (out + (heads * hd if which == "k" else 0), inp)
    return f"model.layers.{layer}.self_attn.{which}_proj.weight", (out, inp)


def _window(cfg, layer: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window and types is not None and types[layer] != "sliding_attention":
        return None
    return window or None


def direct_max_logits(model, ids: torch.Tensor, ignore_window: bool = False) -> torch.Tensor:
    """[layers, heads] max over batch and allowed (query, key) pairs of scaled q.k, in float32.
    Logits before any soft-capping (see `direct_logits`)."""
    out = []
    for logits, allowed in direct_logits(model, ids, ignore_window):
        out.append(logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
    return torch.stack(out)


def direct_logits(model, ids: torch.Tensor, ignore_window: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: scaled q.k [B, H, T, T] in float32 and the allowed (query, key) pairs [T, T].

    Each attention module's input (and rotary cos / sin) is captured with a forward pre-hook; q and
    k are then computed here: projection, QK-norm where the family has one (Qwen3 and Gemma 3 per
    head, OLMo 2 over all features), rotary (the modeling module's own apply_rotary_pos_emb),
    grouped heads expanded, causal mask and sliding window. Logits before any soft-capping."""
    cfg = model.config
    heads, kv, hd = shape(model)
    n_layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    captured = {}
    hooks = []
    for i in range(n_layers):

        def hook(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            captured[i] = (x.detach(), kwargs.get("position_embeddings"))

        hooks.append(attention_module(model, i).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    scaling = (scalar if scalar else hd) ** -0.5
    out = []
    with torch.no_grad():
        for i in range(n_layers):
            x, pe = captured[i]
            attn = attention_module(model, i)
            b, t, _ = x.shape
            q, k = project(model, i, x)
            if cfg.model_type == "olmo2":
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.view(b, t, heads, hd), k.view(b, t, kv, hd)
            if cfg.model_type in ("qwen3", "gemma3_text"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            if pe is not None:
                rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
                q, k = rotary(q, k, *pe)
            k = k.repeat_interleave(heads // kv, dim=1)
            logits = (q.float() @ k.float().transpose(-1, -2)) * scaling  # [B, H, T, T]
            qi, ki = torch.arange(t)[:, None], torch.arange(t)[None, :]
            allowed = ki <= qi
            window = None if ignore_window else _window(cfg, i)
            if window:
                allowed &= ki > qi - window
            out.append((logits, allowed))
    return out


def scaled(model, factor: float = 6.0):
    """Larger 2-D weights, so logits are large and distinct and a wrong mask or scale shows."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(factor)
    return model.eval()


def plant_heads(model):
    """Plant W_Q[query head Q_HEAD] and W_K[key head KV_HEAD] entries in layer 1; check they are those heads'."""
    params = dict(model.named_parameters())
    x = torch.randn(1, 3, model.config.to_dict().get("hidden_size") or model.config.n_embd)
    with torch.no_grad():
        q0, k0 = (t.clone() for t in project(model, 1, x))
        for which, head, value in (("q", Q_HEAD, PLANT_Q), ("k", KV_HEAD, PLANT_K)):
            name, idx = stored_entry(model, 1, which, head, FEATURE, INPUT)
            params[name][idx] = value
        q1, k1 = project(model, 1, x)
    _, _, hd = shape(model)
    # the planted entries moved exactly the intended output feature of the projections
    for before, after, head in ((q0, q1, Q_HEAD), (k0, k1, KV_HEAD)):
        changed = (after != before).any(dim=(0, 1)).nonzero().flatten().tolist()
        assert changed == [head * hd + FEATURE]
    return model


def check_planted(stats, model_type):
    """The weight statistics of a model from :func:`plant_heads` find the planted entries in layer 1, in their heads."""
    heads, kv, hd = stats.n_heads, stats.n_kv_heads, stats.head_dim
    assert stats.architecture == model_type and stats.n_layers == 2 and heads == H
    l0, l1 = stats.layers
    assert (l1.q_max_norm, l1.k_max_norm) == (PLANT_Q, PLANT_K)
    assert l0.q_max_norm < 1.0 and l0.k_max_norm < 1.0
    assert l1.bound == PLANT_Q * PLANT_K
    for h in l1.heads:
        assert h.kv_head == h.head // (heads // kv)  # grouped query heads read key head h // group
        assert (h.q_max_norm == PLANT_Q) == (h.head == Q_HEAD)
        assert (h.k_max_norm == PLANT_K) == (h.kv_head == KV_HEAD)
        assert h.bound == h.q_max_norm * h.k_max_norm
    out_axis, in_axis = ("rows", "cols") if stats.row_axis == "output" else ("cols", "rows")
    q_out, k_out = getattr(l1, f"q_{out_axis}").outliers[0], getattr(l1, f"k_{out_axis}").outliers[0]
    assert (q_out.index, q_out.head, q_out.max_norm) == (Q_HEAD * hd + FEATURE, Q_HEAD, PLANT_Q)
    assert (k_out.index, k_out.head, k_out.max_norm) == (KV_HEAD * hd + FEATURE, KV_HEAD, PLANT_K)
    assert getattr(l1, f"k_{in_axis}").outliers[0].index == INPUT


def counted_reads(monkeypatch) -> list[str]:
    """The names of the stored tensors read from now on (through SafetensorsReader), in order."""
    from merit_core.checkpoint.resolve import SafetensorsReader

    reads: list[str] = []
    real = SafetensorsReader.__getitem__

    def counted(self, name):
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(SafetensorsReader, "__getitem__", counted)
    return reads
