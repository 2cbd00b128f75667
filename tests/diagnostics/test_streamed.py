"""`merit inspect`'s layered path reads each stored tensor once: the weight table, the layers' W_Q /
W_K statistics and the weights' part of the logit bounds come from the tensors the layer-at-a-time
probe reads (merit_core.diagnostics.streamed), and the report equals the whole-model path's, which
takes them from reads of its own."""

import math

import pytest
import torch

from merit_core.checkpoint.resolve import find_checkpoints
from merit_core.diagnostics import inspect_report as report
from merit_core.diagnostics.logit_bounds import _spectral, _spectral_heads
from tests.models.family_models import counted_reads, tiny_model


def _reads(monkeypatch) -> list[str]:
    return counted_reads(monkeypatch)


# fused QKV with biases and a tied head (gpt2), per-head fused rows (gpt_neox), QK-norm (qwen3), QK-norm
# with Gemma's 1 + weight gain and a tied head (gemma3_text), separate W_Q / W_K with key heads (llama)
@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "qwen3", "gemma3_text", "llama"])
def test_layered_inspect_reads_each_tensor_once_with_the_same_report(model_type, tmp_path, monkeypatch):
    tiny_model(model_type, seed=3).to(torch.bfloat16).save_pretrained(tmp_path / model_type)
    ckpt = find_checkpoints(tmp_path / model_type)[0]
    opts = report.InspectOptions(verify=False)
    reads = _reads(monkeypatch)
    layered = report.inspect_paths([ckpt.path], opts).to_dict()
    tied = {"gpt2": {"transformer.wte.weight"}, "gemma3_text": {"model.embed_tokens.weight"}}.get(model_type, set())
    assert {n for n in reads if reads.count(n) > 1} == tied  # a tied head reads its embedding again, nothing else
    assert set(reads) == set(ckpt.tensors)
    monkeypatch.setattr(report, "probe_layered", lambda *args: False)
    whole = report.inspect_paths([ckpt.path], opts).to_dict()
    assert layered == whole
    first = layered["checkpoints"][0]
    assert first["layers"][0]["q_max_norm"] and first["layers"][0]["spectral_logit_bound"]


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "columns"])
def test_batched_spectral_norms_are_the_per_head_ones(axis):
    """The batched per-head spectral norms are the same float64 products and eigenvalue calls as
    the per-head ones: equal numbers; a block that is not finite gives NaN for its head alone."""
    heads, hd, d = 4, 8, 24
    w = torch.randn(heads * hd, d, generator=torch.Generator().manual_seed(1))
    w = w if axis == 0 else w.T.contiguous()
    per_head = [_spectral(w, axis, h, hd) for h in range(heads)]
    assert _spectral_heads(w, axis, heads, hd, finite=True) == per_head
    reference = [float(torch.linalg.matrix_norm(w.narrow(axis, h * hd, hd).double(), ord=2)) for h in range(heads)]
    assert per_head == pytest.approx(reference, rel=1e-12)  # float64 eigenvalue of the Gram vs singular value
    w.narrow(axis, 2 * hd, hd)[0, 0] = math.nan
    found = _spectral_heads(w, axis, heads, hd, finite=False)
    assert math.isnan(found[2]) and [found[h] for h in (0, 1, 3)] == [per_head[h] for h in (0, 1, 3)]
