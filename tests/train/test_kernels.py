"""Liger Kernel per family (merit_core.train.liger_kernels): the choice, and the kernels against the plain
path under Triton's interpreter on CPU tensors.

As in tests/optim/test_merit_triton.py, TRITON_INTERPRET=1 must be set before triton is first
imported, so in an ordinary process the interpreted cases run in a child pytest of this file with
the variable set. Under the interpreter (liger-kernel 0.8.5, triton 3.9) Liger's fused linear
cross-entropy and RoPE run; its RMSNorm and SwiGLU kernels do not (their kernels call `.to` on a
Python float scalar, which only the compiler accepts), so here those two are checked for being
wired to the right modules, and tests/gpu/test_gpu.py checks all four on a GPU.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest
import torch
import torch.nn.functional as F

from merit_core.errors import ConfigError
from merit_core.models import all_families, build_model, family_spec, model_config
from merit_core.train import liger_kernels, lm_loss
from tests.interpreted import run_under_interpreter

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed: pip install -e '.[dev,triton]'")

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _tiny(name: str, vocab: int = 97):
    return build_model(model_config(name, vocab_size=vocab, context=32), seed=0)


def test_kernels_are_chosen_per_family_and_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    llama, gpt2 = model_config("llama-tiny"), model_config("gpt2-tiny")
    assert liger_kernels.choose_kernels("auto", llama, cpu) == "none"  # the CPU default path is unchanged
    assert liger_kernels.choose_kernels("auto", llama, cuda) == "liger"
    assert liger_kernels.choose_kernels("auto", gpt2, cuda) == "none"  # no Liger kernels for GPT-2: merit's loss
    assert liger_kernels.choose_kernels("none", llama, cuda) == "none"
    with pytest.raises(ConfigError, match="no kernels for GPT-2"):
        liger_kernels.choose_kernels("liger", gpt2, cuda)
    with pytest.raises(ConfigError, match="needs a CUDA device.*kernels=none"):
        liger_kernels.choose_kernels("liger", llama, cpu)
    monkeypatch.setattr(liger_kernels, "liger_installed", lambda: False)
    assert liger_kernels.choose_kernels("auto", llama, cuda) == "none"
    with pytest.raises(ConfigError, match=r"merit-optim\[gpu\]"):
        liger_kernels.choose_kernels("liger", llama, cuda)
    from merit_core.train.config import load_config

    with pytest.raises(ConfigError, match="kernels must be one of auto, liger, none"):
        load_config(overrides=["kernels=fast"])
    supported = {f.model_type for f in all_families() if f.liger}
    assert supported == {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3"}


def _loss_and_grads(model, x, y, head_args=None):
    model.zero_grad(set_to_none=True)
    if head_args is None:
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    else:
        head = lm_loss.install(model, **head_args)
        with lm_loss.targets_for(head, y):
            loss = model(input_ids=x, use_cache=False).logits
    (loss * 0.5).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_grads_close(grads, ref, rel):
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=rel * float(g.abs().max()), msg=name)


def test_liger_fused_loss_and_rope_equal_the_plain_path():
    """Liger's fused linear cross-entropy (through merit's LossHead) and its RoPE kernel on a tiny
    Llama (GQA) and Qwen3 (QK-norm): loss within 1e-6 relative, every gradient within 1e-5 of its
    largest entry (measured on CPU, fp32: loss 7e-8, gradients 1.0e-6)."""
    from merit_core.train.training_run import TrainingRun  # noqa: F401  (the import graph a run has)

    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 97, (2, 12), generator=gen)
    y = torch.randint(0, 97, (2, 12), generator=gen)
    for name in ("llama-tiny", "qwen3-tiny"):
        model = _tiny(name)
        ref_loss, ref = _loss_and_grads(model, x, y)
        loss_fn = liger_kernels.apply_liger(model, rms_norm=False, mlp=False)  # the two kernels the interpreter runs
        modeling = importlib.import_module(family_spec(model.config).liger.modeling)
        assert modeling.apply_rotary_pos_emb._merit_liger
        loss, grads = _loss_and_grads(model, x, y, {"loss_fn": loss_fn})
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        _assert_grads_close(grads, ref, 1e-5)


def test_liger_rms_norm_and_mlp_are_wired_per_family():
    from liger_kernel.transformers.geglu import LigerGEGLUMLP
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerPhi3SwiGLUMLP, LigerSwiGLUMLP

    expected = {"llama-tiny": LigerSwiGLUMLP, "phi3-tiny": LigerPhi3SwiGLUMLP, "gemma3-tiny": LigerGEGLUMLP}
    for name, mlp in expected.items():
        model = _tiny(name)
        liger_kernels.apply_liger(model, loss=False, rope=False)
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(m.forward.__func__ is LigerRMSNorm.forward and not m.in_place for m in norms)
        offset = 1.0 if name.startswith("gemma") else 0.0
        assert all(m.offset == offset and m.casting_mode == ("gemma" if offset else "llama") for m in norms)
        mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
        assert mlps and all(m.forward.__func__ is mlp.forward for m in mlps)
        assert set(model.state_dict()) == set(_tiny(name).state_dict())  # names (checkpoints) unchanged


if not _INTERPRETED:
    for _name in (
        "test_liger_fused_loss_and_rope_equal_the_plain_path",
        "test_liger_rms_norm_and_mlp_are_wired_per_family",
    ):
        del globals()[_name]

    @pytest.mark.float_compare
    def test_liger_under_the_interpreter():
        """The cases above, in a child pytest with TRITON_INTERPRET=1 (see the module docstring)."""
        summary, report = run_under_interpreter(__file__)
        assert re.fullmatch(r"3 passed in .*", summary), report
