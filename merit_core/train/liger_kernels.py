"""Liger Kernel's Triton kernels for the families it supports, chosen per family and per run.

`kernels` in the run config: 'auto' (Liger's kernels on CUDA when liger-kernel is installed and
the family has a `LigerKernels` spec in merit_core.models, merit's own otherwise), 'liger' (insist:
a ConfigError when they cannot be used) or 'none' (plain transformers modules and merit's chunked
loss). On CPU 'auto' means 'none': Triton kernels need a GPU, or TRITON_INTERPRET=1 (tests).

What 'liger' changes, on this model instance only (other models in the process keep their modules):
- the loss: the output layer calls Liger's fused linear cross-entropy (merit_core.train.lm_loss
  takes it as the head's loss function), so no [batch, seq, vocab] logits exist;
- RMSNorm modules: Liger's RMSNorm kernel (with the family's casting mode and weight offset);
- the MLP: Liger's SwiGLU (or Phi-3's fused gate-up SwiGLU, or Gemma's GEGLU) kernel;
- RoPE: the family's modeling module's `apply_rotary_pos_emb` is replaced by a function that runs
  Liger's RoPE kernel for tensors a Triton kernel can take (CUDA, or any under TRITON_INTERPRET=1)
  and the original otherwise. This is the one change visible to the family's other models in the
  process; it computes the same rotation.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
from collections.abc import Callable

import torch

from merit_core.errors import ConfigError
from merit_core.models import family_spec
from merit_core.models.family import LigerKernels
from merit_core.settings import KERNELS

CAUSAL_SDPA = "merit_causal_sdpa"
INSTALL_HINT = "pip install 'merit-optim[gpu]' (liger-kernel)"


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _triton_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def choose_kernels(setting: str, model_config, device: torch.device) -> str:
    """'liger' or 'none' for a run's `kernels` setting, model and device (ConfigError when
    'liger' is asked for and cannot be had)."""
    if setting not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {setting!r}")
    if setting == "none":
        return "none"
    spec = family_spec(model_config)
    if setting == "auto":
        return "liger" if spec.liger is not None and device.type == "cuda" and liger_installed() else "none"
    if spec.liger is None:
        raise ConfigError(f"kernels=liger: Liger Kernel has no kernels for {spec.label} models; use --set kernels=auto")
    if not liger_installed():
        raise ConfigError(f"kernels=liger needs liger-kernel: {INSTALL_HINT}, or use --set kernels=none")
    if not _triton_can_run(device):
        raise ConfigError(f"kernels=liger needs a CUDA device (this run is on {device.type}); use --set kernels=none")
    return "liger"


def apply_liger(
    model: torch.nn.Module, *, loss: bool = True, rms_norm: bool = True, mlp: bool = True, rope: bool = True
) -> Callable | None:
    """Switch `model`'s modules to Liger's kernels (see the module docstring); return the fused
    linear cross-entropy for merit_core.train.lm_loss when `loss`, else None. The flags exist so
    that each kernel can be checked on its own."""
    spec: LigerKernels | None = family_spec(model.config).liger
    if spec is None:
        raise ConfigError(f"Liger Kernel has no kernels for {family_spec(model.config).label} models")
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    for module in model.modules():
        name = type(module).__name__
        if rms_norm and name.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
            _patch_rms_norm(module, spec, LigerRMSNorm)
        elif mlp and name.endswith("MLP"):
            _patch_mlp(module, spec)
    if rope:
        _patch_rope(spec.modeling)
    if not loss:
        return None
    flce = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)

    def fused_linear_cross_entropy(hidden, weight, bias, target):
        return flce(weight, hidden, target, bias)

    return fused_linear_cross_entropy


def _patch_rms_norm(module: torch.nn.Module, spec: LigerKernels, liger_cls) -> None:
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or 1e-6
    settings = {
        "variance_epsilon": eps,
        "offset": spec.rms_offset,
        "casting_mode": spec.rms_norm,
        "in_place": False,  # the input's gradient may feed a residual branch too
        "row_mode": None,
    }
    for name, value in settings.items():  # through setattr: nn.Module's __setattr__ is typed for tensors only
        setattr(module, name, value)
    module.forward = types.MethodType(liger_cls.forward, module)


def _patch_mlp(module: torch.nn.Module, spec: LigerKernels) -> None:
    needed: tuple[str, ...]
    if spec.mlp == "phi3":
        from liger_kernel.transformers.swiglu import LigerPhi3SwiGLUMLP as cls

        needed = ("gate_up_proj", "down_proj")
    elif spec.mlp == "geglu":
        from liger_kernel.transformers.geglu import LigerGEGLUMLP as cls

        needed = ("gate_proj", "up_proj", "down_proj")
    else:
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP as cls

        needed = ("gate_proj", "up_proj", "down_proj")
    if all(hasattr(module, n) for n in needed):
        module.forward = types.MethodType(cls.forward, module)


def _patch_rope(modeling: str) -> None:
    """Make `modeling.apply_rotary_pos_emb` run Liger's RoPE where Triton can run (idempotent)."""
    mod = importlib.import_module(modeling)
    current = mod.apply_rotary_pos_emb
    if getattr(current, "_merit_liger", False):
        return
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _triton_can_run(q.device) and q.shape[-1] == cos.shape[-1]:  # full-width rotary only
            return liger_rotary_pos_emb(q, k, cos, sin, *args, **kwargs)
        return current(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._merit_liger = True  # type: ignore[attr-defined]  # a marker on the function
    apply_rotary_pos_emb._merit_original = current  # type: ignore[attr-defined]  # the function it wraps
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]  # patches transformers' module


def mask_free_attention(model: torch.nn.Module) -> bool:
    """Train a plain causal model through SDPA's `is_causal` path with no mask built per forward.

    transformers builds an attention mask in every forward, and for a batch without an attention
    mask it first checks the position ids for packed sequences with a tensor -> bool read: a host
    sync at the start of every micro-batch's forward on CUDA. Registered under its own name with
    no mask function, transformers' SDPA attention gets no mask and runs causal (the same result:
    merit's training batches are unpadded windows). Only for models on SDPA without sliding-window
    layers; True when switched. The name is not saved with the model's config.
    """
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(model, PreTrainedModel):
        return False
    config = model.config
    if config._attn_implementation != "sdpa" or any(w is not None for w in family_spec(config).sliding_windows(config)):
        return False
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    model.set_attn_implementation(CAUSAL_SDPA)
    return True
