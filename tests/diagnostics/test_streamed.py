"""`merit inspect`'s layered path reads each stored tensor once: the weight table, the layers' W_Q /
W_K statistics and the weights' part of the logit bounds come from the tensors the layer-at-a-time
probe reads (merit_core.diagnostics.streamed), and the report equals the whole-model path's, which
takes them from reads of its own."""

import math

import pytest
import torch

from merit_core.checkpoint.resolve import find_checkpoints
from merit_core.diagnostics import inspect_report as report
from merit_core.diagnostics.logit_bounds import spectral_norms
from merit_core.diagnostics.weights import head_grams, matrix_stats
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
def test_per_head_gram_products_give_the_spectral_and_l2_norms(axis):
    """The heads' Gram matrices (one batched float64 product) give each head's spectral norm and its
    features' squared l2 norms, as the head's own block does; a block that is not finite gives NaN
    for its head alone, and a copy into a reused buffer gives the same products."""
    heads, hd, d = 4, 8, 24
    w = torch.randn(heads * hd, d, generator=torch.Generator().manual_seed(1))
    w = w if axis == 0 else w.T.contiguous()
    blocks = [w.narrow(axis, h * hd, hd).double() for h in range(heads)]
    grams = head_grams(w, axis, heads, hd)
    reference = [float(torch.linalg.matrix_norm(b, ord=2)) for b in blocks]
    norms = spectral_norms(grams)
    assert norms == pytest.approx(reference, rel=1e-12)  # float64 eigenvalue of the Gram vs singular value
    squares = torch.cat([(b * b).sum(dim=1 - axis) for b in blocks])  # exact float32 products, float64 sums
    assert torch.allclose(grams.diagonal(dim1=1, dim2=2).reshape(-1), squares, rtol=1e-14, atol=0)
    scratch: dict = {}
    assert torch.equal(head_grams(w, axis, heads, hd, scratch), grams)
    assert torch.equal(head_grams(w, axis, heads, hd, scratch), grams) and len(scratch) == 1  # the buffer reused
    w.narrow(axis, 2 * hd, hd)[0, 0] = math.nan
    found = spectral_norms(head_grams(w, axis, heads, hd))
    assert math.isnan(found[2]) and [found[h] for h in (0, 1, 3)] == [norms[h] for h in (0, 1, 3)]


def test_the_max_norms_without_an_abs_temporary_are_those_of_abs():
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    w[1] = 0.0
    w[2] = -0.0
    w[3, 4] = -7.5
    stats = matrix_stats(w, top_k=2, head_axis=0, head_dim=2)
    assert [o.max_norm for o in stats["rows"].outliers] == w.abs().amax(dim=1).topk(2).values.tolist()
    assert stats["max_norm"] == 7.5 and stats["rows"].min == 0.0 and math.copysign(1, stats["rows"].min) == 1
    assert stats["cols"].max == float(w.abs().amax(dim=0).max())
    w[4, 0] = math.nan
    assert math.isnan(matrix_stats(w)["max_norm"])
